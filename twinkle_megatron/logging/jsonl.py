"""One JSON object per log step, ``{"step": ..., ...numbers}``, appended to a file.

A run that starts at step *s* supersedes the records of steps ≥ *s* already in
the file: they belong to a timeline that did not continue (a job restarted from
its step *s* − 1 checkpoint, or from scratch when *s* = 1: a requeue before the
first checkpoint, or a new run reusing the run directory). Before the first
record, those records are moved out of the log into ``NAME.superseded.jsonl``
beside it (appended: nothing logged is ever deleted), so the log never holds a
step twice and its steps are those of the run that continued.

The log is streamed, one line at a time, into a temporary file beside it that
then replaces it (``os.replace``: a crash leaves the old log or the new one),
so superseding costs the same memory for a log of any size. The superseded
records reach their file (flushed to disk) before the log is replaced: a crash
in between leaves them in both, never in neither.

A half-written last line (a job killed while writing) is not a record: it is
dropped at the same time, so the new run's first record starts on a fresh line.
Lines that are not JSON elsewhere are kept as they are (this backend never
rewrites what it cannot read).

The path must be a regular file (or not exist yet): a device (``/dev/full``
would be read forever), a FIFO (opening it blocks) or a directory is refused
with a ``ValueError`` when the backend opens, which the logger reports once
before disabling the backend; training goes on.

Non-finite numbers are written as ``null``, named in the record's ``"nonfinite"``
object by their JSON Pointer with what they were (``{"loss": null, "nonfinite":
{"/loss": "NaN"}}``): ``NaN`` is not JSON, and ``null`` alone could not tell NaN from
infinity. :func:`strict_json` is that rule (``incidents.jsonl`` is written by it too),
:func:`restore_nonfinite` its inverse.
"""

from __future__ import annotations

import json
import math
import os
import stat
from typing import Any, Mapping, Optional

from .base import Backend, RunStart
from .jsonlines import json_lines

NONFINITE_MARKS = "nonfinite"  # the key of a record's marks: {JSON Pointer: "NaN" | "Infinity" | "-Infinity"}


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
        _refuse_unless_regular(self.path)
        _refuse_unless_regular(self.superseded_path)
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        if os.path.exists(self.path):
            self._supersede(run.first_step)
        self._file = open(self.path, "a", encoding="utf-8")

    def _supersede(self, first_step: int) -> None:
        """Move the records of steps ≥ ``first_step`` (and a cut last line) out of the log, streaming."""
        target = os.path.realpath(self.path)  # a symlinked log: rewrite the file, keep the link
        temporary = target + ".tmp"
        changed = False
        archive = None
        try:
            with open(target, encoding="utf-8", errors="surrogateescape") as log, \
                    open(temporary, "w", encoding="utf-8", errors="surrogateescape") as kept:
                for line in json_lines(log):
                    step = _step(line.record) if line.record is not None else None
                    if line.cut:
                        changed = True  # not a record: dropped
                    elif step is not None and step >= first_step:
                        if archive is None:
                            archive = open(self.superseded_path, "a", encoding="utf-8", errors="surrogateescape")
                        archive.write(_whole(line.text))
                        changed = True
                    else:
                        kept.write(_whole(line.text))  # lines that are not records are kept as they are
                        changed = changed or not line.text.endswith("\n")
            if archive is not None:
                archive.flush()
                os.fsync(archive.fileno())  # on disk before they leave the log
            if changed:
                os.replace(temporary, target)  # atomic: a crash leaves the old file or the new one
        finally:
            if archive is not None:
                archive.close()
            if os.path.exists(temporary):
                os.remove(temporary)  # unchanged log (or a failure): the original stays

    def write(self, record: Mapping[str, float], step: int) -> None:
        values = {key: value for key, value in record.items() if key != "step"}
        self._file.write(_line(strict_json({"step": step, **values})))
        self._file.flush()  # a record is on disk once logged, even if the job is killed next

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def strict_json(record: Mapping[str, Any]) -> dict[str, Any]:
    """``record`` with every non-finite float (at any depth) as ``None``, named in ``record["nonfinite"]``.

    The marks map each value's JSON Pointer (RFC 6901: ``/loss``, ``/samples/0/loss``,
    ``/``-in-keys as ``~1``) to what it was, spelled as Python's ``json`` spells it:
    ``"NaN"``, ``"Infinity"``, ``"-Infinity"``. Without non-finite values the record
    is returned as it is (a copy), with no ``"nonfinite"`` key.
    """
    marks: dict[str, str] = {}
    strict = _strict(record, "", marks)
    if marks:
        strict[NONFINITE_MARKS] = marks
    return strict


def restore_nonfinite(record: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`strict_json`, in place: each marked ``null`` becomes its float again and the
    marks are removed. A line written with bare ``NaN`` / ``Infinity`` (``json.loads`` reads them) has no
    marks and is returned as it is."""
    marks = record.pop(NONFINITE_MARKS, None)
    if not isinstance(marks, Mapping):
        return record
    for pointer, spelling in marks.items():
        *path, last = [part.replace("~1", "/").replace("~0", "~") for part in pointer.split("/")[1:]]
        container: Any = record
        try:
            for part in path:
                container = container[int(part)] if isinstance(container, list) else container[part]
            if isinstance(container, list):
                container[int(last)] = float(spelling)
            elif last in container:
                container[last] = float(spelling)
        except (KeyError, IndexError, ValueError, TypeError):
            continue  # a mark that names nothing in this record: not ours to guess
    return record


def _strict(value: Any, pointer: str, marks: dict[str, str]) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        marks[pointer] = json.dumps(value)  # NaN, Infinity, -Infinity: the spelling json.loads reads back
        return None
    if isinstance(value, Mapping):
        return {key: _strict(item, f"{pointer}/{str(key).replace('~', '~0').replace('/', '~1')}", marks)
                for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(item, f"{pointer}/{index}", marks) for index, item in enumerate(value)]
    return value


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """The records of a JSONL run log, in file order; lines that do not parse are skipped."""
    with open(path, encoding="utf-8", errors="surrogateescape") as file:
        return [line.record for line in json_lines(file) if line.record is not None]


def _refuse_unless_regular(path: str) -> None:
    """A path that exists must be a regular file (symlinks followed): never read a device, FIFO or directory."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else \
            "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file"
        raise ValueError(f"the JSONL log {path} is {kind}, not a regular file: it is neither read nor written; "
                         "give the path of a file (or of one that does not exist yet)")


def _step(record: Mapping[str, Any]) -> Optional[int]:
    step = record.get("step")
    return int(step) if isinstance(step, (int, float)) and not isinstance(step, bool) else None


def _whole(text: str) -> str:
    """A line ending with a newline (the last line may lack one: the next record must start a line)."""
    return text if text.endswith("\n") else text + "\n"


def _line(record: Mapping[str, Any]) -> str:
    return json.dumps(record, allow_nan=False) + "\n"
