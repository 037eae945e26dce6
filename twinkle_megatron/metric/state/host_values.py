"""State updates that arrive as Python numbers, kept on the host until the states are read.

A learning rate, a grad norm, a generate time or a list of rewards reaches ``accumulate`` as Python numbers.
Adding each to a device state costs a copy or a kernel launch per call for values the host already holds;
here they cost a Python addition, and cross to the device once, when the states are read (the sync, a
checkpoint, a device update of the same state). :class:`HostValues` keeps, per state, one pending update:

* ``add``: fold as ``state + v`` (sum states);
* ``max``: fold as ``max(state, v)`` (max states);
* ``replace``: fold as ``v`` (the latest value assigned; later adds and maxima apply to ``v`` on the host).

``v`` is a float, or a list of floats shaped like the flattened state. An update of another kind than the
one pending (an add after a max) folds the pending one first, so the order of updates is kept exactly.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Iterable, Optional, Union

import torch

from ..inputs.tensors import all_host_numbers, is_host_number, to_device

HostNumbers = Union[float, list]  # a float, or one float per element of the flattened state
def _maximum(a: float, b: float) -> float:
    return b if b > a or b != b else a  # NaN wins, as in torch.maximum


_COMBINE: dict[str, Callable[[float, float], float]] = {"add": operator.add, "max": _maximum}


class HostValues:
    """The pending host-side updates of a metric's states (see the module docstring)."""

    def __init__(self) -> None:
        self._pending: dict[str, tuple[str, HostNumbers]] = {}

    def __bool__(self) -> bool:
        return bool(self._pending)

    def update(self, kind: str, name: str, value: Any, states: dict[str, torch.Tensor]) -> bool:
        """Pend ``kind`` (``add``, ``max`` or ``replace``) of ``value`` to state ``name`` if ``value`` is a Python
        number or a non-empty list of them; False (nothing pended) otherwise: the caller updates the device
        state, after :meth:`fold` of that state."""
        if not _host_numbers(value):
            return False
        value = list(map(float, value)) if isinstance(value, list) else float(value)
        pending = self._pending.get(name)
        if kind != "replace" and pending is not None and pending[0] not in (kind, "replace"):
            self.fold(states, (name,))
            pending = None
        if kind == "replace" or pending is None:
            self._pending[name] = (kind, value)
        else:
            self._pending[name] = (pending[0], _elementwise(pending[1], value, _COMBINE[kind]))
        return True

    def drop(self, name: str) -> None:
        """Forget what is pending for ``name`` (a device assignment supersedes it)."""
        self._pending.pop(name, None)

    def fold(self, states: dict[str, torch.Tensor], names: Optional[Iterable[str]] = None) -> None:
        """Apply the pending updates of ``names`` (default: all) to ``states``, in place of the dict's entries
        (new tensors: a state may alias a loaded checkpoint)."""
        if not self._pending:
            return
        for name in list(self._pending) if names is None else names:
            pending = self._pending.pop(name, None)
            if pending is not None:
                states[name] = _folded(states[name], *pending)

    def clear(self) -> None:
        self._pending.clear()


def _host_numbers(value: Any) -> bool:
    if isinstance(value, list):
        return bool(value) and all_host_numbers(value)
    return is_host_number(value)


def _elementwise(a: HostNumbers, b: HostNumbers, op: Callable[[float, float], float]) -> HostNumbers:
    if isinstance(a, list) or isinstance(b, list):
        width = len(a) if isinstance(a, list) else len(b)
        a = a if isinstance(a, list) else [a] * width
        b = b if isinstance(b, list) else [b] * width
        return list(map(op, a, b))
    return op(a, b)


def _folded(state: torch.Tensor, kind: str, value: HostNumbers) -> torch.Tensor:
    update = torch.tensor(value, dtype=torch.float64)
    update = to_device(update.reshape(state.shape) if update.dim() else update, state.device)
    if kind == "add":
        return state + update
    if kind == "max":
        return torch.maximum(state, update)
    return update.expand(state.shape).clone()
