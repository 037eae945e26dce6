"""The run ids of the backends that have them (W&B, MLflow, SwanLab), kept in the run directory.

A restarted job (a resume, a Slurm requeue) must log into the run it started
before, though nothing but the run directory survives the restart when the job
was preempted before its first checkpoint. So each backend records the id of
the run it opened in ``LOG_DIR/run_ids.json`` (``{"wandb": "...", ...}``) and
reads it back when a run continues. Written by the writing rank only,
atomically (a crash leaves the old file or the new one).
"""

from __future__ import annotations

import json
import os
from typing import Optional

FILE_NAME = "run_ids.json"


def recall_run_id(log_dir: Optional[str], backend: str) -> Optional[str]:
    """The id ``backend`` recorded in ``log_dir``, or None (no directory, no file, no entry, unreadable file)."""
    ids = _read(log_dir)
    value = ids.get(backend)
    return value if isinstance(value, str) and value else None


def remember_run_id(log_dir: Optional[str], backend: str, run_id: str) -> None:
    """Record ``run_id`` as ``backend``'s run for later restarts (nothing without a ``log_dir``)."""
    if log_dir is None:
        return
    ids = _read(log_dir)
    if ids.get(backend) == run_id:
        return
    ids[backend] = run_id
    os.makedirs(log_dir, exist_ok=True)
    path = os.path.join(log_dir, FILE_NAME)
    with open(path + ".tmp", "w", encoding="utf-8") as file:
        json.dump(ids, file, indent=1, sort_keys=True)
        file.write("\n")
    os.replace(path + ".tmp", path)


def _read(log_dir: Optional[str]) -> dict:
    if log_dir is None:
        return {}
    try:
        with open(os.path.join(log_dir, FILE_NAME), encoding="utf-8") as file:
            ids = json.load(file)
    except (OSError, ValueError):
        return {}
    return ids if isinstance(ids, dict) else {}
