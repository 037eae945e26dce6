"""TensorBoard scalars, through ``torch.utils.tensorboard`` (needs the ``tensorboard`` package)."""

from __future__ import annotations

from typing import Any, Mapping, Optional

from .base import Backend


class TensorBoardBackend(Backend):
    """One scalar per key and log step, in ``log_dir``.

    On resume after step T the writer is opened with ``purge_step=T + 1``:
    TensorBoard then hides the events of steps > T that the abandoned run wrote
    into the same directory, so the resumed run's points replace them instead of
    doubling back over them.
    """

    name = "tensorboard"

    def __init__(self, log_dir: str, flush_every_write: bool = True) -> None:
        self.log_dir = log_dir
        self.flush_every_write = flush_every_write
        self._writer: Any = None

    def open(self, resume_step: Optional[int]) -> None:
        from torch.utils.tensorboard import SummaryWriter  # raises ImportError without tensorboard

        purge_step = resume_step + 1 if resume_step is not None else None
        self._writer = SummaryWriter(log_dir=self.log_dir, purge_step=purge_step)

    def write(self, record: Mapping[str, float], step: int) -> None:
        for key, value in record.items():
            self._writer.add_scalar(key, value, global_step=step)
        if self.flush_every_write:  # once per log step: cheap, and a crash loses nothing
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
