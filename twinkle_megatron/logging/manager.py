"""Fan records out to the backends, from one rank, surviving any backend's failure."""

from __future__ import annotations

import warnings
from typing import Any, Callable, Iterable, Mapping, Optional

import torch.distributed as dist

from .base import Backend, RunStart, numeric_record


class MetricsLogger:
    """Writes each record to every backend, on the writing rank only.

    Args:
        backends: the backends (see :func:`~twinkle_megatron.logging.build_backend`).
        writer_rank: the global rank that writes (default 0). Every rank gets the
            same results from ``calculate()``, so any rank can; Megatron-LM logs
            from the last rank, which works as well.
        log_dir: the run's directory (backends with run ids remember them there).

    Backends are opened at the first record, with the run's first step (see
    :meth:`start`): each drops or supersedes the points it already holds at that
    step or later, so a restarted run never shows a step twice. A backend whose
    ``open`` (an import, a file, a login) or ``write`` raises is disabled with
    one ``RuntimeWarning`` and the others carry on: training never stops for
    logging. To stop before training instead when a backend's package is missing,
    check the backends first (:func:`~twinkle_megatron.logging.check_backends`,
    ``TrackerConfig(strict_backends=True)``).
    """

    def __init__(self, backends: Iterable[Backend] = (), writer_rank: int = 0, log_dir: Optional[str] = None) -> None:
        self.backends: list[Backend] = list(backends)
        self.writer_rank = writer_rank
        self.log_dir = log_dir
        self.first_step: Optional[int] = None
        self.config: dict[str, Any] = {}
        self._opened: list[Backend] = []
        self._disabled: set[int] = set()  # ids: backends need not be hashable
        self._last_logged: Optional[int] = None  # the latest step written since the backends opened

    @property
    def is_writer(self) -> bool:
        # Read at each write: torch.distributed may be initialised after the logger is built.
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        return rank == self.writer_rank

    def start(self, first_step: int, config: Optional[Mapping[str, Any]] = None) -> None:
        """This run's first step (and configuration): call before the first record.

        Points the backends hold at ``first_step`` or later are dropped or
        superseded when they open. Without a call, the first step logged is the
        run's first step.
        """
        if self._opened:
            warnings.warn(f"MetricsLogger.start({first_step}) after backends were opened: they keep the points "
                          "they held; start the run (or load the tracker state) before the first log step",
                          RuntimeWarning, stacklevel=2)
            return
        self.first_step = int(first_step)
        if config is not None:
            self.config = dict(config)

    def restart(self, first_step: int) -> None:
        """Start the run again at ``first_step`` in this process (a checkpoint loaded after the first record).

        Every opened backend is closed and opened again with ``first_step``
        (``RunStart.restart``): each supersedes what it holds from that step on
        the way it does for a restarted job (JSONL moves the records aside,
        TensorBoard drops the events, W&B rewinds or continues the run in a
        successor, MLflow supersedes its run, SwanLab replays its local run), so
        no step is shown twice. A backend that fails to reopen is disabled with
        one warning, as always. Before the first record this only sets the first step.
        """
        first_step = int(first_step)
        if not self._opened:
            self.first_step = first_step
            return
        # Steps this run did not log between its first step and the new one: an earlier run's points there
        # were superseded when the backends opened (a rollback logged them itself: nothing lost).
        gap = max(self.first_step, (self._last_logged if self._last_logged is not None else -1) + 1)
        if self.first_step is not None and first_step > gap:
            warnings.warn(f"the run restarts at step {first_step} after the backends opened at step "
                          f"{self.first_step}: they supersede from step {first_step} on, but what an earlier run "
                          f"logged at steps {gap}..{first_step - 1} was superseded when they opened "
                          "(JSONL keeps it in its .superseded.jsonl file); load a checkpoint before the first log "
                          "to keep it", RuntimeWarning, stacklevel=3)
        self.first_step = first_step
        if self._last_logged is not None:
            self._last_logged = min(self._last_logged, first_step - 1)  # what is kept ends before first_step
        def reopen(backend: Backend) -> None:
            backend.close()
            backend.open(RunStart(first_step=first_step, config=self.config, log_dir=self.log_dir, restart=True))

        self._each_enabled(self._opened, reopen)

    def log(self, record: Mapping[str, Any], step: int) -> None:
        """Write ``record`` (numbers only) at ``step`` to every enabled backend."""
        if not self.is_writer:
            return
        numbers = numeric_record(record)
        if self.first_step is None:
            self.first_step = int(step)
        self._last_logged = int(step)

        def write(backend: Backend) -> None:
            if not any(backend is opened for opened in self._opened):
                self._opened.append(backend)
                backend.open(RunStart(first_step=self.first_step, config=self.config, log_dir=self.log_dir))
            backend.write(numbers, step)

        self._each_enabled(self.backends, write)

    def close(self) -> None:
        self._each_enabled(self._opened, lambda backend: backend.close())
        self._opened = []

    def _each_enabled(self, backends: Iterable[Backend], action: Callable[[Backend], None]) -> None:
        """``action`` on each backend not disabled; one that raises is disabled, with one warning (pointing at the
        caller of ``log``, ``restart`` or ``close``), and the others carry on: a logging failure never stops
        training."""
        for backend in backends:
            if id(backend) in self._disabled:
                continue
            try:
                action(backend)
            except Exception as error:  # noqa: BLE001 - a logging failure must never stop training
                self._disabled.add(id(backend))
                backend.abort()  # e.g. end the run it opened, so the user's next run can start
                warnings.warn(f"logging backend {backend.name!r} failed and is disabled, training continues: "
                              f"{type(error).__name__}: {error}", RuntimeWarning, stacklevel=3)
