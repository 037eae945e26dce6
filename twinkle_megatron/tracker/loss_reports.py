"""Megatron-LM's loss reports, read in one place (for ``instrument()`` and ``MetricsTracker``).

Megatron-LM's ``loss_func`` returns ``(loss_sum, num_tokens, {'lm loss': [sum, count]})``
with per-token losses (``calculate_per_token_loss``), or the older
``(loss_mean, {'lm loss': mean})``; the schedule returns one such report dict
per microbatch on the last pipeline stage. A report is therefore either a
``[sum, count]`` pair, pooled by tokens, or a mean, pooled with equal weight
(no count exists to weight it): both go to a :class:`~twinkle_megatron.LossMetric`
(``loss_reduction='sum'`` for pairs, ``'mean'`` for means), the one place
losses are pooled.
"""

from __future__ import annotations

import numbers
import warnings
from typing import Any, Mapping, Optional, Sequence, Union

import torch

from ..metric import common_device, to_device

LossValue = Union[torch.Tensor, float]  # a [sum, count] tensor, or a mean (0-d tensor or number)


def main_loss(report: Mapping[str, Any], loss_key: str = "lm loss") -> LossValue:
    """The main loss of one report dict: ``report[loss_key]`` (the only key when there is one)."""
    if loss_key in report:
        key = loss_key
    elif len(report) == 1:
        key = next(iter(report))
    else:
        raise ValueError(f"the loss dict has keys {sorted(report)}, none of them loss_key={loss_key!r}")
    if len(report) > 1:
        warnings.warn(f"only {key!r} of the loss dict keys {sorted(report)} is tracked; track others with metrics=",
                      RuntimeWarning, stacklevel=3)
    value = report[key]
    if isinstance(value, (list, tuple)):  # [sum, count] as a list
        return torch.stack([torch.as_tensor(v, dtype=torch.float64) for v in value])
    return value


def loss_values(loss: Any, loss_key: str = "lm loss") -> list[LossValue]:
    """What a training loop hands over as its step's loss, as a list of ``[sum, count]`` pairs or means.

    ``loss``: a report dict, a list of them (``forward_backward_func``'s return
    value), a ``[sum, count]`` tensor, or a mean (a tensor or a number).
    """
    items = list(loss) if isinstance(loss, (list, tuple)) else [loss]
    values = [main_loss(item, loss_key) if isinstance(item, Mapping) else item for item in items]
    for value in values:
        if not (isinstance(value, numbers.Real) or isinstance(value, torch.Tensor) and value.numel() in (1, 2)):
            raise ValueError(f"a loss must be a scalar mean or a [sum, count] pair, got {type(value).__name__} of "
                             f"shape {tuple(getattr(value, 'shape', ()))}")
    return values


def loss_func_result(result: Any, loss_key: str = "lm loss") -> tuple[Any, Any]:
    """``(loss_sum, num_tokens)`` of what a Megatron ``loss_func`` returned.

    Three values: Megatron-LM's per-token convention, the report's ``[sum, count]``
    (or the first two values). Two values (older): the report's mean, weighted
    as one token, so that means are averaged with equal weight.
    """
    if not isinstance(result, (tuple, list)) or len(result) not in (2, 3):
        raise ValueError(f"loss_func returned {type(result).__name__}; expected (loss, num_tokens, reports) "
                         "or (loss, reports)")
    reports = result[-1] if isinstance(result[-1], dict) else {}
    report = reports.get(loss_key)  # other keys of the dict are the loss_func's own business here
    if isinstance(report, (list, tuple)):
        report = torch.stack([torch.as_tensor(v, dtype=torch.float64) for v in report])
    if isinstance(report, torch.Tensor) and report.numel() == 2:
        return report[0], report[1]
    if len(result) == 3:
        return result[0].detach(), result[1]
    value = report if report is not None else result[0]
    return (value.detach() if isinstance(value, torch.Tensor) else value), 1


def accumulate_loss_values(metric: Any, values: Sequence[LossValue]) -> tuple[Any, Optional[Any]]:
    """Pool ``values`` into a LossMetric; returns (1 if any was non-finite else 0, Σ counts of the pairs or None).

    Both returned values are device tensors or numbers, never read on the host.
    """
    pairs = [v.detach().reshape(2).to(torch.float64) for v in values if isinstance(v, torch.Tensor) and v.numel() == 2]
    means = [v for v in values if not (isinstance(v, torch.Tensor) and v.numel() == 2)]
    if pairs:
        metric.accumulate([{}] * len(pairs), {"loss": [p[0] for p in pairs], "num_tokens": [p[1] for p in pairs]},
                          loss_reduction="sum")
    if means:
        metric.accumulate([{}] * len(means), {"loss": list(means)}, loss_reduction="mean")
    flags = [torch.as_tensor(p[0]) for p in pairs] + [torch.as_tensor(m, dtype=torch.float64) for m in means]
    nonfinite: Any = 0.0
    if flags:
        device = common_device(flags)
        nonfinite = (~torch.isfinite(torch.stack([to_device(f.reshape(()), device) for f in flags]))).any()
        nonfinite = nonfinite.to(torch.float64)
    count = torch.stack([p[1] for p in pairs]).sum() if pairs else None
    return nonfinite, count
