"""The sync: every declared state of many metrics reduced over all ranks in at most two collectives.

**The protocol** a metric follows to join (:class:`~.base.Metric` implements it;
every name is public, nothing here reaches into a metric's internals):

* ``state_specs``: its declared states, name -> :class:`~.base.StateSpec`
  (shape, and ``sum``, ``max`` or ``min`` over ranks);
* ``before_sync()``: host values (timers) written into states just before;
* ``sync_states()``: this rank's contribution: its states, or the identity of
  each reduction where its data does not count (earlier pipeline stages, TP
  ranks other than 0), so the collectives line up and nothing counts twice;
* ``sync_records()``: picklable records to gather from every rank (or None:
  numbers only, the usual case); the records of ranks whose data counts come
  back in :attr:`SyncedStates.records`;
* optional, ``data_sized_sum = True`` (class flag) and ``sync_data_sized_sum()``: one SUM state
  whose shape ``[rows, cols]`` only the ranks with data know (EmbeddingMetric's
  per-call sums of unit vectors: calls × embedding size); it rides in the same
  two all-reduces (see below) and comes back as :attr:`SyncedStates.data_sized_sum`;
* ``counts_here()``: whether this rank's records count;
* ``results(states)``: the metric's results from its synced states
  (:class:`~.base.Metric` runs its ``compute`` on the global states and on each
  group's, see :mod:`.groups`).

:func:`sync` *returns* each metric's :class:`SyncedStates`;
:func:`calculate_metrics` turns them into results (each metric's ``results``
of its own states only); :func:`calculate_each` keeps them per metric.

**The collectives.** Every ``max`` state (``min`` negated) travels in one
float64 buffer, every ``sum`` state in another; MAX first, then SUM. The MAX
buffer starts with a header: the *signature* of this rank's metrics (their
classes and state names, shapes, reductions, hashed) and both buffer sizes,
each with its negation, so after the MAX every rank knows whether all ranks
sync the same states in the same order (``max(x) == -max(-x)`` exactly when
every rank holds the same ``x``). If they do not, the SUM is never issued (its
sizes may differ, and a mismatched all-reduce aborts or hangs the job): every
rank raises :class:`MetricSyncError` naming what each holds. The MAX buffer is
padded to a multiple of ``MAX_BUFFER_QUANTUM`` elements, so collections that
differ only in their ``max``/``min`` states still meet in all-reduces of one
size (8 KiB: latency-bound, as cheap as a few bytes) — when their sizes round
up to the same multiple; ranks whose MAX buffers differ by a quantum or more
cannot be told apart without one more collective on every step, and meet a
mismatched all-reduce (gloo raises, NCCL may hang). Records, when any metric
has them, cost one more collective (an object all-gather).

**Data-sized sums** cost no collective of their own: after the header, the MAX
buffer carries each such metric's ``(rows, cols, −rows, −cols)`` from the ranks
whose data counts (``−inf`` from the others), so after the MAX every rank knows
the agreed shape, or that the ranks with data disagree (then every rank raises
:class:`MetricSyncError` before the SUM); the SUM buffer then carries
``rows × cols`` values from every rank (zeros from ranks without data). Bytes
per rank are the state's size, whatever the number of ranks.

**Metrics written Twinkle's way** (their own ``calculate()``, e.g. with
``gather_results``) are not synced here: :func:`calculate_metrics` calls their
``calculate()`` after the sync, on every rank, in order.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import torch
import torch.distributed as dist

from ...parallel import ParallelContext, all_gather_records, all_reduce_sum_and_max

Number = Union[int, float]
MAX_BUFFER_QUANTUM = 1024  # float64 elements: 8 KiB
_HEADER = 8  # signature (2 halves), sum size, max size: each followed by its negation
_HALF = 1 << 26  # a 52-bit signature travels as two exactly representable float64 halves


class MetricSyncError(RuntimeError):
    """The ranks could not sync their metrics: they hold different ones, or some never called ``calculate()``."""


class SyncedStates(dict):
    """A metric's globally reduced states (scalars as floats, others as CPU tensors) and gathered ``records``."""

    def __init__(self, states: dict, records: Optional[list] = None,
                 data_sized_sum: Optional[torch.Tensor] = None) -> None:
        super().__init__(states)
        self.records: list = list(records or [])
        self.data_sized_sum = data_sized_sum  # [rows, cols] summed over the ranks with data; None: no rank had any

    def counts(self, names: Sequence[str], prefix: str = "") -> dict[str, int]:
        """The count states ``names`` that are above 0, as ints under ``prefix + name``: the report of values left
        out of the statistics (non-finite ones, misaligned arrays), present only when something was left out."""
        return {prefix + name: int(self[name]) for name in names if self[name] > 0}


