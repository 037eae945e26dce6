"""Many metrics, one sync: all states of all metrics reduced in at most two collectives.

The sync (:func:`calculate_metrics`) packs every ``max`` state of every metric
(``min`` states negated) into one float64 buffer and every ``sum`` state into
another, and all-reduces each once: MAX first, then SUM. The MAX buffer starts
with a header, the *signature* of this rank's collection (its metrics' classes
and their state names, shapes and reductions, hashed) and both buffer sizes,
each with its negation, so that after the MAX every rank knows whether all
ranks sync the same states in the same order (``max(x) == -max(-x)`` exactly
when every rank holds the same ``x``). If they do not, the SUM is never issued
(its sizes may differ, and a mismatched all-reduce aborts or hangs the job):
every rank raises :class:`MetricSyncError` naming what differs instead of
reporting garbage. The MAX buffer is padded to a multiple of
``MAX_BUFFER_QUANTUM`` elements, so collections that differ only in their
``max``/``min`` states still meet in an all-reduce of the same size (a few KiB:
latency-bound, as cheap as a few bytes).

Metrics written Twinkle's way (their own ``calculate()``, e.g. with
``gather_results``) join a collection too: the built-in metrics are synced
first, then every user metric's ``calculate()`` runs, on every rank, in order.
"""

from __future__ import annotations

import hashlib
import inspect
from typing import Any, Iterable, Mapping, Optional, Union

import torch
import torch.distributed as dist

from ..parallel import ParallelContext, all_gather_records, all_reduce_sum_and_max
from .base import Metric, Number
from .token_stats import sharing_token_stats

MAX_BUFFER_QUANTUM = 1024  # float64 elements: 8 KiB
_HEADER = 8  # signature (2 halves), sum size, max size: each followed by its negation
_HALF = 1 << 26  # a 52-bit signature travels as two exactly representable float64 halves


class MetricSyncError(RuntimeError):
    """The ranks could not sync their metrics: they hold different ones, or some never called ``calculate()``."""


def is_builtin(metric: Any) -> bool:
    """A metric of the declared-states protocol (reduced in the one sync), not a user's own ``calculate()``."""
    return isinstance(metric, Metric) and type(metric).calculate is Metric.calculate


def calculate_metrics(metrics: Iterable[Any]) -> dict[str, Number]:
    """Reduce the states of ``metrics`` together, compute each, merge the dicts, reset.

    At most two collectives for all built-in metrics together (see the module
    docstring); user metrics' own ``calculate()`` follow. Collective: every rank
    must call it with the same metrics in the same order.
    """
    metrics = list(metrics)
    builtins = [m for m in metrics if is_builtin(m)]
    reduced = _reduce_states(builtins) if builtins else []
    results: dict[str, Number] = {}
    error: Optional[Exception] = None
    states_of = {id(metric): states for metric, states in zip(builtins, reduced)}
    for metric in metrics:
        try:
            computed = metric.compute(states_of[id(metric)]) if id(metric) in states_of else metric.calculate()
        except Exception as exc:  # e.g. invalid labels: raised on every rank, after every metric is reset
            error = error or exc
            computed = {}
        if id(metric) in states_of:
            metric.reset()
        # Two metrics may report the same count (nonfinite_tokens of Accuracy and TokenStatsMetric);
        # a key reported twice with different values would silently lose one of them.
        clashes = sorted(key for key in set(computed) & set(results) if not same_value(computed[key], results[key]))
        if clashes:
            error = error or ValueError(
                f"{type(metric).__name__} reports {clashes}, which an earlier metric of the collection reports "
                "too; one of them would silently overwrite the other")
        results.update(computed or {})
    if error is not None:
        raise error
    return results


def reduced_state_dicts(metrics: Iterable[Metric]) -> list[dict[str, Any]]:
    """Each metric's state reduced over all ranks: a layout-free checkpoint (collective, nothing reset).

    A metric may add host-side entries through ``_extra_state(states)``; the
    states of non-built-in metrics are their own business (``state_dict()``).
    """
    metrics = list(metrics)
    saved = []
    for metric, states in zip(metrics, _reduce_states(metrics)):
        entry = {"states": {name: torch.as_tensor(value, dtype=torch.float64).clone()
                            for name, value in states.items()}}
        extra = getattr(metric, "_extra_state", None)
        if extra is not None:
            entry.update(extra(states))
        saved.append(entry)
    return saved


