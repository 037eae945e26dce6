"""Exponential moving averages of logged values, and the loss-spike test against them."""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional

from .. import keys


class ExponentialMovingAverages:
    """Named per-step EMAs: ``ema ← α·value + (1 − α)·ema``, starting at the first value.

    Global values exist only at log steps (after the sync), so an interval of
    ``n`` steps is blended in at once with the weight those ``n`` steps would have
    had, each at the interval's value: ``ema ← w·value + (1 − w)·ema`` with
    ``w = 1 − (1 − α)^n``. ``α`` means the same whatever ``log_interval`` is.
    Non-finite values are skipped: one NaN would otherwise poison the average
    for good.
    """

    def __init__(self, alpha: float = 0.1) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"EMA alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self.values: dict[str, float] = {}

    def get(self, name: str) -> Optional[float]:
        return self.values.get(name)

    def update(self, name: str, value: float, steps: int = 1) -> Optional[float]:
        """Fold ``value``, the mean of ``steps`` steps, into the EMA called ``name``; returns the new EMA."""
        if math.isfinite(value):
            previous = self.values.get(name)
            weight = 1.0 - (1.0 - self.alpha) ** max(1, steps)
            self.values[name] = value if previous is None else weight * value + (1 - weight) * previous
        return self.values.get(name)

    def state_dict(self) -> dict[str, Any]:
        return {"alpha": self.alpha, "values": dict(self.values)}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.values = dict(state_dict["values"])


def is_loss_spike(loss: float, smoothed_loss: Optional[float], threshold: float) -> bool:
    """``loss > (1 + threshold) · smoothed_loss`` (with the EMA *before* this loss is blended in).

    No spike before there is an EMA, and none for a non-positive EMA (the
    relative threshold means nothing there).
    """
    if smoothed_loss is None or smoothed_loss <= 0 or not math.isfinite(loss):
        return False
    return loss > (1.0 + threshold) * smoothed_loss


class RecordSmoothing:
    """The record's smoothed part: ``train/loss_spike`` and the EMAs of :data:`~twinkle_megatron.keys.EMA_OF`.

    Owns the averages (resumable with the tracker's ``state_dict``). Each log
    record is blended in once: :meth:`compute` returns the spike flag (loss
    against the loss EMA *before* this loss) and the new EMAs, and advances the
    averages, its own state.
    """

    def __init__(self, alpha: float = 0.1, spike_threshold: float = 0.5) -> None:
        self.averages = ExponentialMovingAverages(alpha)
        self.spike_threshold = spike_threshold

    def compute(self, record: Mapping[str, Any], steps: int) -> dict[str, Any]:
        """The spike flag and EMAs of ``record``, a log interval of ``steps`` steps (blended in: see above)."""
        results: dict[str, Any] = {}
        if keys.LOSS in record:
            results[keys.LOSS_SPIKE] = int(is_loss_spike(record[keys.LOSS], self.averages.get(keys.LOSS),
                                                         self.spike_threshold))
        for name, ema_key in keys.EMA_OF.items():
            if name in record:
                smoothed = self.averages.update(name, record[name], max(steps, 1))
                if smoothed is not None:
                    results[ema_key] = smoothed
        return results
