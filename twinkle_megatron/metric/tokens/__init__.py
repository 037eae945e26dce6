"""Layer 3, token operations shared by metrics: the one pass over a microbatch's logits, the logits metrics' base,
sequence totals over CP.
"""
