"""Per-token statistics of logits, aligned with the labels, computed once per microbatch.

:func:`logits_token_stats` matches the logits layout to the labels (``[b, s, v]``,
Megatron's ``[s, b, v]``, or packed ``[t, v]``), runs the vocab-parallel pass over
this rank's vocab shard (two TP collectives), and returns per-token results shaped
like the labels; :func:`classify_tokens` splits a microbatch's selected tokens by
what the statistics say of them.

The metrics of one call (a :class:`.SharedCall`) read both through
:func:`call_token_stats` and :func:`call_token_classes`: the pass runs once per
microbatch, and its tokens are classified once per selection rule, whatever
the number of metrics reading them; only per-token results are kept, never the
logits. ``instrument()`` hands its call the statistics and classes its hooks made
(:func:`give_token_classes`), so its tokens are classified once per microbatch.

Each reader names the statistics it needs (``statistics``: a subset of
:data:`STATISTICS`; a metric class declares them in its ``token_statistics``).
When no reader of the call needs a probability, the pass is the argmax-only
one (:func:`.vocab_parallel_argmax_stats`: no exp, one TP collective); else the
full pass (two TP collectives) serves every reader.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple, Optional, Union

import torch

from ...ops import ArgmaxStats, TokenStats, vocab_parallel_argmax_stats, vocab_parallel_token_stats
from ...parallel import ParallelContext
from ..inputs.shared_call import SharedCall
from ..inputs.tensors import all_finite, to_device
from ..inputs.view import MicrobatchView

LAYOUTS = ("bsv", "sbv")
STATISTICS = ("argmax", "logprobs", "entropy")
PROBABILITIES = frozenset(("logprobs", "entropy"))  # what only the full pass (an exp per logit) gives
Statistics = Union[TokenStats, ArgmaxStats]


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
                       ignore_index: int = -100, statistics: Iterable[str] = STATISTICS) -> Statistics:
    """argmax, label log-prob and entropy of each token, shaped like ``labels``.

    ``logits`` is this rank's vocab shard when ``context.tp_size > 1``.
    ``statistics`` names what the caller reads: without ``logprobs`` and ``entropy`` the result is an
    :class:`.ArgmaxStats` (the argmax-only pass).
    """
    layout = resolve_layout(logits, labels, layout)
    group = context.tp_group if context.tp_size > 1 else None
    if not PROBABILITIES.isdisjoint(statistics):
        aligned_labels = labels.t() if layout == "sbv" else labels
        stats = vocab_parallel_token_stats(logits, to_device(aligned_labels, logits.device), group=group,
                                           vocab_size=vocab_size, ignore_index=ignore_index)
    else:
        stats = vocab_parallel_argmax_stats(logits, group=group, vocab_size=vocab_size)
    return transposed(stats) if layout == "sbv" else stats


def call_token_stats(call: SharedCall, view: MicrobatchView, logits: torch.Tensor, context: ParallelContext,
                     vocab_size: Optional[int], layout: Optional[str], ignore_index: int,
                     statistics: Iterable[str]) -> Statistics:
    """:func:`logits_token_stats` of the view's microbatch (``logits``: its logits, the view's labels), once per
    call: the first reader computes what it and the call's declared readers (``call.statistics``) need.

    Key: the microbatch's index in the call and its tokens' shape (the logits of a microbatch, cut or not, are
    named by the tokens they cover), and the pass's options. An undeclared reader of probabilities after an
    argmax-only pass costs a second pass, never a wrong result.
    """
    labels = view.labels
    key = ("token_stats", view.index, tuple(labels.shape), vocab_size, layout, ignore_index)
    needs_probabilities = not PROBABILITIES.isdisjoint(statistics)
    kept = call.get(key)
    if kept is not None and (isinstance(kept, TokenStats) or not needs_probabilities):
        return kept
    declared = STATISTICS if call.statistics is None else call.statistics
    wanted = STATISTICS if needs_probabilities or not PROBABILITIES.isdisjoint(declared) else ("argmax",)
    stats = logits_token_stats(logits, labels, context, vocab_size, layout, ignore_index, wanted)
    call.give(key, stats)
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
    """Which selected tokens count, and why the others do not (boolean, shaped like the labels)."""

    counted: torch.Tensor  # finite logits and a label inside the vocabulary
    nonfinite: torch.Tensor  # a NaN or infinite logit
    invalid_label: torch.Tensor  # finite logits, label outside [0, vocab_size)


def classify_tokens(stats: Statistics, selected: torch.Tensor, labels: Optional[torch.Tensor] = None
                    ) -> TokenClasses:
    """Split the ``selected`` tokens by what the statistics say about them (device ops only).

    The ops give a NaN log-prob to every token with a non-finite logit or a label outside the
    vocabulary (and 0 to ignored labels, which are never selected), so a counted token is one
    whose log-prob is a number; a NaN one is non-finite when its entropy is, else an invalid label.
    :class:`.ArgmaxStats` carry no log-prob: they say ``finite`` themselves and a label (``labels``,
    needed then) is in the vocabulary when ``0 <= label < stats.vocab_size`` -- the same classes.
    """
    selected = to_device(selected, stats.argmax.device)
    if isinstance(stats, ArgmaxStats):
        finite = stats.finite
        labels = to_device(labels, finite.device)
        passes_checks = finite & (labels >= 0) & (labels < stats.vocab_size)
    else:
        passes_checks = ~torch.isnan(stats.logprobs)
        finite = all_finite([stats.entropy])
    counted, nonfinite = selected & passes_checks, selected & ~finite
    # A token that passes the checks is finite, so the three classes split the selected tokens: the invalid
    # ones are the rest (two ops).
    return TokenClasses(counted, nonfinite, selected ^ counted ^ nonfinite)


def token_classes_key(index: int, token_shape: tuple, stats_source: tuple, selected_rule: tuple) -> tuple:
    """The name of a microbatch's token classes in its call: its index and tokens' shape, where its statistics
    came from (``("logits", vocab_size, layout, ignore_index)`` or ``("given",)``: the call's ``token_stats``),
    and the rule that selected the tokens (:attr:`.MicrobatchView.selected_rule`)."""
    return ("token_classes", index, token_shape, stats_source, selected_rule)


def call_token_classes(call: SharedCall, view: MicrobatchView, stats: Statistics, stats_source: tuple
                       ) -> TokenClasses:
    """:func:`classify_tokens` of the view's selected tokens, once per call for every view that selects its
    microbatch's tokens by the same rule (or as ``instrument()`` gave them: :func:`give_token_classes`)."""
    key = token_classes_key(view.index, tuple(view.labels.shape), stats_source, view.selected_rule)
    return call.shared(key, lambda: classify_tokens(stats, view.selected, view.labels))


def give_token_classes(call: SharedCall, classes: TokenClasses, ignore_index: int) -> None:
    """Hand a one-microbatch call (``instrument()``'s) the classes made from its ``token_stats`` output over
    :func:`.token_mask` of its labels and completion mask as given, with ``ignore_index``: every view selecting
    the same tokens reads them instead of classifying again."""
    call.give(token_classes_key(0, tuple(classes.counted.shape), ("given",), ("token_mask", ignore_index)), classes)