# ------------------------------------------------------------------ the sync


def _reduce_states(metrics: list[Metric]) -> list[dict[str, Union[float, torch.Tensor]]]:
    """The globally reduced states of each metric (and their gathered records), in order."""
    context = _shared_context(metrics)
    device = context.communication_device()
    sums: list[torch.Tensor] = []
    maxes: list[torch.Tensor] = []
    for metric in metrics:
        metric._before_sync()
        local = metric._local_states()
        for name, spec in metric._specs.items():
            flat = local[name].reshape(-1).to(device=device, dtype=torch.float64)
            if spec.reduce == "sum":
                sums.append(flat)
            else:
                maxes.append(flat if spec.reduce == "max" else -flat)
    sum_buffer = torch.cat(sums) if sums else torch.zeros(0, dtype=torch.float64, device=device)
    max_buffer = _with_header(torch.cat(maxes) if maxes else torch.zeros(0, dtype=torch.float64, device=device),
                              signature(metrics), sum_buffer.numel())
    try:
        _, reduced_maxes = all_reduce_sum_and_max(context, None, max_buffer)
        header, reduced_maxes = reduced_maxes[:_HEADER], reduced_maxes[_HEADER:]
        if not bool((header[0::2] == -header[1::2]).all()):
            raise _describe_mismatch(context, metrics)
        reduced_sums, _ = all_reduce_sum_and_max(context, sum_buffer, None)
        _gather_records(context, metrics)
    except (RuntimeError, dist.DistBackendError) as error:
        if isinstance(error, MetricSyncError):
            raise
        raise MetricSyncError(
            f"twinkle-megatron: the metric sync failed ({type(error).__name__}: {error}). calculate() (and "
            "state_dict()) are collective: every rank of the reduction group must call them, with the same "
            "metrics in the same order; a rank that did not (an early return, a metric called on some pipeline "
            "stages only) leaves the others waiting until the process group's timeout") from error
    return _unpack(metrics, reduced_sums, reduced_maxes)


def signature(metrics: list[Metric]) -> int:
    """A 52-bit hash of the metrics' classes and state layouts, in order (equal on ranks that agree)."""
    text = repr([(type(m).__module__, type(m).__qualname__,
                  [(name, spec.reduce, spec.shape) for name, spec in m._specs.items()]) for m in metrics])
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 12


