"""Step durations without a host sync per step.

On a GPU, each step boundary records a CUDA event on the current stream;
events are only read (one ``synchronize`` on the last one) when the durations
are collected at the log interval. Reading an event earlier would block the
host until the GPU caught up, which is exactly the per-step stall we avoid.
On CPU, the wall clock.

A step runs from ``start()`` to ``stop()``. Without ``start()``, a step starts
where the previous one stopped (so data loading counts). The very first one
then starts when the timer was created; that moment has only a wall-clock
time (recording an event at construction could create a CUDA context on the
wrong device, before ``torch.cuda.set_device``), so that one step is timed by
the host clock.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

import torch


@dataclass(frozen=True)
class _Mark:
    host_seconds: float
    event: Any = None  # a recorded torch.cuda.Event, or None


class StepTimer:
    """Per-step durations in seconds, read in bulk by :meth:`collect`."""

    def __init__(self, use_cuda_events: Optional[bool] = None) -> None:
        if use_cuda_events is None:
            use_cuda_events = torch.cuda.is_available()
        self.use_cuda_events = use_cuda_events
        self._start: Optional[_Mark] = None
        self._last_stop = _Mark(time.perf_counter())
        self._finished: list[tuple[_Mark, _Mark]] = []

    def _mark(self) -> _Mark:
        event = None
        if self.use_cuda_events:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        return _Mark(time.perf_counter(), event)

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
        if finished and finished[-1][1].event is not None:
            finished[-1][1].event.synchronize()  # events complete in order: the last one done means all are
        return [_seconds(begin, end) for begin, end in finished]

    def restart_clock(self) -> None:
        """The next step starts now: time since the last step (an evaluation, a resume) is not counted."""
        self._start, self._last_stop = None, self._mark()


def _seconds(begin: _Mark, end: _Mark) -> float:
    if begin.event is not None and end.event is not None:
        return begin.event.elapsed_time(end.event) / 1000.0  # milliseconds on the GPU's timeline
    return end.host_seconds - begin.host_seconds
