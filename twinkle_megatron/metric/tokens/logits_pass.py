"""Per-token statistics of logits, aligned with the labels, computed once per microbatch.

Every metric that reads logits (Accuracy, GRPO's entropy, …) gets them from
:func:`logits_token_stats`. It matches the logits layout to the labels
(``[b, s, v]``, Megatron's ``[s, b, v]``, or packed ``[t, v]``), runs the
vocab-parallel pass over this rank's vocab shard (two TP collectives), and
returns per-token results shaped like the labels. Inside
:func:`sharing_token_stats` (which :class:`MetricCollection` opens around each
``accumulate``) the pass runs once per microbatch, whatever the number of
metrics reading it; only per-token results are cached, never the logits.

Each reader names the statistics it needs (``statistics``: a subset of
:data:`STATISTICS`; a metric class declares them in its ``token_statistics``).
When no reader of the block needs a probability, the pass is the argmax-only
one (:func:`.vocab_parallel_argmax_stats`: no exp, one TP collective); else the
full pass (two TP collectives) serves every reader.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator, NamedTuple, Optional, Union

import torch

from ...ops import ArgmaxStats, TokenStats, vocab_parallel_argmax_stats, vocab_parallel_token_stats
from ...parallel import ParallelContext
from ..inputs.call_cache import call_values, sharing_call_values
from ..inputs.tensors import all_finite, to_device

LAYOUTS = ("bsv", "sbv")
STATISTICS = ("argmax", "logprobs", "entropy")
PROBABILITIES = frozenset(("logprobs", "entropy"))  # what only the full pass (an exp per logit) gives
_NEEDS = "statistics"  # the hint holding the statistics the block's readers declared
Statistics = Union[TokenStats, ArgmaxStats]


@contextlib.contextmanager
def sharing_token_stats(statistics: Iterable[str] = STATISTICS) -> Iterator[None]:
    """Within the block, the statistics of a (logits, labels) pair are computed once: the first reader
    computes what ``statistics`` (the union of the block's readers' declarations) names."""
    with sharing_call_values(**{_NEEDS: frozenset(statistics)}):
        yield


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
                       ignore_index: int = -100, cache_key: Optional[int] = None,
                       statistics: Iterable[str] = STATISTICS) -> Statistics:
    """argmax, label log-prob and entropy of each token, shaped like ``labels``.

    ``logits`` is this rank's vocab shard when ``context.tp_size > 1``.
    ``cache_key`` identifies the caller's logits when ``logits`` is a CP cut of them.
    ``statistics`` names what the caller reads: without ``logprobs`` and ``entropy`` (and when no reader
    of the :func:`sharing_token_stats` block needs them) the result is an :class:`.ArgmaxStats`.
    """
    layout = resolve_layout(logits, labels, layout)
    # The logits identify the microbatch: every metric of a collection gets the same inputs, so
    # the labels paired with these logits are the same (possibly re-concatenated) tokens.
    key = (id(logits) if cache_key is None else cache_key, vocab_size, layout, ignore_index)
    cache = call_values()
    needs_probabilities = not PROBABILITIES.isdisjoint(statistics)
    if cache is not None:
        cached = cache.get(key)
        if cached is not None and (isinstance(cached, TokenStats) or not needs_probabilities):
            return cached
        # An undeclared reader after an argmax-only one costs a second pass, never a wrong result.
        needs_probabilities = needs_probabilities or not PROBABILITIES.isdisjoint(cache.get(_NEEDS, STATISTICS))
    group = context.tp_group if context.tp_size > 1 else None
    if needs_probabilities:
        aligned_labels = labels.t() if layout == "sbv" else labels
        stats = vocab_parallel_token_stats(logits, to_device(aligned_labels, logits.device), group=group,
                                           vocab_size=vocab_size, ignore_index=ignore_index)
    else:
        stats = vocab_parallel_argmax_stats(logits, group=group, vocab_size=vocab_size)
    if layout == "sbv":
        stats = transposed(stats)
    if cache is not None:
        # Holding the logits' id is safe: the caller's outputs keep them alive for the whole block.
        cache[key] = stats
    return stats


def transposed(stats: Statistics) -> Statistics:
    """The statistics of ``[s, b]`` tokens as ``[b, s]`` (the labels' layout)."""
    if isinstance(stats, ArgmaxStats):
        return ArgmaxStats(stats.argmax.t(), stats.finite.t(), stats.vocab_size)
    return TokenStats(*(None if s is None else s.t() for s in stats))


def check_vocab_size(vocab_size: Optional[int]) -> Optional[int]:
    """``vocab_size`` if it is None or a positive int; ``ValueError`` otherwise (per call as in constructors)."""
    if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1):
        raise ValueError(f"vocab_size must be a positive int or None, got {vocab_size!r}")
    return vocab_size


class TokenClasses(NamedTuple):
    """Which masked tokens count, and why the others do not (boolean, shaped like the labels)."""

    counted: torch.Tensor  # finite logits and a label inside the vocabulary
    nonfinite: torch.Tensor  # a NaN or infinite logit
    invalid_label: torch.Tensor  # finite logits, label outside [0, vocab_size)


def classify_tokens(stats: Statistics, mask: torch.Tensor, labels: Optional[torch.Tensor] = None) -> TokenClasses:
    """Split the tokens of ``mask`` by what the statistics say about them (device ops only).

    The ops give a NaN log-prob to every token with a non-finite logit or a label outside the
    vocabulary (and 0 to ignored labels, which ``mask`` leaves out), so a counted token is one
    whose log-prob is a number; a NaN one is non-finite when its entropy is, else an invalid label.
    :class:`.ArgmaxStats` carry no log-prob: they say ``finite`` themselves and a label (``labels``,
    needed then) is in the vocabulary when ``0 <= label < stats.vocab_size`` -- the same classes.
    """
    mask = to_device(mask, stats.argmax.device)
    if isinstance(stats, ArgmaxStats):
        finite = stats.finite
        labels = to_device(labels, finite.device)
        scored = finite & (labels >= 0) & (labels < stats.vocab_size)
    else:
        scored = ~torch.isnan(stats.logprobs)
        finite = all_finite([stats.entropy])
    counted, nonfinite = mask & scored, mask & ~finite
    # A scored token is finite, so the three classes split the mask: the invalid ones are the rest (two ops).
    return TokenClasses(counted, nonfinite, mask ^ counted ^ nonfinite)


def shared_token_classes(stats: Statistics, labels: torch.Tensor, mask: torch.Tensor) -> TokenClasses:
    """The classes of a microbatch's counted tokens (``mask``: its view's), computed once per microbatch for all
    metrics of a collection: inside :func:`sharing_token_stats` the result is kept next to the statistics it was
    made from (the same statistics, labels and mask objects give the same classes)."""
    key = ("classes", id(stats), id(labels), id(mask))
    cache = call_values()
    if cache is not None and key in cache:
        return cache[key][0]
    classes = classify_tokens(stats, mask, labels)
    if cache is not None:
        # The keyed objects are kept with the entry: their ids cannot be reused while the block lasts.
        cache[key] = (classes, stats, labels, mask)
    return classes
