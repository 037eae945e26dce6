"""Weights & Biases: one run, resumed under the same id after a restart."""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional

from .base import Backend


class WandbBackend(Backend):
    """Logs to a W&B run.

    The run id is ``run_id``, else ``$WANDB_RUN_ID`` (W&B's own convention, to
    continue a run in a new job), else ``$SLURM_JOB_ID`` (a requeued Slurm job
    keeps its id), else W&B's own; ``resume="allow"`` continues that run when it
    exists. W&B only accepts increasing steps, so points of steps the resumed
    run repeats are dropped by W&B (with its warning) unless ``init_kwargs``
    asks for W&B's ``resume_from`` rewind.
    """

    name = "wandb"

    def __init__(self, project: Optional[str] = None, name: Optional[str] = None, run_id: Optional[str] = None,
                 config: Optional[Mapping[str, Any]] = None, directory: Optional[str] = None,
                 **init_kwargs: Any) -> None:
        self.project = project or os.environ.get("WANDB_PROJECT", "twinkle-megatron")
        self.run_name = name
        self.run_id = run_id
        self.config = dict(config) if config is not None else None
        self.directory = directory
        self.init_kwargs = init_kwargs
        self._wandb: Any = None
        self._run: Any = None

    def open(self, resume_step: Optional[int]) -> None:
        import wandb

        self._wandb = wandb
        run_id = self.run_id or os.environ.get("WANDB_RUN_ID") or os.environ.get("SLURM_JOB_ID")
        options = {"project": self.project, "name": self.run_name, "config": self.config, "dir": self.directory,
                   "id": run_id, "resume": "allow", **self.init_kwargs}
        self._run = wandb.init(**{key: value for key, value in options.items() if value is not None})

    def write(self, record: Mapping[str, float], step: int) -> None:
        self._run.log(dict(record), step=step)

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None
