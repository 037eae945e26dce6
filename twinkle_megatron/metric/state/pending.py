"""Updates held back until the states are read: the one deferral mechanism of every metric.

Two kinds of update cost less when applied together, later, than one by one in ``accumulate``:

* **Python numbers** (a learning rate, a grad norm, a generate time, a list of rewards, a loss Twinkle's Megatron
  model passes as a number). Applied at once, each costs a copy or a fill kernel per call for a value the host
  already holds; pended, each costs a Python operation and crosses to the device once. Kept per state as one
  update: ``add`` (fold as ``state + v``), ``max`` (``max(state, v)``) or ``replace`` (``v``; later additions and
  maxima apply to ``v`` on the host); ``v`` a float, or a list of floats shaped like the flattened state.
* **Values that count only when finite** (LossMetric's ``[loss, tokens]`` report of a microbatch: added to its
  states when finite, else counted). Checked and added at once, each costs about ten ops; pended, each costs one
  float64 copy per tensor (the caller may change its tensor in place later), and the finiteness test and the
  sums of all pending ones are made together in a fixed number of ops: one stack, one test, one reduction, one
  ``_foreach_add_``. Kept as rows ``(v_1, …, v_K)`` per set of states ``(s_1, …, s_K; nonfinite)``, folded as

      s_k += Σ_rows v_k · [every v of the row finite]        nonfinite += Σ_rows [some v of the row not finite]

  (in float64, on an accelerator when any value is on one).

What pends on a state is folded into it (:meth:`PendingUpdates.fold`):

* whenever the states are read: the sync, a checkpoint (``Metric.sync_states``), a value read for the tracker;
* before an update of the same state that does not commute with it (:meth:`PendingUpdates.settle`): additions
  wait through additions and maxima through maxima; anything else is folded first, so the order of updates is
  kept exactly (a ``replace`` supersedes what the host holds for the state);
* every :data:`PENDING_ROWS` rows of one set of states, to bound memory between syncs.

A reset and a loaded checkpoint drop what pends (:meth:`PendingUpdates.clear`). Nothing here reads a device value
on the host.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Iterable, Mapping, Optional, Union

import torch

from ..inputs.tensors import all_finite, all_host_numbers, host_float64, is_host_number, to_device
from .token_sums import add_in_place, apply_to_states, totals_of

HostNumbers = Union[float, list]  # a float, or one float per element of the flattened state
RowValue = Union[float, torch.Tensor]  # a Python number, or a 0-d float64 tensor (a copy of the caller's)
PENDING_ROWS = 64  # rows of values that count only when finite kept per set of states before they are folded


def _maximum(a: float, b: float) -> float:
    return b if b > a or b != b else a  # NaN wins, as in torch.maximum


_COMBINE: dict[str, Callable[[float, float], float]] = {"add": operator.add, "max": _maximum}


class _Rows:
    """Pending rows of values that count only when finite: one value per state of ``names`` per row."""

    def __init__(self, names: tuple[str, ...], nonfinite_count: str) -> None:
        self.names = names
        self.nonfinite_count = nonfinite_count
        self.rows: list[tuple[RowValue, ...]] = []

    def touches(self, name: str) -> bool:
        return name in self.names or name == self.nonfinite_count

    def totals(self) -> dict[str, torch.Tensor]:
        """State name -> what the rows add to it (see the module docstring)."""
        columns = list(zip(*self.rows))
        values = (value for column in columns for value in column if isinstance(value, torch.Tensor))
        device = next((value.device for value in values if value.device.type != "cpu"), torch.device("cpu"))
        stacked = torch.stack([_column(column, device) for column in columns])  # [K states, rows]
        finite = all_finite([stacked]).all(0)  # a row counts when every value of it is finite
        totals = dict(totals_of(self.names, torch.where(finite, stacked, 0.0).sum(1)))
        totals[self.nonfinite_count] = (~finite).sum(dtype=torch.float64)
        return totals


def _column(values: tuple[RowValue, ...], device: torch.device) -> torch.Tensor:
    """One state's values of the pending rows as a float64 vector on ``device`` (one copy for Python numbers)."""
    if all_host_numbers(values):
        return host_float64(values, device)
    return torch.stack([to_device(value, device) if isinstance(value, torch.Tensor) else
                        torch.full((), value, dtype=torch.float64, device=device) for value in values])


