"""Many metrics, one sync: all states of all metrics reduced in at most two collectives."""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional, Union

import torch

from ..parallel import ParallelContext, all_gather_records, all_reduce_sum_and_max
from .base import Metric, Number
from .token_stats import sharing_token_stats


def calculate_metrics(metrics: Iterable[Metric]) -> dict[str, Number]:
    """Reduce the states of ``metrics`` together, compute each, merge the dicts, reset.

    Packs every ``sum`` state into one buffer and every ``max``/``min`` state
    (min negated) into another, so the number of collectives is at most two
    whatever the number of metrics. Collective: every rank must call it with
    the same metrics in the same order.
    """
    metrics = list(metrics)
    context = _shared_context(metrics)
    device = context.communication_device()
    sums: list[torch.Tensor] = []
    maxes: list[torch.Tensor] = []
    for metric in metrics:
        metric._before_sync()
        local = metric._local_states()
        for name, spec in metric._specs.items():
            flat = local[name].reshape(-1).to(device)
            if spec.reduce == "sum":
                sums.append(flat)
            else:
                maxes.append(flat if spec.reduce == "max" else -flat)
    reduced_sums, reduced_maxes = all_reduce_sum_and_max(
        context,
        torch.cat(sums) if sums else None,
        torch.cat(maxes) if maxes else None,
    )
    _gather_records(context, metrics)
    results: dict[str, Number] = {}
    error: Optional[Exception] = None
    sum_offset = max_offset = 0
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
        try:
            computed = metric.compute(values)
        except Exception as exc:  # e.g. invalid labels: raised on every rank, after every metric reset
            error = error or exc
            computed = {}
        metric.reset()
        # Two metrics may report the same count (nonfinite_tokens of Accuracy and TokenStatsMetric);
        # a key reported twice with different values would silently lose one of them.
        clashes = sorted(key for key in set(computed) & set(results) if not same_value(computed[key], results[key]))
        if clashes:
            error = error or ValueError(
                f"{type(metric).__name__} reports {clashes}, which an earlier metric of the collection reports "
                "too; one of them would silently overwrite the other")
        results.update(computed)
    if error is not None:
        raise error
    return results


def _gather_records(context: ParallelContext, metrics: list[Metric]) -> None:
    """One all-gather of object records for all metrics that report some (none when none do)."""
    local = [metric._local_records() for metric in metrics]
    if all(records is None for records in local):
        return
    local = [records if records is not None and metric.context.holds_data(metric.cp_gathered) else []
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

    ``calculate()`` issues at most two collectives in total, whatever the number
    of metrics, and returns the merged results (every rank the same dict).
    """

    def __init__(self, metrics: Union[Mapping[str, Metric], Iterable[Metric]]) -> None:
        self.metrics: list[Metric] = list(metrics.values() if isinstance(metrics, Mapping) else metrics)

    def add_metric(self, metric: Metric) -> None:
        self.metrics.append(metric)

    def accumulate(self, inputs: Any, outputs: Any, **kwargs: Any) -> None:
        """Feed every metric; metrics reading the same logits share one vocab-parallel pass."""
        with sharing_token_stats():
            for metric in self.metrics:
                metric.accumulate(inputs, outputs, **kwargs)

    def calculate(self) -> dict[str, Number]:
        return calculate_metrics(self.metrics)

    def reset(self) -> None:
        for metric in self.metrics:
            metric.reset()

    def state_dict(self) -> dict[str, Any]:
        return {"metrics": [m.state_dict() for m in self.metrics]}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        saved = state_dict["metrics"]
        if len(saved) != len(self.metrics):
            raise ValueError(f"state dict holds {len(saved)} metrics, this collection has {len(self.metrics)}")
        for metric, metric_state in zip(self.metrics, saved):
            metric.load_state_dict(metric_state)

    def __len__(self) -> int:
        return len(self.metrics)