def syncs_declared_states(calculate: Callable) -> Callable:
    """Mark a ``calculate`` as the protocol's own: metrics that keep it are synced by :func:`sync`."""
    calculate.syncs_declared_states = True
    return calculate


def is_builtin(metric: Any) -> bool:
    """A metric of the declared-states protocol (reduced in the one sync), not one with its own ``calculate()``."""
    return getattr(getattr(type(metric), "calculate", None), "syncs_declared_states", False)


# ------------------------------------------------------------------ results


def calculate_metrics(metrics: Iterable[Any]) -> dict[str, Number]:
    """Sync the metrics, compute each, reset the synced ones, merge the dicts (Twinkle's ``calculate``).

    Collective: every rank calls it with the same metrics in the same order and
    gets the same dict.
    """
    return merge_results((type(metric).__name__, results) for metric, results in calculate_each(metrics))


def calculate_each(metrics: Iterable[Any]) -> list[tuple[Any, dict[str, Number]]]:
    """Each metric with its own results, in order, after the one sync (each synced metric is then reset).

    Collective, like :func:`calculate_metrics`; for a caller that keeps the
    results of some metrics apart (the tracker's own parts of its record).
    """
    metrics = list(metrics)
    builtins = [m for m in metrics if is_builtin(m)]
    synced = iter(sync(builtins) if builtins else ())  # in the order of the built-ins among the metrics
    pieces: list[tuple[Any, dict]] = []
    error: Optional[Exception] = None
    for metric in metrics:
        states = next(synced) if is_builtin(metric) else None
        try:
            pieces.append((metric, metric.results(states) if states is not None else metric.calculate()))
        except Exception as exc:  # e.g. invalid labels: raised on every rank, after every metric is reset
            error = error or exc
        if states is not None:
            metric.reset()
    if error is not None:
        raise error
    return pieces


def merge_results(pieces: Iterable[tuple[str, dict]]) -> dict[str, Number]:
    """One dict from the results of several reporters (name, results), in order.

    Two reporters may report the same count (``nonfinite_tokens`` of Accuracy
    and TokenStatsMetric); a key reported twice with *different* values would
    silently lose one of them, so that is a ``ValueError`` naming both.
    """
    merged: dict[str, Number] = {}
    owner: dict[str, str] = {}
    for name, results in pieces:
        for key, value in (results or {}).items():
            if key in merged and not same_value(merged[key], value):
                raise ValueError(f"{name} reports {key!r}, which {owner[key]} reports too, with another value; "
                                 "one of them would silently overwrite the other")
            merged[key] = value
            owner.setdefault(key, name)
    return merged


def same_value(a: Any, b: Any) -> bool:
    """Equal, or both NaN: the same value reported twice is no clash."""
    return a == b or (isinstance(a, float) and isinstance(b, float) and a != a and b != b)


def reduced_state_dicts(metrics: Sequence[Any]) -> list[dict[str, Any]]:
    """Each metric's state reduced over all ranks: a layout-free checkpoint (collective; nothing is reset).

    A metric adds its host-side entries with ``extra_state(states)``.
    """
    saved = []
    for metric, states in zip(metrics, sync(list(metrics))):
        entry: dict[str, Any] = {"states": {name: torch.as_tensor(value, dtype=torch.float64).clone()
                                            for name, value in states.items()}}
        entry.update(metric.extra_state(states))
        saved.append(entry)
    return saved


# ------------------------------------------------------------------ the collectives


def gather_results(metric: Any, local_results: list) -> list:
    """``metric``'s Twinkle helper ``gather_results``: the concatenation, on every rank, of the lists of every
    rank whose data counts (``metric.counts_here()``), in rank order; one ``all_gather_object`` over the
    reduction group (collective)."""
    context = metric.context
    mine = list(local_results) if metric.counts_here() else []
    if not context.distributed or context.reduce_size == 1:
        return mine
    gathered: list = [None] * context.reduce_size
    dist.all_gather_object(gathered, mine, group=context.reduce_group)
    return [item for rank_results in gathered for item in rank_results]


