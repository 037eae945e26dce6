"""Mistakes Megatron's own loop would hide, told once on the rank that logs.

In Megatron-LM's and Megatron-Bridge's ``pretrain()`` the statistics ride in the loss
reports (:mod:`.token_reports`) and nobody calls ``calculate()``, where the metrics
raise on bad data. Three mistakes would then only give wrong or empty numbers:

* **labels outside** ``vocab_size`` (``instrument(vocab_size=20)`` for a vocabulary of
  32): those tokens are left out of ``accuracy``, ``logprob`` and ``entropy``;
* **group names without group ids** (``group_names=`` but the batches carry no
  ``dataset_id``, or ids outside the names): every per-dataset key is ``[0, 0]``;
* **metrics the reports cannot carry** (metrics passed in other than the defaults, or
  with ``position_buckets=`` of their own; the defaults' position buckets go through
  Megatron's step end, :mod:`.step_health`): their keys exist only in ``calculate()``.

Each is a ``RuntimeWarning``, at most once per run, on the rank Megatron logs on (the
last global rank), not an error: the training itself is right, a run is not
stopped for its metrics, and a user who does call ``calculate()`` still gets what
it computes. The options are known without data: they are told at the first
wrapped ``forward_step`` call (``instrument()`` and ``wrap()`` run before
``pretrain()`` starts ``torch.distributed``, so the rank that logs is known only
then). The data mistakes are device counts (tokens of the loss mask), added per
microbatch without a host sync and read on the host only at the start of a step:
when the schedule hands ``forward_step`` a model chunk's first microbatch (its
``current_microbatch``, which megatron-core's schedules set on the decoder layers),
just after Megatron's optimizer step has waited for the device (it reads the
gradient norm). There the counts are copied to the host without waiting
(``non_blocking`` into pinned memory on a GPU, marked by an event) and read at a
later step start once the copy is done; on the CPU the copy is done at once. So
the warning comes at the start of the step after the one that showed the mistake
(on a GPU one step later at most), and the counts are this rank's own microbatches.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from ..metric import Accuracy, LossMetric, Metric, TokenStatsMetric
from .token_reports import INVALID_LABELS, UNGROUPED_TOKENS


def logs_here() -> bool:
    """Whether this process writes Megatron's log: the last global rank (or the only process)."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == dist.get_world_size() - 1


class StepStarts:
    """Which ``forward_step`` calls start a step: those the schedule numbers microbatch 0 of their model chunk.

    megatron-core's schedules set ``current_microbatch`` on the chunk's decoder layers before calling
    ``forward_step``; a chunk without them (or a step called without a model) falls back to the calls
    numbered 1, 2, 4, 8, ... (a read every doubling of the calls).
    """

    def __init__(self) -> None:
        # Each chunk (held: a module hashes by identity, and holding it keeps that identity its own) and its
        # first decoder layer.
        self._layers: dict[torch.nn.Module, Optional[torch.nn.Module]] = {}
        self._calls = 0

    def __call__(self, model: Any) -> bool:
        self._calls += 1
        chunk = model[0] if isinstance(model, (list, tuple)) and model else model
        microbatch = None
        if isinstance(chunk, torch.nn.Module):
            if chunk not in self._layers:
                self._layers[chunk] = _first_decoder_layer(chunk)
            microbatch = getattr(self._layers[chunk], "current_microbatch", None)
        if microbatch is None:
            return self._calls & (self._calls - 1) == 0
        return microbatch == 0


def _first_decoder_layer(chunk: torch.nn.Module) -> Optional[torch.nn.Module]:
    for module in chunk.modules():
        layers = getattr(getattr(module, "decoder", None), "layers", None)
        if isinstance(layers, torch.nn.ModuleList) and len(layers):
            return layers[0]
    return None


class MistakeCounts:
    """Device counts of data mistakes, one per kind, read on the host at step starts without waiting.

    ``messages``: kind -> a function of the count giving the warning's text. :meth:`add` (per microbatch) adds
    device counts; :meth:`at_step_start` copies them to the host and reads the copy once it is done, warns
    once per kind whose count is > 0.
    """

    def __init__(self, messages: Mapping[str, Callable[[int], str]]) -> None:
        self.messages = dict(messages)
        self._counts: Optional[torch.Tensor] = None  # float64 [kinds], on the statistics' device
        self._copy: Optional[tuple[torch.Tensor, Any]] = None  # (host tensor, event or None: done)
        self.warned: set[str] = set()

    def add(self, counts: Mapping[str, torch.Tensor]) -> None:
        """One microbatch's counts (device tensors, any kinds of :attr:`messages`; the others are 0)."""
        if len(self.warned) == len(self.messages) or not counts:
            return
        device = next(iter(counts.values())).device
        zero = torch.zeros((), dtype=torch.float64, device=device)
        stacked = torch.stack([counts[kind].to(device=device, dtype=torch.float64).reshape(()) if kind in counts
                               else zero for kind in self.messages])
        self._counts = stacked if self._counts is None else self._counts.add_(stacked.to(self._counts.device))

    def at_step_start(self) -> None:
        """Copy the counts to the host (unless a copy is under way), and read the copy once it is done: warn."""
        if self._copy is None and self._counts is not None and len(self.warned) < len(self.messages):
            self._copy = _host_copy(self._counts)
        if self._copy is None:
            return
        host, event = self._copy
        if event is not None and not event.query():
            return  # not done yet: read at a later step start
        self._copy = None
        for kind, count in zip(self.messages, host.tolist()):
            if count > 0 and kind not in self.warned:
                self.warned.add(kind)
                # Attributed to the wrapped forward_step (ours), not to Megatron's schedule that calls it: a filter
                # of megatron.core's own warnings (examples/train_gpt.py has one) leaves these alone.
                warnings.warn(self.messages[kind](int(count)), RuntimeWarning, stacklevel=3)


