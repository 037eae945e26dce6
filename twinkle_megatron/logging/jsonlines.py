"""The lines of a JSONL file, streamed: one line in memory at a time, each parsed once.

The one place that says what a *cut* line is: a line that does not end with a
newline can only be the file's last one, and when it is not JSON either it is
a record a writer had not finished (a job killed mid-write, or a live run
still writing it). The JSONL backend drops it when it rewrites a log; the run
log reader (``runlog.py``) skips it with a warning.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional


@dataclass(frozen=True)
class JsonLine:
    """One line: its 1-based ``number``, its ``text`` (with the newline, if any), its JSON ``value``.

    ``error`` is the decoding error when the line is not JSON (``value`` is then None).
    """

    number: int
    text: str
    value: Any = None
    error: Optional[json.JSONDecodeError] = None

    @property
    def cut(self) -> bool:
        """A half-written last line: not JSON, and no newline after it."""
        return self.error is not None and not self.text.endswith("\n")

    @property
    def record(self) -> Optional[dict]:
        """The line's JSON object, or None (not JSON, or JSON that is not an object)."""
        return self.value if isinstance(self.value, dict) else None


def json_lines(lines: Iterable[str]) -> Iterator[JsonLine]:
    """Each line of ``lines`` (an open text file: read lazily) with its number and parsed value."""
    for number, text in enumerate(lines, start=1):
        try:
            yield JsonLine(number, text, json.loads(text))
        except json.JSONDecodeError as error:
            yield JsonLine(number, text, error=error)
