"""A W&B run's history as its local run folders show it, read with W&B's own reader, streamed.

Every W&B run (online or offline) keeps a transaction log, ``RUN_DIR/run-ID.wandb``,
in a folder ``wandb/run-TIME-ID`` (online) or ``wandb/offline-run-TIME-ID``
(offline); a resumed run adds a folder with the same id. The history the server
shows once every folder of the run is synced, in start order, is:

* a folder whose run record has a ``branch_point`` on the same run (a rewind,
  ``resume_from="ID?_step=N"``) first drops the points after step N;
* otherwise (a fresh start or ``resume="allow"``) W&B keeps a point only when
  its step is above the last one it holds.

The records are read with ``wandb-core leet inspect --json`` (what ``wandb leet
inspect`` runs), one line at a time: memory does not grow with the history.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
import shutil
import subprocess
from typing import Any, Iterator, Optional

_FOLDER = re.compile(r"^(?:offline-)?run-(\d{8}_\d{6})-(.+)$")
SUPERSEDED_FOLDER = "superseded"  # beside the runs: ``wandb sync wandb/`` reads only wandb/*/*.wandb


def run_folders(wandb_dir: str, run_id: str) -> list[str]:
    """The folders of ``run_id`` in ``wandb_dir`` (online and offline), in start order."""
    found = []
    for path in glob.glob(os.path.join(glob.escape(wandb_dir), f"*run-*-{glob.escape(run_id)}")):
        match = _FOLDER.match(os.path.basename(path))
        if match and match.group(2) == run_id and os.path.isdir(path) and _log_file(path) is not None:
            found.append((match.group(1), path))
    return [path for _, path in sorted(found)]


def records(run_folder: str) -> Iterator[dict[str, Any]]:
    """The records of a run folder's transaction log, as W&B's reader prints them (JSON, one per line)."""
    from wandb.util import get_core_path

    command = [get_core_path(), "leet", "inspect", "--no-observability", "--json", "--run-file",
               _log_file(run_folder), os.path.dirname(os.path.abspath(run_folder))]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as reader:
        try:
            for line in reader.stdout:
                if line.strip():
                    yield json.loads(line)
        finally:
            reader.stdout.close()
            if reader.poll() is None:  # the caller stopped early
                reader.kill()
            _, error = reader.communicate()
    if reader.returncode not in (0, -9):
        raise RuntimeError(f"W&B's reader could not read {run_folder}: {error.strip()[-500:]}")


def run_record(run_folder: str) -> dict[str, Any]:
    """The folder's first run record (id, tags, config, branch point), read without the rest of the log."""
    for record in records(run_folder):
        if record.get("type") == "run":
            return record["run"]
    return {}


def visible_points(folders: list[str], run_id: str, below: Optional[int] = None) -> Iterator[tuple[int, dict]]:
    """``(step, {key: value})`` of the run's history as the server shows it, in step order (steps < ``below``).

    Keys W&B adds (``_step``, ``_runtime``…) are left out; non-finite numbers,
    stored as the strings ``"NaN"`` / ``"Infinity"``, are numbers again.
    """
    branches = [_branch_step(run_record(folder), run_id) for folder in folders]
    last = -1  # the last step the server holds
    for index, folder in enumerate(folders):
        later = [step for step in branches[index + 1:] if step is not None]
        ceiling = min(later, default=math.inf)  # a later rewind drops what this folder logs above it
        if below is not None:
            ceiling = min(ceiling, below - 1)
        if branches[index] is not None:
            last = min(last, branches[index])  # the rewind drops the points after its step
        for record in records(folder):
            if record.get("type") != "history":
                continue
            step = int(record["history"].get("step", {}).get("num", 0))
            if step <= last:
                continue  # W&B keeps a point only above the last step it holds
            last = step
            if step <= ceiling:
                values = {key: _number(value) for key, value in record["history"].get("item", {}).items()
                          if not key.startswith("_")}
                values = {key: value for key, value in values.items() if value is not None}
                if values:
                    yield step, values


def last_step(folders: list[str], run_id: str) -> Optional[int]:
    """The run's last visible step (None: no points)."""
    last = None
    for step, _ in visible_points(folders, run_id):
        last = step
    return last


def move_aside(wandb_dir: str, folders: list[str]) -> str:
    """Move run folders to ``wandb_dir/superseded/`` (kept, no longer synced by ``wandb sync wandb/``)."""
    target = os.path.join(wandb_dir, SUPERSEDED_FOLDER)
    os.makedirs(target, exist_ok=True)
    for folder in folders:
        shutil.move(folder, os.path.join(target, os.path.basename(folder)))
    return target


def _log_file(run_folder: str) -> Optional[str]:
    files = sorted(glob.glob(os.path.join(glob.escape(run_folder), "*.wandb")))
    return files[0] if files else None


def _branch_step(run: dict[str, Any], run_id: str) -> Optional[int]:
    branch = run.get("branch_point") or {}
    if branch.get("run") == run_id and branch.get("metric") == "_step":
        return int(branch.get("value", 0))  # protobuf's JSON leaves out a 0
    return None


def _number(value: Any) -> Optional[float]:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)):
        return value
    if value in ("NaN", "Infinity", "-Infinity"):
        return float(value.replace("Infinity", "inf"))
    return None
