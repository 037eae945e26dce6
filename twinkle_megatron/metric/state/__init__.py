"""Layer 2, state and sync: the Metric base (states declared once with their reduction), updates, per-dataset and
per-position slices, the one coalesced sync, resuming.
"""
