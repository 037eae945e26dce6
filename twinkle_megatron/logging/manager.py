"""Fan records out to the backends, from one rank, surviving any backend's failure."""

from __future__ import annotations

import warnings
from typing import Any, Iterable, Mapping, Optional

import torch.distributed as dist

from .base import Backend, numeric_record


class MetricsLogger:
    """Writes each record to every backend, on the writing rank only.

    Args:
        backends: the backends (see :func:`~twinkle_megatron.logging.build_backend`).
        writer_rank: the global rank that writes (default 0). Every rank gets the
            same results from ``calculate()``, so any rank can; Megatron-LM logs
            from the last rank, which works as well.

    A backend whose ``open`` (an import, a file, a login) or ``write`` raises
    is disabled with one ``RuntimeWarning`` and the others carry on: training
    never stops for logging.
    """

    def __init__(self, backends: Iterable[Backend] = (), writer_rank: int = 0) -> None:
        self.backends: list[Backend] = list(backends)
        self.writer_rank = writer_rank
        self.resume_step: Optional[int] = None
        self._opened: list[Backend] = []
        self._disabled: set[int] = set()  # ids: backends need not be hashable

    @property
    def is_writer(self) -> bool:
        # Read at each write: torch.distributed may be initialised after the logger is built.
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        return rank == self.writer_rank

    def resume(self, step: int) -> None:
        """A resumed run continues after ``step``; call before the first record is written."""
        if self._opened:
            warnings.warn("MetricsLogger.resume() after backends were opened: they keep records beyond "
                          f"step {step}; load the tracker state before the first log step", RuntimeWarning,
                          stacklevel=2)
        self.resume_step = int(step)

    def log(self, record: Mapping[str, Any], step: int) -> None:
        """Write ``record`` (numbers only) at ``step`` to every enabled backend."""
        if not self.is_writer:
            return
        numbers = numeric_record(record)
        for backend in self.backends:
            if id(backend) in self._disabled:
                continue
            try:
                if not any(backend is opened for opened in self._opened):
                    self._opened.append(backend)
                    backend.open(self.resume_step)
                backend.write(numbers, step)
            except Exception as error:  # noqa: BLE001 - a logging failure must never stop training
                self._disable(backend, error)

    def close(self) -> None:
        for backend in self._opened:
            if id(backend) in self._disabled:
                continue
            try:
                backend.close()
            except Exception as error:  # noqa: BLE001
                self._disable(backend, error)
        self._opened = []

    def _disable(self, backend: Backend, error: Exception) -> None:
        self._disabled.add(id(backend))
        warnings.warn(f"logging backend {backend.name!r} failed and is disabled, training continues: "
                      f"{type(error).__name__}: {error}", RuntimeWarning, stacklevel=3)
