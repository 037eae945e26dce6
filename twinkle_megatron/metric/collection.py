"""Many metrics fed from one ``accumulate`` call and synced together (at most two collectives, see
:mod:`.state.sync`).

Each call becomes one :class:`.inputs.shared_call.SharedCall` handed to every metric that reads one
(``accumulate_call``): the views of each spec, each microbatch's token statistics and token classes are made
once for all of them.
"""

from __future__ import annotations

import inspect
from typing import Any, Iterable, Mapping, Union

import torch

from .inputs.shared_call import SharedCall
from .state.sync import Number, calculate_metrics, is_builtin, reduced_state_dicts
from .tokens.logits_pass import STATISTICS


class MetricCollection:
    """Feed many metrics from one ``accumulate`` call and sync them together.

    ``calculate()`` issues at most two collectives for all built-in metrics,
    whatever their number, and returns the merged results (every rank the same
    dict); metrics with their own ``calculate()`` (Twinkle style) follow it.

    >>> import torch
    >>> from twinkle_megatron import Accuracy, LossMetric, MetricCollection
    >>> metrics = MetricCollection([Accuracy(), LossMetric()])
    >>> logits = torch.tensor([[[2.0, 0.0], [0.0, 2.0]]])
    >>> metrics.accumulate({"labels": torch.tensor([[0, 0]])}, {"logits": logits, "loss": 1.5})
    >>> metrics.calculate()  # one sync for both (two all-reduces on several ranks)
    {'accuracy': 0.5, 'correct_tokens': 1, 'total_tokens': 2, 'loss': 1.5}
    """

    def __init__(self, metrics: Union[Mapping[str, Any], Iterable[Any]]) -> None:
        self.metrics: list[Any] = list(metrics.values() if isinstance(metrics, Mapping) else metrics)

    def accumulate(self, inputs: Any, outputs: Any, **kwargs: Any) -> None:
        """Feed every metric one :class:`.SharedCall` of this call; metrics reading the same logits share one
        vocab-parallel pass.

        Keywords a user metric's ``accumulate`` does not take (the documentation's
        ``accumulate(self, inputs, outputs)`` takes none) are not passed to it.
        """
        self.accumulate_call(SharedCall(inputs, outputs, kwargs, self._token_statistics(outputs)))

    def accumulate_call(self, call: SharedCall) -> None:
        """Feed every metric ``call``: its own ``accumulate_call`` where it reads one, else Twinkle's
        ``accumulate`` with the call's inputs, outputs and keywords (``instrument()`` makes the call itself)."""
        with torch.no_grad():
            for metric in self.metrics:
                if _reads_shared_call(metric):
                    metric.accumulate_call(call)
                else:
                    metric.accumulate(call.inputs, call.outputs, **_keywords_for(metric, call.kwargs))

    def _token_statistics(self, outputs: Any) -> frozenset:
        """What this call's metrics read of the logits (a Twinkle-style metric that declares nothing: all)."""
        return frozenset(name for metric in self.metrics for name in
                         (metric.token_statistics_for(outputs) if hasattr(metric, "token_statistics_for")
                          else STATISTICS))

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


def _reads_shared_call(metric: Any) -> bool:
    reads = getattr(type(metric), "reads_shared_call", None)
    return reads is not None and reads()


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
