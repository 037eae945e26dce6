"""Vocab-parallel token statistics (argmax, label log-prob, entropy) in at most two TP collectives.

``logits`` is always this rank's vocabulary shard ``[..., V_local]`` (rank ``r``
of ``group`` holds global columns ``[r*V_local, (r+1)*V_local)``); results have
shape ``logits.shape[:-1]`` and are identical on every rank of ``group``.
``group=None`` or a group of one rank means the whole vocabulary is local.
"""

from .token_stats import (
    ArgmaxStats,
    TokenStats,
    vocab_parallel_argmax,
    vocab_parallel_argmax_stats,
    vocab_parallel_entropy,
    vocab_parallel_logprobs,
    vocab_parallel_token_stats,
)

__all__ = [
    "ArgmaxStats",
    "TokenStats",
    "vocab_parallel_argmax",
    "vocab_parallel_argmax_stats",
    "vocab_parallel_entropy",
    "vocab_parallel_logprobs",
    "vocab_parallel_token_stats",
]
