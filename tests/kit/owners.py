"""Who returned each key: a spy on every ``compute`` that builds a record (metrics and the tracker's parts).

A metric's :meth:`~twinkle_megatron.metric.state.base.Metric.results` is its
``compute`` of the global states and of each slice's (``key/<group>``), so the
spy wraps ``results`` for metrics, and ``compute`` for the tracker's
:class:`~twinkle_megatron.tracker.smoothing.RecordSmoothing` (not a metric).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Any, Iterator, Mapping

from twinkle_megatron.metric.state.base import Metric
from twinkle_megatron.tracker.smoothing import RecordSmoothing


@contextlib.contextmanager
def spy_on_computes() -> Iterator[list[tuple[Any, dict]]]:
    """Every (object, the dict its compute returned), in call order, while active."""
    calls: list[tuple[Any, dict]] = []
    originals = {(Metric, "results"): Metric.results, (RecordSmoothing, "compute"): RecordSmoothing.compute}

    def spying(original):
        def spy(self, *args, **kwargs):
            returned = original(self, *args, **kwargs)
            calls.append((self, dict(returned)))
            return returned
        return spy

    for (cls, name), original in originals.items():
        setattr(cls, name, spying(original))
    try:
        yield calls
    finally:
        for (cls, name), original in originals.items():
            setattr(cls, name, original)


def owners(record: Mapping[str, Any], calls: list[tuple[Any, dict]]) -> dict[str, set[str]]:
    """For each key of ``record``: the classes of the objects whose compute returned it (with that value)."""
    found: dict[str, set[str]] = defaultdict(set)
    for owner, returned in calls:
        for key, value in returned.items():
            if key in record and (record[key] == value or value != value):
                found[key].add(type(owner).__name__)
    return {key: found.get(key, set()) for key in record}
