"""SwanLab: one experiment per training, continued under its id when a job continues.

Which run:

* a run the user already started (``swanlab.get_run()``) is logged into; the
  tracker never finishes it;
* a run that continues (it starts after step 1, or ``SLURM_RESTART_COUNT`` > 0)
  continues ``run_id`` or the id recorded in ``LOG_DIR/run_ids.json``
  (``resume="allow"``);
* otherwise a new experiment with SwanLab's fresh id (or ``run_id``).

Resume: SwanLab keeps the first value of a step and has no rewind: resumed
under the same id, its store would hold the abandoned steps and drop the
repeated ones. With a local store (``mode="offline"`` or ``"local"``) the
continuing run therefore supersedes the earlier run directories of its id:
their points before the restart step are replayed into the new run first
(read with SwanLab's own record reader), and the directories are moved to
``LOG_DIR/swanlog/superseded/`` (kept, not synced by ``swanlab sync`` of the
log directory). The new run directory alone then holds every step once. With
the cloud (``mode="online"``) the server's data cannot be rewritten from here:
the abandoned points stay and SwanLab drops the repeated steps (one warning).

The run configuration goes to the experiment's config.
"""

from __future__ import annotations

import glob
import os
import shutil
import warnings
from typing import Any, Mapping, Optional

from .base import RunStart
from .run_backends import ResumableRunBackend

LOCAL_MODES = ("offline", "local")


class SwanLabBackend(ResumableRunBackend):
    """Logs to a SwanLab experiment (see the module docstring for which one)."""

    name = "swanlab"
    requires = ("swanlab",)
    pip_extra = "swanlab"

    def __init__(self, project: Optional[str] = None, experiment_name: Optional[str] = None,
                 run_id: Optional[str] = None, config: Optional[Mapping[str, Any]] = None,
                 mode: Optional[str] = None, log_dir: Optional[str] = None, **init_kwargs: Any) -> None:
        super().__init__(config, run_id)
        self.project = project
        self.experiment_name = experiment_name
        self.mode = mode
        self.log_dir = log_dir
        self.init_kwargs = init_kwargs

    def user_run(self) -> Optional[Any]:
        import swanlab

        return swanlab.get_run() if swanlab.has_run() else None

    def add_config(self, config: Mapping[str, Any]) -> None:
        self.run.config.update(config)

    def open_own_run(self, run: RunStart, config: dict[str, Any], previous: Optional[str]) -> None:
        import swanlab

        mode = self.mode or os.environ.get("SWANLAB_MODE")
        log_dir = self.log_dir or (os.path.join(run.log_dir, "swanlog") if run.log_dir else None)
        options: dict[str, Any] = {"project": self.project, "experiment_name": self.experiment_name,
                                   "config": config, "mode": mode, "log_dir": log_dir, **self.init_kwargs}
        replay: dict[int, dict[str, float]] = {}
        if previous is not None:
            options.update(id=previous, resume="allow")
            if mode in LOCAL_MODES and log_dir is not None:
                replay = supersede_local_runs(log_dir, previous, run.first_step)
            elif run.continues:
                warnings.warn("SwanLab cloud runs cannot be rewound: the points SwanLab holds at step "
                              f"{run.first_step} or later stay and the resumed run's values of those steps are "
                              "dropped by SwanLab", RuntimeWarning, stacklevel=3)
        self.start(swanlab.init(**{key: value for key, value in options.items() if value is not None}))
        for step in sorted(replay):
            self.run.log(replay[step], step=step)

    def finish_failed(self) -> None:
        self.run.finish(state="crashed", error="twinkle-megatron: the SwanLab backend failed")


def local_run_dirs(log_dir: str, run_id: str) -> list[str]:
    """The run directories of ``run_id`` in a SwanLab log directory, oldest first (names start with the time)."""
    return sorted(path for path in glob.glob(os.path.join(glob.escape(log_dir), f"run-*-{glob.escape(run_id)}"))
                  if os.path.isdir(path))


def read_local_scalars(run_dir: str) -> dict[int, dict[str, float]]:
    """``{step: {key: value}}`` of the user's scalars in one run directory, read with SwanLab's record reader.

    SwanLab's own columns (system monitoring) are left out: they are not the user's to replay.
    """
    from swanlab.proto.swanlab.metric.column.v1.column_pb2 import ColumnClass
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    scalars: dict[int, dict[str, float]] = {}
    custom: set[str] = set()
    for path in glob.glob(os.path.join(glob.escape(run_dir), "run-*.swanlab")):
        reader = DataStoreReader()
        reader.open(path)
        try:
            for raw in reader:
                record = Record.FromString(raw)
                if record.HasField("column") and record.column.column_class == ColumnClass.COLUMN_CLASS_CUSTOM:
                    custom.add(record.column.column_key)
                elif record.HasField("scalar") and record.scalar.key in custom:
                    scalars.setdefault(record.scalar.step, {})[record.scalar.key] = record.scalar.value.number
        finally:
            reader.close()
    return scalars


def supersede_local_runs(log_dir: str, run_id: str, first_step: int) -> dict[int, dict[str, float]]:
    """Move ``run_id``'s run directories to ``log_dir/superseded/``; return their points before ``first_step``.

    Later directories win where several hold a step (each continuing run
    replays what it kept, so the latest directory is complete).
    """
    kept: dict[int, dict[str, float]] = {}
    directories = local_run_dirs(log_dir, run_id)
    for directory in directories:
        for step, values in read_local_scalars(directory).items():
            if step < first_step:
                kept.setdefault(step, {}).update(values)
    if directories:
        retired = os.path.join(log_dir, "superseded")
        os.makedirs(retired, exist_ok=True)
        for directory in directories:
            shutil.move(directory, os.path.join(retired, os.path.basename(directory)))
    return kept
