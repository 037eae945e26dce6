"""The run log as people read it: a tracker's JSONL log, strict about what it reads.

Used by ``twinkle-megatron summary`` / ``plot`` (``cli.py``, ``plots/``). A
missing or empty file, a line that is not JSON or a record without ``"step"``
is a :class:`RunLogError` naming the line, because a chart of half a log looks
right and is wrong; the one exception is a half-written *last* line (the run
is still writing it), skipped with a warning so a live run can be watched.
Non-finite values (``null``) are kept as NaN; values that are not numbers are
ignored. A log that holds a step twice (runs appended to one file by other
means) is read with a warning, the later value winning. (The JSONL backend's
own reader, :func:`~twinkle_megatron.logging.jsonl.read_jsonl`, is tolerant on
purpose: it resumes a run, it does not show one.)
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Dict, List, Optional, Tuple

from .. import keys
from .jsonlines import json_lines

# Summary rows in reading order; other keys follow alphabetically, eval/* last.
KEY_ORDER = (
    keys.LOSS, keys.LOSS_EMA, keys.LOSS_SPIKE, "accuracy", "logprob", "entropy", keys.GRAD_NORM,
    keys.LEARNING_RATE, keys.CONSUMED_TOKENS, keys.TOKENS_PER_SECOND, keys.TOKENS_PER_SECOND_EMA,
    keys.TOKENS_PER_SECOND_PER_GPU, keys.TFLOPS_PER_GPU, keys.MFU, keys.MFU_EMA, keys.STEP_TIME, keys.STEP_TIME_MIN,
    keys.STEP_TIME_EMA, keys.SLOWEST_RANK,
)


class RunLogError(ValueError):
    """A run log that cannot be read; the message names the file and the line."""


@dataclass
class RunLog:
    """The records of a JSONL run log, sorted by step (file order among equal steps).

    Each record maps ``"step"`` to an int and every other key to a number
    (``NaN`` where the log has ``null``).
    """

    path: str
    records: List[Dict[str, float]]
    warnings: List[str] = field(default_factory=list)

    @cached_property
    def keys(self) -> List[str]:
        """Every key but ``step``, in :data:`KEY_ORDER`, then alphabetically, ``eval/*`` last."""
        found = {key for record in self.records for key in record if key != "step"}
        rank = {key: index for index, key in enumerate(KEY_ORDER)}
        return sorted(found, key=lambda key: (key.startswith(keys.EVAL_PREFIX), rank.get(key, len(rank)), key))

    def series(self, key: str) -> tuple[List[int], List[float]]:
        """``(steps, values)`` of the records that have ``key`` (values may be NaN)."""
        pairs = [(record["step"], record[key]) for record in self.records if key in record]
        return [step for step, _ in pairs], [value for _, value in pairs]


def load_run(path: str) -> RunLog:
    """Read a JSONL run log (or ``DIR/metrics.jsonl`` for a directory) strictly; :class:`RunLogError` if bad.

    The tracker's own reader (``logging.jsonl.read_jsonl``) skips lines that do
    not parse, which is right when a resumed run rewrites its log, but a
    command a person runs to look at a log must say what is wrong and where.
    """
    if os.path.isdir(path):
        candidate = os.path.join(path, "metrics.jsonl")
        if not os.path.isfile(candidate):
            raise RunLogError(f"{path} is a directory without a metrics.jsonl; give the JSONL file")
        path = candidate
    if not os.path.exists(path):
        raise RunLogError(f"{path}: no such file")
    log = RunLog(path=path, records=[])
    numbered: List[Tuple[int, Dict[str, float]]] = []
    try:
        with open(path, encoding="utf-8") as file:
            for line in json_lines(file):  # streamed: a long log is never held as text
                if not line.text.strip():
                    continue
                if line.cut:
                    log.warnings.append(f"{path}, line {line.number}: incomplete last line skipped "
                                        "(the run may still be writing it)")
                elif line.error is not None:
                    raise RunLogError(f"{path}, line {line.number}: not valid JSON ({line.error.msg}, "
                                      f"column {line.error.colno})")
                else:
                    numbered.append((line.number, _record(line.value, path, line.number)))
    except UnicodeDecodeError:
        raise RunLogError(f"{path} is not a UTF-8 text file (a JSONL run log is)") from None
    except OSError as error:
        raise RunLogError(f"cannot read {path}: {error.strerror or error}") from None
    if not numbered:
        raise RunLogError(f"{path} is empty: it holds no records")
    log.warnings += _timeline_warnings(path, numbered)
    log.records = _later_values_win(numbered)
    log.records.sort(key=lambda record: record["step"])  # stable: file order among equal steps
    return log


def _timeline_warnings(path: str, numbered: List[Tuple[int, Dict[str, float]]]) -> List[str]:
    """Steps that go backwards and values logged twice at one step: the log holds more than one timeline."""
    backwards: List[str] = []
    repeated: List[str] = []
    seen: Dict[Tuple[int, str], int] = {}
    previous: Optional[Tuple[int, int]] = None  # (line, step)
    for number, record in numbered:
        step = int(record["step"])
        if previous is not None and step < previous[1]:
            backwards.append(f"line {number}: step {step} after step {previous[1]} (line {previous[0]})")
        previous = (number, step)
        for key in record:
            if key == "step":
                continue
            if (step, key) in seen:
                repeated.append(f"{key!r} at step {step} (lines {seen[(step, key)]} and {number})")
            seen[(step, key)] = number
    found = []
    if backwards:
        found.append(f"{path}: steps go backwards {len(backwards)} time(s), first at {backwards[0]}: the log holds "
                     "runs that were not resumed into it")
    if repeated:
        found.append(f"{path}: {len(repeated)} value(s) logged twice for the same step, first {repeated[0]}; "
                     "the later value is used")
    return found


def _later_values_win(numbered: List[Tuple[int, Dict[str, float]]]) -> List[Dict[str, float]]:
    """The records, each (step, key) kept only in the last record that has it; records left empty are dropped."""
    claimed: set = set()
    kept: List[Dict[str, float]] = []
    for _, record in reversed(numbered):
        step = int(record["step"])
        values = {key: value for key, value in record.items() if key != "step" and (step, key) not in claimed}
        claimed.update((step, key) for key in values)
        if values or len(record) == 1:
            kept.append({"step": step, **values})
    kept.reverse()
    return kept


def _record(value: Any, path: str, number: int) -> Dict[str, float]:
    """One line's object as ``{"step": int, key: number}``; non-numbers are dropped."""
    where = f"{path}, line {number}"
    if not isinstance(value, dict):
        raise RunLogError(f"{where}: expected a JSON object like {{\"step\": 1, \"loss\": 2.3}}, "
                          f"got {type(value).__name__}")
    if "step" not in value:
        raise RunLogError(f"{where}: the record has no \"step\" (keys: {', '.join(sorted(value)) or 'none'})")
    step = value["step"]
    if isinstance(step, bool) or not isinstance(step, (int, float)) or not float(step).is_integer():
        raise RunLogError(f"{where}: \"step\" must be an integer, got {step!r}")
    record: Dict[str, float] = {"step": int(step)}
    for key, item in value.items():
        if key == "step":
            continue
        if item is None:  # the JSONL backend writes non-finite numbers as null
            record[key] = math.nan
        elif isinstance(item, bool):
            record[key] = int(item)
        elif isinstance(item, (int, float)):
            record[key] = item
    return record


# ------------------------------------------------------------------ summary
