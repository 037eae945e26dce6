"""Full-vocabulary references: what the token statistics must be, from full logits, in float64, plain torch.

The one place for the arithmetic the tests compare with. Columns at or past
``vocab_size`` are Megatron's vocabulary padding: they are cut off before
anything is computed, so they never win the argmax and carry no probability.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from twinkle_megatron.ops import TokenStats

IGNORE_INDEX = -100


def full_vocab_stats(logits: torch.Tensor, labels: Optional[torch.Tensor] = None,
                     vocab_size: Optional[int] = None) -> TokenStats:
    """Per token of ``logits [..., V]``, over columns ``[0, vocab_size)`` (all of them by default), in float64:

    * ``argmax``: the first column of the largest logit (``torch.argmax``: lowest index on ties);
    * ``logprobs``: ``log_softmax(x)[label]``; ``0`` where the label is ``-100`` (ignored), NaN where the
      label is outside ``[0, vocab_size)`` or the token's logits are not all finite; None without labels;
    * ``entropy``: ``−Σ_v p_v log p_v`` with ``p = softmax(x)`` (NaN for a token with a non-finite logit).
    """
    x = logits[..., :vocab_size].double()
    vocab = x.shape[-1]
    log_p = torch.log_softmax(x, dim=-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    logprobs = None
    if labels is not None:
        picked = log_p.gather(-1, labels.clamp(0, vocab - 1).unsqueeze(-1)).squeeze(-1)
        valid = torch.isfinite(x).all(-1) & (labels >= 0) & (labels < vocab)
        logprobs = torch.where(labels == IGNORE_INDEX, 0.0, torch.where(valid, picked, math.nan))
    return TokenStats(x.argmax(-1), logprobs, entropy)


def counted_tokens(labels: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The tokens a metric counts: label not ``-100`` and, when given, ``mask`` (a completion or loss mask) set."""
    counted = labels != IGNORE_INDEX
    return counted if mask is None else counted & mask.bool()


def accuracy_reference(logits: torch.Tensor, labels: torch.Tensor, mask: Optional[torch.Tensor] = None,
                       vocab_size: Optional[int] = None) -> dict:
    """``Accuracy``'s keys: ``correct_tokens / total_tokens`` over the counted tokens (see ``counted_tokens``)."""
    counted = counted_tokens(labels, mask)
    correct = int(((full_vocab_stats(logits, vocab_size=vocab_size).argmax == labels) & counted).sum())
    total = int(counted.sum())
    return {"accuracy": correct / total, "correct_tokens": correct, "total_tokens": total}


def token_stats_reference(logits: torch.Tensor, labels: torch.Tensor, mask: Optional[torch.Tensor] = None,
                          vocab_size: Optional[int] = None) -> dict:
    """``TokenStatsMetric``'s keys: the label log-prob and the entropy, each averaged over the counted tokens."""
    counted = counted_tokens(labels, mask)
    stats = full_vocab_stats(logits, labels, vocab_size)
    return {"logprob": float(stats.logprobs[counted].mean()), "entropy": float(stats.entropy[counted].mean())}
