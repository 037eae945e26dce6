"""Layer 4, the language-model metrics: accuracy, loss, token statistics, per-sample losses, embeddings, MoE
routing, training values.
"""
