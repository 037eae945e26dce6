"""One JSON object per log step, ``{"step": ..., ...numbers}``, appended to a file.

A run that starts at step *s* supersedes the records of steps ≥ *s* already in
the file: they belong to a timeline that did not continue (a job restarted from
its step *s* − 1 checkpoint, or from scratch when *s* = 1: a requeue before the
first checkpoint, or a new run reusing the run directory). Before the first
record, those records are moved out of the log into ``NAME.superseded.jsonl``
beside it (appended: nothing logged is ever deleted), so the log never holds a
step twice and its steps are those of the run that continued. The log is
rewritten atomically (a crash leaves the old file or the new one).

A half-written last line (a job killed while writing) is not a record: it is
dropped at the same time, so the new run's first record starts on a fresh line.
Lines that are not JSON elsewhere are kept as they are (this backend never
rewrites what it cannot read).

Non-finite numbers are written as ``null``: ``NaN`` is not JSON.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping, Optional

from .base import Backend, RunStart, finite_or_none


class JsonlBackend(Backend):
    name = "jsonl"

    def __init__(self, path: str) -> None:
        self.path = path
        self._file: Any = None

    @property
    def superseded_path(self) -> str:
        """Where records superseded by a restarted run go: ``metrics.jsonl`` → ``metrics.superseded.jsonl``."""
        root, extension = os.path.splitext(self.path)
        return f"{root}.superseded{extension or '.jsonl'}"

    def open(self, run: RunStart) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        if os.path.exists(self.path):
            self._supersede(run.first_step)
        self._file = open(self.path, "a", encoding="utf-8")

    def _supersede(self, first_step: int) -> None:
        with open(self.path, encoding="utf-8", errors="surrogateescape") as file:
            lines = file.readlines()
        kept, superseded = [], []
        for number, line in enumerate(lines, start=1):
            record = _parse(line)
            if record is None:
                if number == len(lines) and not line.endswith("\n"):
                    continue  # a cut last line: not a record
                kept.append(line)  # not ours to judge: kept as it is
            elif _step(record) is not None and _step(record) >= first_step:
                superseded.append(line if line.endswith("\n") else line + "\n")
            else:
                kept.append(line if line.endswith("\n") else line + "\n")
        if not superseded and kept == lines:
            return  # nothing to change: append after the last complete line
        if superseded:
            with open(self.superseded_path, "a", encoding="utf-8", errors="surrogateescape") as file:
                file.writelines(superseded)
                file.flush()
                os.fsync(file.fileno())  # on disk before they leave the log
        temporary = self.path + ".tmp"
        with open(temporary, "w", encoding="utf-8", errors="surrogateescape") as file:
            file.writelines(kept)
        os.replace(temporary, self.path)  # atomic: a crash leaves the old file or the new one

    def write(self, record: Mapping[str, float], step: int) -> None:
        values = {key: finite_or_none(value) for key, value in record.items() if key != "step"}
        self._file.write(_line({"step": step, **values}))
        self._file.flush()  # a record is on disk once logged, even if the job is killed next

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """The records of a JSONL run log, in file order; lines that do not parse are skipped."""
    with open(path, encoding="utf-8", errors="surrogateescape") as file:
        return [record for record in map(_parse, file) if record is not None]


def _parse(line: str) -> Optional[dict[str, Any]]:
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def _step(record: Mapping[str, Any]) -> Optional[int]:
    step = record.get("step")
    return int(step) if isinstance(step, (int, float)) and not isinstance(step, bool) else None


def _line(record: Mapping[str, Any]) -> str:
    return json.dumps(record, allow_nan=False) + "\n"
