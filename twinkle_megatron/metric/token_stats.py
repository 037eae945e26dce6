"""Per-token statistics of logits, aligned with the labels, computed once per microbatch.

Every metric that reads logits (Accuracy, GRPO's entropy, …) gets them from
:func:`logits_token_stats`. It matches the logits layout to the labels
(``[b, s, v]``, Megatron's ``[s, b, v]``, or packed ``[t, v]``), runs the
vocab-parallel pass over this rank's vocab shard (two TP collectives), and
returns per-token results shaped like the labels. Inside
:func:`sharing_token_stats` (which :class:`MetricCollection` opens around each
``accumulate``) the pass runs once per microbatch, whatever the number of
metrics reading it; only per-token results are cached, never the logits.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Any, Iterator, Mapping, NamedTuple, Optional

import torch

from ..ops import TokenStats, vocab_parallel_token_stats
from ..parallel import ParallelContext
from .inputs import to_device

LAYOUTS = ("bsv", "sbv")

_cache: ContextVar[Optional[dict]] = ContextVar("twinkle_megatron_token_stats", default=None)


@contextlib.contextmanager
def sharing_token_stats() -> Iterator[None]:
    """Within the block, the statistics of a (logits, labels) pair are computed once."""
    token = _cache.set({})
    try:
        yield
    finally:
        _cache.reset(token)


def resolve_layout(logits: torch.Tensor, labels: torch.Tensor, layout: Optional[str] = None) -> str:
    """``'bsv'`` when ``logits.shape[:-1] == labels.shape``, ``'sbv'`` when it is the transpose.

    A square ``[n, n]`` label tensor matches both; then ``layout`` decides
    (default ``'bsv'``). Anything else is a ``ValueError`` naming both shapes.
    """
    if layout is not None and layout not in LAYOUTS:
        raise ValueError(f"logits_layout must be one of {LAYOUTS} or None, got {layout!r}")
    token_shape, label_shape = tuple(logits.shape[:-1]), tuple(labels.shape)
    matches_bsv = token_shape == label_shape
    matches_sbv = labels.dim() == 2 and token_shape == label_shape[::-1]
    if layout == "sbv" and matches_sbv or layout in (None, "bsv") and matches_bsv:
        return layout or "bsv"
    if layout is None and matches_sbv:
        return "sbv"
    expected = {"bsv": f"{label_shape + ('V',)}", "sbv": f"{label_shape[::-1] + ('V',)}"}
    wanted = expected[layout] if layout else f"{expected['bsv']} or {expected['sbv']}"
    raise ValueError(f"labels has shape {label_shape} but logits has shape {tuple(logits.shape)} "
                     f"(expected logits of shape {wanted})")


def logits_token_stats(logits: torch.Tensor, labels: torch.Tensor, context: ParallelContext,
                       vocab_size: Optional[int] = None, layout: Optional[str] = None,
                       ignore_index: int = -100) -> TokenStats:
    """argmax, label log-prob and entropy of each token, shaped like ``labels``.

    ``logits`` is this rank's vocab shard when ``context.tp_size > 1``.
    """
    layout = resolve_layout(logits, labels, layout)
    # The logits identify the microbatch: every metric of a collection gets the same inputs, so
    # the labels paired with these logits are the same (possibly re-concatenated) tokens.
    key = (id(logits), vocab_size, layout, ignore_index)
    cache = _cache.get()
    if cache is not None and key in cache:
        return cache[key]
    aligned_labels = labels.t() if layout == "sbv" else labels
    stats = vocab_parallel_token_stats(logits, to_device(aligned_labels, logits.device),
                                       group=context.tp_group if context.tp_size > 1 else None,
                                       vocab_size=vocab_size, ignore_index=ignore_index)
    if layout == "sbv":
        stats = TokenStats(*(None if s is None else s.t() for s in stats))
    if cache is not None:
        # Holding the logits' id is safe: the caller's outputs keep them alive for the whole block.
        cache[key] = stats
    return stats


def microbatch_token_stats(batch: Mapping[str, Any], output: Mapping[str, Any], context: ParallelContext,
                           vocab_size: Optional[int] = None, layout: Optional[str] = None,
                           ignore_index: int = -100) -> TokenStats:
    """The token statistics of one microbatch: ``output['token_stats']`` when a hook already
    computed them (shaped like the labels), else computed from ``output['logits']``."""
    labels = batch.get("labels")
    if labels is None:
        raise ValueError("token statistics need inputs['labels']")
    stats = output.get("token_stats")
    if stats is not None:
        if tuple(stats.argmax.shape) != tuple(labels.shape):
            raise ValueError(f"labels has shape {tuple(labels.shape)} but token_stats has shape "
                             f"{tuple(stats.argmax.shape)}")
        return stats
    return logits_token_stats(output["logits"], labels, context, vocab_size, layout, ignore_index)


class TokenClasses(NamedTuple):
    """Which masked tokens count, and why the others do not (boolean, shaped like the labels)."""

    counted: torch.Tensor  # finite logits and a label inside the vocabulary
    nonfinite: torch.Tensor  # a NaN or infinite logit
    invalid_label: torch.Tensor  # finite logits, label outside [0, vocab_size)


def classify_tokens(stats: TokenStats, mask: torch.Tensor) -> TokenClasses:
    """Split the tokens of ``mask`` by what the statistics say about them (device ops only)."""
    mask = to_device(mask, stats.entropy.device)
    finite = torch.isfinite(stats.entropy)
    valid_label = ~torch.isnan(stats.logprobs)
    return TokenClasses(mask & finite & valid_label, mask & ~finite, mask & finite & ~valid_label)