class PendingUpdates:
    """What pends on a metric's states until they are read (see the module docstring).

    Every method that folds takes the metric's states dict and replaces its entries (never the caller's tensors:
    a state may alias a loaded checkpoint, or move to the device the pending values are on).
    """

    def __init__(self) -> None:
        self._host: dict[str, tuple[str, HostNumbers]] = {}  # state -> (kind, value)
        self._rows: dict[tuple[tuple[str, ...], str], _Rows] = {}  # (states, nonfinite count) -> their rows

    def __bool__(self) -> bool:
        return bool(self._host) or bool(self._rows)

    def pend_host(self, kind: str, name: str, value: Any, states: dict[str, torch.Tensor]) -> bool:
        """Pend ``kind`` (``add``, ``max`` or ``replace``) of ``value`` to state ``name`` if ``value`` is a Python
        number or a non-empty list of them; False (nothing pended) otherwise: the caller updates the device
        state, after :meth:`settle`."""
        if not _host_numbers(value):
            return False
        value = list(map(float, value)) if isinstance(value, list) else float(value)
        if kind != "add":
            self._fold_rows(states, name)  # rows are additions: they come first
        pending = self._host.get(name)
        if kind != "replace" and pending is not None and pending[0] not in (kind, "replace"):
            self._fold_host(states, name)
            pending = None
        if kind == "replace" or pending is None:
            self._host[name] = (kind, value)
        else:
            self._host[name] = (pending[0], _elementwise(pending[1], value, _COMBINE[kind]))
        return True

    def pend_finite(self, values: Mapping[str, RowValue], nonfinite_count: str,
                    states: dict[str, torch.Tensor]) -> None:
        """Pend one row: each of ``values`` (a Python number, or a 0-d float64 tensor the caller will not change)
        added to the state of its name if every value of the row is finite, else 1 added to ``nonfinite_count``."""
        key = (tuple(values), nonfinite_count)
        rows = self._rows.get(key)
        if rows is None:
            self.settle(states, (*key[0], nonfinite_count), "add")  # rows are additions: what does not commute first
            rows = self._rows[key] = _Rows(*key)
        rows.rows.append(tuple(values.values()))
        if len(rows.rows) >= PENDING_ROWS:
            self._fold_rows(states, nonfinite_count)

    def settle(self, states: dict[str, torch.Tensor], names: Iterable[str], kind: Optional[str]) -> None:
        """Before a device update of ``kind`` (``add``, ``max``, ``min``, ``replace``; None: a read) of each of
        ``names``: fold what pends on it, but for what commutes with the update (additions with an addition,
        maxima with a maximum) and what the update supersedes (a ``replace`` drops the host's pending value)."""
        if not self:  # the common case: nothing pends (no loop over the names)
            return
        for name in names:
            if kind != "add":
                self._fold_rows(states, name)
            pending = self._host.get(name)
            if pending is None:
                continue
            if kind == "replace":
                del self._host[name]  # superseded
            elif pending[0] != kind:
                self._fold_host(states, name)

    def fold(self, states: dict[str, torch.Tensor], names: Optional[Iterable[str]] = None) -> None:
        """Fold everything pending on ``names`` (default: every state) into ``states``."""
        if not self:
            return
        if names is None:
            names = {*self._host, *(name for rows in self._rows.values() for name in (*rows.names,
                                                                                    rows.nonfinite_count))}
        self.settle(states, names, None)

    def clear(self) -> None:
        """Drop everything pending (a reset, a loaded checkpoint)."""
        self._host.clear()
        self._rows.clear()

    def _fold_host(self, states: dict[str, torch.Tensor], name: str) -> None:
        pending = self._host.pop(name, None)
        if pending is not None:
            states[name] = _folded(states[name], *pending)

    def _fold_rows(self, states: dict[str, torch.Tensor], name: str) -> None:
        for key in [key for key, rows in self._rows.items() if rows.touches(name)]:
            totals = self._rows.pop(key).totals()
            states.update(apply_to_states(states, totals, add_in_place))


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