def sync(metrics: Sequence[Any]) -> list[SyncedStates]:
    """The globally reduced states of each metric, with its gathered records, in order (see the module docstring)."""
    metrics = list(metrics)
    context = shared_context(metrics)
    device = context.communication_device()
    sums: list[torch.Tensor] = []
    maxes: list[torch.Tensor] = []
    for metric in metrics:
        metric.before_sync()
        local = metric.sync_states()
        for name, spec in metric.state_specs.items():
            flat = local[name].reshape(-1).to(device=device, dtype=torch.float64)
            if spec.reduce == "sum":
                sums.append(flat)
            else:
                maxes.append(flat if spec.reduce == "max" else -flat)
    sized_at = [index for index, m in enumerate(metrics) if getattr(m, "data_sized_sum", False)]
    sized = [(m, m.sync_data_sized_sum() if m.counts_here() else None) for m in (metrics[i] for i in sized_at)]
    maxes = [_shape_slots(local, device) for _, local in sized] + maxes
    sum_buffer = torch.cat(sums) if sums else torch.zeros(0, dtype=torch.float64, device=device)
    max_buffer = _with_header(torch.cat(maxes) if maxes else torch.zeros(0, dtype=torch.float64, device=device),
                              signature(metrics), sum_buffer.numel())
    try:
        _, reduced_maxes = all_reduce_sum_and_max(context, None, max_buffer)
        header, reduced_maxes = reduced_maxes[:_HEADER], reduced_maxes[_HEADER:]
        if not bool((header[0::2] == -header[1::2]).all()):
            raise _mismatch(context, metrics)
        shapes = _agreed_shapes(sized, reduced_maxes[:4 * len(sized)].tolist())
        reduced_maxes = reduced_maxes[4 * len(sized):]
        tails = [local.reshape(-1).to(device=device, dtype=torch.float64) if local is not None else
                 torch.zeros(rows * cols, dtype=torch.float64, device=device)
                 for (_, local), (rows, cols) in zip(sized, shapes)]
        reduced_sums, _ = all_reduce_sum_and_max(context, torch.cat([sum_buffer, *tails]), None)
        records = _gather_records(context, metrics)
    except MetricSyncError:
        raise
    except RuntimeError as error:  # gloo's timeout or a broken connection: say what it means here
        raise MetricSyncError(
            f"twinkle-megatron: the metric sync failed ({type(error).__name__}: {error}). calculate() (and "
            "state_dict()) are collective: every rank of the reduction group must call them, with the same "
            "metrics in the same order; a rank that did not (an early return, a metric called on some pipeline "
            "stages only) leaves the others waiting until the process group's timeout") from error
    synced = _unpack(metrics, reduced_sums, reduced_maxes, records)
    offset = sum_buffer.numel()
    for index, (rows, cols) in zip(sized_at, shapes):
        if rows * cols:
            synced[index].data_sized_sum = reduced_sums[offset:offset + rows * cols].reshape(rows, cols)
        offset += rows * cols
    return synced


def _shape_slots(local: Optional[torch.Tensor], device: torch.device) -> torch.Tensor:
    """``(rows, cols, −rows, −cols)`` of this rank's data-sized sum; ``−inf`` (no say) without one."""
    if local is None:
        return torch.full((4,), float("-inf"), dtype=torch.float64, device=device)
    if local.dim() != 2:
        raise ValueError(f"sync_data_sized_sum() must return a [rows, cols] tensor, got shape {tuple(local.shape)}")
    rows, cols = local.shape
    return torch.tensor([rows, cols, -rows, -cols], dtype=torch.float64, device=device)


def _agreed_shapes(sized: Sequence[tuple[Any, Optional[torch.Tensor]]], slots: list[float]) -> list[tuple[int, int]]:
    """The shape every rank with data reported (``(0, 0)`` when none had data); ``MetricSyncError`` when they differ."""
    shapes = []
    for index, (metric, _) in enumerate(sized):
        high_rows, high_cols, low_rows, low_cols = slots[4 * index:4 * index + 4]
        if high_rows == float("-inf"):
            shapes.append((0, 0))
            continue
        if (high_rows, high_cols) != (-low_rows, -low_cols):
            raise MetricSyncError(
                f"twinkle-megatron: {type(metric).__name__}'s data-sized state differs between the ranks with data "
                f"(rows {-low_rows:.0f}..{high_rows:.0f}, columns {-low_cols:.0f}..{high_cols:.0f}): every rank "
                "must call accumulate() as many times, with data of the same width")
        shapes.append((int(high_rows), int(high_cols)))
    return shapes


