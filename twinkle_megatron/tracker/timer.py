"""Step durations without a host sync per step.

On a GPU, each step boundary records a CUDA event on the current stream;
events are only read (one ``synchronize`` on the last one) when the durations
are collected at the log interval. Reading an event earlier would block the
host until the GPU caught up, which is exactly the per-step stall we avoid.
On CPU, the wall clock.

A step runs from ``start()`` to ``stop()``. Without ``start()``, a step starts
where the previous one stopped (so data loading counts), and the first one
where the timer was created.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch


class StepTimer:
    """Per-step durations in seconds, read in bulk by :meth:`collect`."""

    def __init__(self, use_cuda_events: Optional[bool] = None) -> None:
        if use_cuda_events is None:
            use_cuda_events = torch.cuda.is_available()
        self.use_cuda_events = use_cuda_events
        self._start: Any = None
        self._last_stop: Any = self._mark()
        self._finished: list[tuple[Any, Any]] = []

    def _mark(self) -> Any:
        if not self.use_cuda_events:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        self._start = self._mark()

    def stop(self) -> None:
        begin = self._start if self._start is not None else self._last_stop
        end = self._mark()
        self._finished.append((begin, end))
        self._last_stop, self._start = end, None

    def collect(self) -> list[float]:
        """Durations of the steps stopped since the last collect, in seconds (one sync on GPU)."""
        finished, self._finished = self._finished, []
        if not finished:
            return []
        if not self.use_cuda_events:
            return [end - begin for begin, end in finished]
        finished[-1][1].synchronize()  # events complete in order: the last one done means all are
        return [begin.elapsed_time(end) / 1000.0 for begin, end in finished]

    def restart(self) -> None:
        """Forget pending steps and start the next one now (after a pause such as evaluation or a resume)."""
        self._finished, self._start, self._last_stop = [], None, self._mark()
