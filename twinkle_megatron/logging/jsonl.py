"""One JSON object per log step, ``{"step": ..., ...numbers}``, appended to a file.

On resume, the records of steps after the resume step are dropped first (the
file is rewritten without them), because the resumed run is about to log those
steps again: the file never holds a step twice, and the steps it holds are the
ones of the timeline that continued. A half-written last line (a crash while
writing) is dropped at the same time. A fresh run appends and deletes nothing.

Non-finite numbers are written as ``null``: ``NaN`` is not JSON.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping, Optional

from .base import Backend, finite_or_none


class JsonlBackend(Backend):
    name = "jsonl"

    def __init__(self, path: str) -> None:
        self.path = path
        self._file: Any = None

    def open(self, resume_step: Optional[int]) -> None:
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, exist_ok=True)
        if resume_step is not None and os.path.exists(self.path):
            kept = [record for record in read_jsonl(self.path) if record.get("step", 0) <= resume_step]
            temporary = self.path + ".tmp"
            with open(temporary, "w", encoding="utf-8") as file:
                file.writelines(_line(record) for record in kept)
            os.replace(temporary, self.path)  # atomic: a crash leaves the old file or the new one
        self._file = open(self.path, "a", encoding="utf-8")

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
    records = []
    with open(path, encoding="utf-8") as file:
        for line in file:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                records.append(record)
    return records


def _line(record: Mapping[str, Any]) -> str:
    return json.dumps(record, allow_nan=False) + "\n"