def _with_header(maxes: torch.Tensor, collection_signature: int, sum_size: int) -> torch.Tensor:
    fields = [collection_signature // _HALF, collection_signature % _HALF, sum_size, maxes.numel()]
    header = torch.tensor([v for field in fields for v in (float(field), -float(field))], dtype=torch.float64,
                          device=maxes.device)
    padded = -(-(_HEADER + maxes.numel()) // MAX_BUFFER_QUANTUM) * MAX_BUFFER_QUANTUM
    padding = torch.full((padded - _HEADER - maxes.numel(),), float("-inf"), dtype=torch.float64, device=maxes.device)
    return torch.cat([header, maxes, padding])


def _unpack(metrics: list[Metric], reduced_sums: torch.Tensor,
            reduced_maxes: torch.Tensor) -> list[dict[str, Union[float, torch.Tensor]]]:
    sum_offset = max_offset = 0
    per_metric = []
    for metric in metrics:
        values: dict[str, Union[float, torch.Tensor]] = {}
        for name, spec in metric._specs.items():
            size = _numel(spec.shape)
            if spec.reduce == "sum":
                flat, sum_offset = reduced_sums[sum_offset:sum_offset + size], sum_offset + size
            else:
                flat, max_offset = reduced_maxes[max_offset:max_offset + size], max_offset + size
                flat = flat if spec.reduce == "max" else -flat
            values[name] = float(flat[0]) if spec.shape == () else flat.reshape(spec.shape)
        per_metric.append(values)
    return per_metric


def _describe_mismatch(context: ParallelContext, metrics: list[Metric]) -> MetricSyncError:
    """The error every rank raises when the ranks' collections differ (one object gather, on this path only)."""
    mine = [f"{type(m).__name__}({', '.join(m._specs)})" for m in metrics]
    per_rank = all_gather_records(context, [mine])
    layouts: dict[tuple, list[int]] = {}
    for rank, (layout,) in enumerate(per_rank):
        layouts.setdefault(tuple(layout), []).append(rank)
    described = "; ".join(f"ranks {ranks}: [{', '.join(layout) or 'no metrics'}]" for layout, ranks in layouts.items())
    return MetricSyncError(f"twinkle-megatron: the ranks sync different metrics ({described}). Every rank must "
                           "build the same metrics in the same order and pass all of them to calculate(), even "
                           "ranks that see no data (they contribute nothing)")


def _gather_records(context: ParallelContext, metrics: list[Metric]) -> None:
    """One all-gather of object records for all metrics that report some (none when none do)."""
    local = [metric._local_records() for metric in metrics]
    if all(records is None for records in local):
        return
    local = [records if records is not None and metric._counts_here() else []
             for metric, records in zip(metrics, local)]
    per_rank = all_gather_records(context, local)
    for index, metric in enumerate(metrics):
        metric.gathered_records = [record for rank_records in per_rank for record in rank_records[index]]


def _shared_context(metrics: list[Metric]) -> ParallelContext:
    contexts = [m.context for m in metrics]
    if not contexts:
        return ParallelContext.single()
    first = contexts[0]
    for metric, context in zip(metrics, contexts):
        if context.reduce_group is not first.reduce_group or context.distributed != first.distributed:
            raise ValueError(f"{type(metric).__name__} reduces over a different process group than "
                             f"{type(metrics[0]).__name__}; metrics synced together must share one layout")
    return first


def same_value(a: Any, b: Any) -> bool:
    """Equal, or both NaN: the same value reported twice is no clash."""
    return a == b or (isinstance(a, float) and isinstance(b, float) and a != a and b != b)


def _numel(shape: tuple[int, ...]) -> int:
    size = 1
    for dim in shape:
        size *= dim
    return size


class MetricCollection:
    """Feed many metrics from one ``accumulate`` call and sync them together.

    ``calculate()`` issues at most two collectives for all built-in metrics,
    whatever their number, and returns the merged results (every rank the same
    dict); metrics with their own ``calculate()`` (Twinkle style) follow it.
    """

    def __init__(self, metrics: Union[Mapping[str, Any], Iterable[Any]]) -> None:
        self.metrics: list[Any] = list(metrics.values() if isinstance(metrics, Mapping) else metrics)

    def add_metric(self, metric: Any) -> None:
        self.metrics.append(metric)

    def accumulate(self, inputs: Any, outputs: Any, **kwargs: Any) -> None:
        """Feed every metric; metrics reading the same logits share one vocab-parallel pass.

        Keywords a user metric's ``accumulate`` does not take (the documentation's
        ``accumulate(self, inputs, outputs)`` takes none) are not passed to it.
        """
        with sharing_token_stats():
            for metric in self.metrics:
                metric.accumulate(inputs, outputs, **_keywords_for(metric, kwargs))

    def calculate(self) -> dict[str, Number]:
        return calculate_metrics(self.metrics)

    def reset(self) -> None:
        for metric in self.metrics:
            metric.reset()

    def state_dict(self) -> dict[str, Any]:
        """Layout-free states of all metrics in one sync (collective: every rank calls it)."""
        builtins = [m for m in self.metrics if is_builtin(m)]
        reduced = iter(reduced_state_dicts(builtins)) if builtins else iter(())
        return {"metrics": [next(reduced) if is_builtin(m) else _own_state(m) for m in self.metrics]}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        saved = state_dict["metrics"]
        if len(saved) != len(self.metrics):
            raise ValueError(f"state dict holds {len(saved)} metrics, this collection has {len(self.metrics)}")
        for metric, metric_state in zip(self.metrics, saved):
            if hasattr(metric, "load_state_dict"):
                metric.load_state_dict(metric_state)

    def __len__(self) -> int:
        return len(self.metrics)


def _keywords_for(metric: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    if not kwargs or is_builtin(metric):
        return kwargs
    parameters = inspect.signature(metric.accumulate).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return kwargs
    accepted = {p.name for p in parameters if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
    return {key: value for key, value in kwargs.items() if key in accepted}


def _own_state(metric: Any) -> Any:
    return metric.state_dict() if hasattr(metric, "state_dict") else {}
