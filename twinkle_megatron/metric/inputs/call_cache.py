"""What the metrics of one ``MetricCollection.accumulate`` call share: values computed once per call.

:func:`sharing_call_values` (which :class:`MetricCollection` opens around each ``accumulate``) holds a
dict for the length of the call; :func:`shared_value` computes a value at its first request in the call
and returns the same object to every later one. Keys name the objects a value was made from by ``id``: an
entry keeps those objects alive, so that no id is reused while the call lasts. Outside a call nothing is
kept (each request computes).
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Any, Callable, Iterator, Optional

_values: ContextVar[Optional[dict]] = ContextVar("twinkle_megatron_call_values", default=None)


@contextlib.contextmanager
def sharing_call_values(**hints: Any) -> Iterator[dict]:
    """Within the block, :func:`shared_value` computes each value once; ``hints`` are kept under their names
    (what the call's metrics declared, e.g. the token statistics they read)."""
    token = _values.set(dict(hints))
    try:
        yield _values.get()
    finally:
        _values.reset(token)


def call_values() -> Optional[dict]:
    """The current call's shared values (None outside a :func:`sharing_call_values` block)."""
    return _values.get()


def shared_value(key: tuple, compute: Callable[[], Any], keep: tuple = ()) -> Any:
    """``compute()`` once per call for ``key``; ``keep``: the objects whose ids ``key`` holds."""
    values = _values.get()
    if values is None:
        return compute()
    entry = values.get(key)
    if entry is None:
        entry = values[key] = (compute(), keep)
    return entry[0]
