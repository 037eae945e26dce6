"""TrainMetric: learning rate, iterations, elapsed time and speed, as numbers."""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch

from ..inputs.microbatches import call_value
from ..inputs.tensors import all_host_numbers
from ..state.base import Metric, Number, SyncedStates


class TrainMetric(Metric):
    """Twinkle's ``TrainMetric`` with numeric values, identical on every rank.

    ``accumulate(inputs, outputs, *, lr=None, step=None, gradient_accumulation_steps=None)``
    (Twinkle's models pass these as keywords; ``outputs[...]`` of the same name
    is read when the keyword is absent): ``lr`` a number or one per parameter
    group, ``step`` optimizer micro-steps as Twinkle counts them,
    ``gradient_accumulation_steps`` (default 1). ``inputs`` and ``outputs`` may
    be None (Twinkle's documented call).

    Results (Twinkle's keys):
        ``learning rate`` or ``learning rate(param group N)`` (N from 1),
        ``iters`` = step // gradient_accumulation_steps (max over ranks),
        ``total time elapse`` = seconds since construction (max over ranks),
        ``speed`` = iterations per second since the previous ``calculate()``.

    Learning rates, step and timings join the collection's one sync as ``max``
    states (up to ``max_param_groups`` learning rates), so ranks that did not
    accumulate still report the same values.

    >>> from twinkle_megatron import TrainMetric
    >>> metric = TrainMetric()
    >>> metric.accumulate(None, None, lr=[1e-4, 2e-5], step=32, gradient_accumulation_steps=4)
    >>> result = metric.calculate()
    >>> result["learning rate(param group 2)"], result["iters"], sorted(result)[-2:]
    (2e-05, 8, ['speed', 'total time elapse'])
    """

    token_statistics = ()  # reads no logits

    call_keywords = ("lr", "step", "gradient_accumulation_steps")

    def __init__(self, device_mesh: Any = None, process_group: Any = None, max_param_groups: int = 16,
                 **kwargs: Any) -> None:
        super().__init__(device_mesh, process_group, **kwargs)
        self.max_param_groups = max_param_groups
        self.step: Any = None
        self.gradient_accumulation_steps = 1
        self.start_time = time.time()
        self.interval_start_time = self.start_time
        self.interval_start_step = 0
        self.add_state("learning_rates", "max", shape=(max_param_groups,))  # -inf: no such group
        self.add_state("iters", "max")
        self.add_state("interval_iters", "max")
        self.add_state("elapsed_seconds", "max")
        self.add_state("interval_seconds", "max")

    def accumulate(self, inputs: Any, outputs: Any, **kwargs: Any) -> None:
        lr = call_value("lr", kwargs, outputs)
        if lr is not None:
            if isinstance(lr, torch.Tensor):  # one per parameter group, or a single 0-d rate
                self._assign_rates(list(lr.detach().to(torch.float64).reshape(-1).unbind()))
            else:
                self._assign_rates(list(lr) if isinstance(lr, Sequence) else [lr])
        # Step counters are kept as given and read at calculate(): a tensor must not sync here.
        step = call_value("step", kwargs, outputs)
        if step is not None:
            self.step = step
        self.gradient_accumulation_steps = call_value("gradient_accumulation_steps", kwargs, outputs,
                                                      self.gradient_accumulation_steps) or 1

    def _assign_rates(self, rates: list) -> None:
        """One learning rate per parameter group, padded with -inf: Python numbers (Twinkle's form) stay on the
        host until the sync; device tensors are stacked, not read (no host sync)."""
        if len(rates) > self.max_param_groups:
            raise ValueError(f"lr has {len(rates)} parameter groups; raise "
                             f"TrainMetric(max_param_groups=...) above {self.max_param_groups}")
        unused = self.max_param_groups - len(rates)
        if all_host_numbers(rates):
            self._assign("learning_rates", [*rates, *[float("-inf")] * unused])
            return
        rates = [torch.as_tensor(rate, dtype=torch.float64) for rate in rates]
        device = rates[0].device
        # The padding by a fill kernel: a list copied to an accelerator would make the host wait.
        self._assign("learning_rates", torch.cat([torch.stack([rate.reshape(()).to(device) for rate in rates]),
                                                  torch.full((unused,), float("-inf"), dtype=torch.float64,
                                                             device=device)]))

    every_rank_counts = True  # timings and step are the same kind of value on every rank

    def before_sync(self) -> None:
        now = time.time()
        self._assign("elapsed_seconds", now - self.start_time)
        self._assign("interval_seconds", now - self.interval_start_time)
        if self.step is not None:
            step, accumulation = int(self.step), int(self.gradient_accumulation_steps)
            self._assign("iters", step // accumulation)
            self._assign("interval_iters", (step - self.interval_start_step) / accumulation)

    def compute(self, states: SyncedStates) -> dict[str, Number]:
        results: dict[str, Number] = {}
        rates = [float(rate) for rate in states["learning_rates"] if rate != float("-inf")]
        if len(rates) == 1:
            results["learning rate"] = rates[0]
        else:
            for index, rate in enumerate(rates):
                results[f"learning rate(param group {index + 1})"] = rate
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

    def extra_state(self, states: SyncedStates) -> dict[str, Any]:
        return {"step": None if self.step is None else int(self.step),
                "gradient_accumulation_steps": int(self.gradient_accumulation_steps),
                # The time reduced in the sync (max over ranks): the same on every rank.
                "elapsed_seconds": states["elapsed_seconds"], "interval_start_step": self.interval_start_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.step = state_dict["step"]
        self.gradient_accumulation_steps = state_dict["gradient_accumulation_steps"]
        # Elapsed time continues from the saved run; the speed interval starts now.
        self.start_time = time.time() - state_dict["elapsed_seconds"]
        self.interval_start_time = time.time()
        self.interval_start_step = state_dict["interval_start_step"]
