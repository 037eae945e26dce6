"""What every logging backend is: open once, write records, close."""

from __future__ import annotations

import math
from numbers import Real
from typing import Any, Mapping, Optional


class Backend:
    """One destination for metric records.

    The manager (:class:`~twinkle_megatron.logging.MetricsLogger`) calls
    :meth:`open` once, on the writing rank only, right before the first
    :meth:`write`; a backend's library is imported there, never at module import,
    so an uninstalled library costs nothing until it is asked for. ``resume_step``
    is the step a resumed run continues after (``None`` for a fresh run): records
    of later steps belong to the abandoned timeline and must not be duplicated.

    ``write`` gets numbers only (see :func:`numeric_record`). Any exception
    raised by ``open``, ``write`` or ``close`` disables the backend with one
    warning; training goes on.
    """

    name = "backend"

    def open(self, resume_step: Optional[int]) -> None:
        """Prepare to write (import the library, open files or runs)."""

    def write(self, record: Mapping[str, float], step: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Flush and release what ``open`` acquired."""


def numeric_record(record: Mapping[str, Any]) -> dict[str, float]:
    """The entries of ``record`` that are real numbers (bools as 0/1); lists, strings and None are left out."""
    numbers: dict[str, float] = {}
    for key, value in record.items():
        if isinstance(value, bool):
            numbers[key] = int(value)
        elif isinstance(value, Real):
            numbers[key] = value
    return numbers


def finite_or_none(value: float) -> Optional[float]:
    return value if math.isfinite(value) else None