def signature(metrics: Sequence[Any]) -> int:
    """A 52-bit hash of the metrics' classes and state layouts, in order (equal on ranks that agree)."""
    text = repr([(type(m).__module__, type(m).__qualname__,
                  [(name, spec.reduce, spec.shape) for name, spec in m.state_specs.items()]) for m in metrics])
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 12


def shared_context(metrics: Sequence[Any]) -> ParallelContext:
    """The parallel context all ``metrics`` reduce over; ``ValueError`` when they do not share one."""
    contexts = [m.context for m in metrics]
    if not contexts:
        return ParallelContext.single()
    first = contexts[0]
    for metric, context in zip(metrics, contexts):
        if context.reduce_group is not first.reduce_group or context.distributed != first.distributed:
            raise ValueError(f"{type(metric).__name__} reduces over a different process group than "
                             f"{type(metrics[0]).__name__}; metrics synced together must share one layout")
    return first


def _with_header(maxes: torch.Tensor, collection_signature: int, sum_size: int) -> torch.Tensor:
    fields = [collection_signature // _HALF, collection_signature % _HALF, sum_size, maxes.numel()]
    header = torch.tensor([v for field in fields for v in (float(field), -float(field))], dtype=torch.float64,
                          device=maxes.device)
    padded = -(-(_HEADER + maxes.numel()) // MAX_BUFFER_QUANTUM) * MAX_BUFFER_QUANTUM
    padding = torch.full((padded - _HEADER - maxes.numel(),), float("-inf"), dtype=torch.float64, device=maxes.device)
    return torch.cat([header, maxes, padding])


def _unpack(metrics: Sequence[Any], reduced_sums: torch.Tensor, reduced_maxes: torch.Tensor,
            records: list[list]) -> list[SyncedStates]:
    sum_offset = max_offset = 0
    per_metric = []
    for metric, metric_records in zip(metrics, records):
        values: dict[str, Union[float, torch.Tensor]] = {}
        for name, spec in metric.state_specs.items():
            size = 1
            for dim in spec.shape:
                size *= dim
            if spec.reduce == "sum":
                flat, sum_offset = reduced_sums[sum_offset:sum_offset + size], sum_offset + size
            else:
                flat, max_offset = reduced_maxes[max_offset:max_offset + size], max_offset + size
                flat = flat if spec.reduce == "max" else -flat
            values[name] = float(flat[0]) if spec.shape == () else flat.reshape(spec.shape)
        per_metric.append(SyncedStates(values, metric_records))
    return per_metric


def _mismatch(context: ParallelContext, metrics: Sequence[Any]) -> MetricSyncError:
    """The error every rank raises when the ranks' metrics differ (one object gather, on this path only)."""
    mine = [f"{type(m).__name__}({', '.join(m.state_specs)})" for m in metrics]
    per_rank = all_gather_records(context, [mine])
    layouts: dict[tuple, list[int]] = {}
    for rank, (layout,) in enumerate(per_rank):
        layouts.setdefault(tuple(layout), []).append(rank)
    described = "; ".join(f"ranks {ranks}: [{', '.join(layout) or 'no metrics'}]" for layout, ranks in layouts.items())
    return MetricSyncError(f"twinkle-megatron: the ranks sync different metrics ({described}). Every rank must "
                           "build the same metrics in the same order and pass all of them to calculate(), even "
                           "ranks that see no data (they contribute nothing)")


def _gather_records(context: ParallelContext, metrics: Sequence[Any]) -> list[list]:
    """One all-gather of object records for all metrics that report some (none when none do)."""
    local = [metric.sync_records() for metric in metrics]
    if all(records is None for records in local):
        return [[] for _ in metrics]
    local = [records if records is not None and metric.counts_here() else [] for metric, records in zip(metrics, local)]
    per_rank = all_gather_records(context, local)
    return [[record for rank_records in per_rank for record in rank_records[index]] for index in range(len(metrics))]
