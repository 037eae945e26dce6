"""Weights & Biases: one run per training, rewound to the restart step when a job continues.

Which run:

* a run the user already started (``wandb.run``) is logged into, with the run
  configuration added to its config; the tracker never finishes it;
* a run that continues (it starts after step 1, or ``SLURM_RESTART_COUNT`` > 0)
  reopens the run it continues: ``run_id``, else ``$WANDB_RUN_ID``, else the id
  recorded in ``LOG_DIR/run_ids.json`` by the run before it. The run is
  *rewound* to the step before the restart (W&B's ``resume_from="ID?_step=N"``;
  recorded in the run file offline and applied by the server when synced): the
  points of the abandoned steps are archived by W&B and the resumed run logs
  those steps again, once. With ``rewind=False`` (a server without run rewind)
  it is resumed with ``resume="must"`` instead, and W&B keeps the abandoned
  points and drops the repeated steps;
* otherwise a new run: W&B's own fresh id, or ``run_id`` / ``$WANDB_RUN_ID``
  when given (``resume="allow"``). Two trainings in one allocation are two runs.

The run's configuration (layout, model shape, batch, FLOPs, versions, and the
user's ``config``) goes to the run's config once.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator, Mapping, Optional

from .base import ExperimentBackend, RunStart
from .run_ids import recall_run_id, remember_run_id


class WandbBackend(ExperimentBackend):
    """Logs to a W&B run (see the module docstring for which one)."""

    name = "wandb"

    def __init__(self, project: Optional[str] = None, name: Optional[str] = None, run_id: Optional[str] = None,
                 config: Optional[Mapping[str, Any]] = None, directory: Optional[str] = None, rewind: bool = True,
                 **init_kwargs: Any) -> None:
        super().__init__(config)
        self.project = project or os.environ.get("WANDB_PROJECT", "twinkle-megatron")
        self.run_name = name
        self.run_id = run_id
        self.directory = directory
        self.rewind = rewind
        self.init_kwargs = init_kwargs

    def open(self, run: RunStart) -> None:
        import wandb

        config = {**run.config, **self.config}
        if wandb.run is not None:  # the user's run: log into it, never finish it
            self.adopt(wandb.run)
            self.run.config.update(config, allow_val_change=True)
            return
        explicit = self.run_id or os.environ.get("WANDB_RUN_ID")
        run_id = explicit or (recall_run_id(run.log_dir, self.name) if run.continues else None)
        options: dict[str, Any] = {"project": self.project, "name": self.run_name, "config": config,
                                   "dir": self.directory}
        if run_id is not None and run.continues:
            if self.rewind:
                options["resume_from"] = f"{run_id}?_step={max(run.first_step - 1, 0)}"
            else:
                options.update(id=run_id, resume="must")
        elif run_id is not None:
            options.update(id=run_id, resume="allow")
        options.update(self.init_kwargs)
        if options.get("dir"):
            os.makedirs(options["dir"], exist_ok=True)
        with _rewind_over_resume_env("resume_from" in options):
            self.start(wandb.init(**{key: value for key, value in options.items() if value is not None}))
        remember_run_id(run.log_dir, self.name, self.run.id)

    def finish_failed(self) -> None:
        self.run.finish(exit_code=1)


@contextlib.contextmanager
def _rewind_over_resume_env(rewinding: bool) -> Iterator[None]:
    """Hide ``$WANDB_RESUME`` from ``wandb.init`` while rewinding.

    Job scripts often export ``WANDB_RESUME=allow``; W&B refuses ``resume`` together
    with ``resume_from`` (they are mutually exclusive), so the rewind, which is the
    resume done right, would disable the backend. Restored right after the call.
    """
    saved = os.environ.pop("WANDB_RESUME", None) if rewinding else None
    try:
        yield
    finally:
        if saved is not None:
            os.environ["WANDB_RESUME"] = saved
