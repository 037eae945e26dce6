"""TrainMetric: learning rate, iterations, elapsed time and speed, as numbers."""

from __future__ import annotations

import time
from typing import Any, Optional, Sequence, Union

from .base import Metric, Number, StateValues


class TrainMetric(Metric):
    """Twinkle's ``TrainMetric`` with numeric values, identical on every rank.

    ``accumulate(inputs, outputs)`` reads ``outputs['lr']`` (a number, or one per
    parameter group), ``outputs['step']`` (optimizer micro-steps, as Twinkle counts
    them) and ``outputs['gradient_accumulation_steps']`` (default 1).

    Results (Twinkle's keys):
        ``learning rate`` or ``learning rate(param group N)`` (N from 1),
        ``iters`` = step // gradient_accumulation_steps (max over ranks),
        ``total time elapse`` = seconds since construction (max over ranks),
        ``speed`` = iterations per second since the previous ``calculate()``.

    The learning rate is read on the host (it is a Python number in every
    optimizer); timings and step join the collection's one sync as ``max``
    states, so ranks that did not accumulate still report the same values.
    """

    def __init__(self, device_mesh: Any = None, process_group: Any = None, **kwargs: Any) -> None:
        super().__init__(device_mesh, process_group, **kwargs)
        self.lr: Optional[Union[float, list[float]]] = None
        self.step: Optional[int] = None
        self.gradient_accumulation_steps = 1
        self.start_time = time.time()
        self.interval_start_time = self.start_time
        self.interval_start_step = 0
        self.add_state("iters", "max")
        self.add_state("interval_iters", "max")
        self.add_state("elapsed_seconds", "max")
        self.add_state("interval_seconds", "max")

    def accumulate(self, inputs: Any, outputs: Any, **kwargs: Any) -> None:
        outputs = outputs or {}
        lr = outputs.get("lr")
        # Kept as given and converted at calculate(): a tensor here must not cost a host sync.
        if lr is not None:
            self.lr = list(lr) if isinstance(lr, Sequence) else lr
        if outputs.get("step") is not None:
            self.step = outputs["step"]
        self.gradient_accumulation_steps = outputs.get("gradient_accumulation_steps", 1) or 1

    def _before_sync(self) -> None:
        now = time.time()
        self._assign("elapsed_seconds", now - self.start_time)
        self._assign("interval_seconds", now - self.interval_start_time)
        if self.step is not None:
            step, accumulation = int(self.step), int(self.gradient_accumulation_steps)
            self._assign("iters", step // accumulation)
            self._assign("interval_iters", (step - self.interval_start_step) / accumulation)

    def _local_states(self) -> dict:
        # Timings and step are the same kind of value on every rank: all ranks count.
        return self._states

    def compute(self, states: StateValues) -> dict[str, Number]:
        results: dict[str, Number] = {}
        if isinstance(self.lr, list) and len(self.lr) > 1:
            for index, lr in enumerate(self.lr):
                results[f"learning rate(param group {index + 1})"] = float(lr)
        elif self.lr is not None:
            results["learning rate"] = float(self.lr[0] if isinstance(self.lr, list) else self.lr)
        if states["iters"] != float("-inf"):
            results["iters"] = int(states["iters"])
            results["total time elapse"] = states["elapsed_seconds"]
            interval = states["interval_seconds"]
            results["speed"] = states["interval_iters"] / interval if interval > 0 else 0.0
        return results

    def reset(self) -> None:
        super().reset()
        self.interval_start_time = time.time()
        if self.step is not None:
            self.interval_start_step = int(self.step)

    def state_dict(self) -> dict[str, Any]:
        lr = [float(x) for x in self.lr] if isinstance(self.lr, list) else self.lr
        return {**super().state_dict(), "lr": None if lr is None else lr if isinstance(lr, list) else float(lr),
                "step": None if self.step is None else int(self.step),
                "gradient_accumulation_steps": int(self.gradient_accumulation_steps),
                "elapsed_seconds": time.time() - self.start_time, "interval_start_step": self.interval_start_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.lr = state_dict["lr"]
        self.step = state_dict["step"]
        self.gradient_accumulation_steps = state_dict["gradient_accumulation_steps"]
        # Elapsed time continues from the saved run; the speed interval starts now.
        self.start_time = time.time() - state_dict["elapsed_seconds"]
        self.interval_start_time = time.time()
        self.interval_start_step = state_dict["interval_start_step"]