def _host_copy(counts: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """``counts`` copied to the host without waiting for the device: (the copy, an event that says when)."""
    if counts.device.type != "cuda":
        return counts.detach().clone(), None
    host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
    host.copy_(counts, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event


class LoopChecks:
    """The checks of one ``instrument()`` whose statistics ride in Megatron's loss reports (see the module
    docstring): the options the reports cannot carry, told at the first wrapped call; the data mistakes, counted
    per microbatch and told at step starts; both only on the rank that logs."""

    def __init__(self, vocab_size: Optional[int], group_names: Sequence[str], group_key: str,
                 metrics: Sequence[Metric], model: Any = None) -> None:
        self.counts = MistakeCounts(mistake_messages(vocab_size, group_names, group_key))
        # With a model given the user owns the loop and calls calculate(): every option is served there.
        self.unserved = [] if model is not None else unserved_options(metrics)
        self.step_starts = StepStarts()
        self.logs_here: Optional[bool] = None  # known at the first wrapped call (torch.distributed started)

    def at_call(self, model: Any) -> None:
        """At each wrapped ``forward_step`` call (``model``: the chunk it was given, or None)."""
        if self.logs_here is None:
            self.logs_here = logs_here()
            if self.logs_here and self.unserved:
                warnings.warn(f"twinkle-megatron: Megatron's loss reports cannot carry {' and '.join(self.unserved)}: "
                              f"they exist only in metrics.calculate(), which Megatron's own loop (pretrain(), "
                              f"instrument() without a model) never calls. Call it on every rank yourself, or "
                              f"leave them out.", RuntimeWarning, stacklevel=2)  # the wrapped step's line
        if self.logs_here and self.step_starts(model):
            self.counts.at_step_start()

    def add(self, mistakes: Mapping[str, torch.Tensor]) -> None:
        """One microbatch's mistake counts (device tensors), kept on the rank that logs only."""
        if self.logs_here:
            self.counts.add(mistakes)


def mistake_messages(vocab_size: Optional[int], group_names: Sequence[str], group_key: str
                     ) -> dict[str, Callable[[int], str]]:
    """The warning of each data mistake the reports count, as a function of its count."""
    vocabulary = f"vocab_size={vocab_size}" if vocab_size is not None else "no vocab_size: the logits' width"
    messages = {INVALID_LABELS: lambda count: (
        f"twinkle-megatron: {count} label token(s) of the loss mask on this rank lie outside the vocabulary "
        f"({vocabulary}); they are left out of accuracy, logprob and entropy in Megatron's log. Pass "
        f"instrument(vocab_size=...) the tokenizer's true vocabulary size.")}
    if group_names:
        messages[UNGROUPED_TOKENS] = lambda count: (
            f"twinkle-megatron: {count} token(s) of the loss mask on this rank had no group id among "
            f"group_names={tuple(group_names)!r}: their batches carry no {group_key!r} (or ids outside "
            f"0..{len(group_names) - 1}) and forward_step did not call record_group_ids(); they are in no "
            f"per-dataset key (accuracy/<name>, lm loss/<name>, ...), which read [0, 0] without them.")
    return messages


def unserved_options(metrics: Sequence[Metric]) -> list[str]:
    """What the metrics passed to ``instrument()`` ask for that Megatron's loss reports cannot carry (they hold the
    default metrics' token keys, per group), known without data: their position buckets, metrics other than the
    defaults (:class:`Accuracy`, :class:`TokenStatsMetric`, :class:`LossMetric`)."""
    unserved = []
    if any(getattr(m, "position_buckets", None) is not None for m in metrics):
        unserved.append("position_buckets= (the per-position keys)")
    reported = (Accuracy, TokenStatsMetric, LossMetric)
    others = sorted({type(m).__name__ for m in metrics if not isinstance(m, reported)})
    if others:
        unserved.append(f"metrics={others} (their keys)")
    return unserved
