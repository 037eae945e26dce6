"""The metric base: states declared once, kept on the device, reduced in one sync.

A subclass declares its states in ``__init__`` with :meth:`Metric.add_state`
(name, shape, and how it reduces across ranks: ``sum``, ``max`` or ``min``),
updates them in ``accumulate`` only through :meth:`_add`, :meth:`_maximum`,
:meth:`_minimum` and :meth:`_assign` (device ops, never a host sync), and turns
the globally reduced states into Python numbers in :meth:`compute`.

``calculate()`` is collective: every rank calls it and every rank gets the same
dict. Ranks whose data does not count (earlier pipeline stages, TP ranks other
than 0, see :meth:`ParallelContext.holds_data`) contribute identity values, so
the collectives always line up and nothing is counted twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

import torch
import torch.distributed as dist

from ..parallel import ParallelContext

Number = Union[int, float]
StateValues = Mapping[str, Union[float, torch.Tensor]]

_IDENTITY = {"sum": 0.0, "max": float("-inf"), "min": float("inf")}


@dataclass(frozen=True)
class StateSpec:
    """One declared state: its shape and its cross-rank reduction (sum, max or min)."""

    reduce: str
    shape: tuple[int, ...] = ()

    @property
    def identity(self) -> float:
        return _IDENTITY[self.reduce]


class Metric:
    """Twinkle's ``Metric(device_mesh, process_group)``, with device states and one sync.

    Args:
        device_mesh: a :class:`ParallelContext`, a Twinkle or torch device mesh,
            or None (then megatron-core's parallel_state, ``process_group`` or
            the world is used; see :meth:`ParallelContext.resolve`).
        process_group: the data-parallel group (what Twinkle passes).
        cp_gathered: the data passed is already complete on every
            context-parallel rank, so count CP rank 0 only (DESIGN.md).
    """

    def __init__(self, device_mesh: Any = None, process_group: Any = None, *, cp_gathered: bool = False,
                 **kwargs: Any) -> None:
        self.device_mesh = device_mesh
        self.process_group = process_group
        self.cp_gathered = cp_gathered
        self._context: Optional[ParallelContext] = None
        if device_mesh is not None and dist.is_available() and dist.is_initialized():
            # Resolve now, while every rank constructs its metrics together: reading a device
            # mesh may create process groups, which every rank must create in the same order;
            # lazily, the last pipeline stage would create them in its first accumulate, the
            # other stages only at calculate(), after whatever groups were made in between.
            # Without a mesh nothing is created, and resolving at first use sees megatron's
            # parallel_state even when the metric was built before it was initialised.
            self._context = ParallelContext.resolve(device_mesh, process_group)
        self._specs: dict[str, StateSpec] = {}
        self._states: dict[str, torch.Tensor] = {}
        self.gathered_records: list = []

    # ---------------------------------------------------------------- states

    def add_state(self, name: str, reduce: str = "sum", shape: tuple[int, ...] = ()) -> None:
        """Declare a state; it starts at the identity of its reduction (0, -inf or +inf)."""
        if reduce not in _IDENTITY:
            raise ValueError(f"state {name!r}: reduce must be one of {sorted(_IDENTITY)}, got {reduce!r}")
        self._specs[name] = StateSpec(reduce, tuple(shape))
        self._states[name] = torch.full(tuple(shape), _IDENTITY[reduce], dtype=torch.float64,
                                        device=self._state_device())

    def _state_device(self) -> torch.device:
        return next(iter(self._states.values())).device if self._states else torch.device("cpu")

    def _as_state(self, name: str, value: Union[torch.Tensor, Number]) -> torch.Tensor:
        """``value`` as float64 on the states' device; states follow the first device data comes from."""
        state = self._states[name]
        if isinstance(value, torch.Tensor):
            value = value.detach()
            if value.device != state.device:
                if state.device.type == "cpu":
                    self._move_states(value.device)
                else:  # e.g. a CPU count next to CUDA states: never move the states back
                    value = value.to(state.device, non_blocking=True)
            return value.to(torch.float64)
        # A Python number becomes a device tensor by a fill kernel: no host sync.
        return torch.full((), float(value), dtype=torch.float64, device=state.device)

    def _move_states(self, device: torch.device) -> None:
        self._states = {k: v.to(device) for k, v in self._states.items()}

    def _add(self, name: str, value: Union[torch.Tensor, Number]) -> None:
        value = self._as_state(name, value)
        self._states[name] = self._states[name] + value

    def _maximum(self, name: str, value: Union[torch.Tensor, Number]) -> None:
        value = self._as_state(name, value)
        self._states[name] = torch.maximum(self._states[name], value)

    def _minimum(self, name: str, value: Union[torch.Tensor, Number]) -> None:
        value = self._as_state(name, value)
        self._states[name] = torch.minimum(self._states[name], value)

    def _assign(self, name: str, value: Union[torch.Tensor, Number]) -> None:
        value = self._as_state(name, value)
        self._states[name] = value.expand(self._specs[name].shape).clone()

    # ---------------------------------------------------------- the Twinkle API

    @property
    def context(self) -> ParallelContext:
        """The parallel layout: resolved at construction, or on first use when a metric is
        built before ``torch.distributed`` is initialised."""
        if self._context is None:
            self._context = ParallelContext.resolve(self.device_mesh, self.process_group)
        return self._context

    def accumulate(self, inputs: Any, outputs: Any, **kwargs: Any) -> None:
        raise NotImplementedError

    def compute(self, states: StateValues) -> dict[str, Number]:
        """Results from the globally reduced states (scalars as floats, others as CPU tensors)."""
        raise NotImplementedError

    def calculate(self) -> dict[str, Number]:
        """Reduce the states over all ranks, compute the results and reset (Twinkle's semantics).

        Collective: every rank calls it and every rank gets the same dict.
        Returns ``{}`` when no rank saw any data.
        """
        from .collection import calculate_metrics

        return calculate_metrics([self])

    def reset(self) -> None:
        """Back to the identity of every state."""
        device = self._state_device()
        self._states = {
            name: torch.full(spec.shape, spec.identity, dtype=torch.float64, device=device)
            for name, spec in self._specs.items()
        }
        self.gathered_records = []

    # --------------------------------------------------------- sync support

    def _before_sync(self) -> None:
        """Hook for host-side values that must join the sync (timers); called in calculate()."""

    def _local_records(self) -> Optional[list]:
        """Picklable records to gather from every rank, or None (the default: numbers only).

        A metric that returns a list here costs the collection one extra
        collective; the records of all ranks whose data counts are in
        ``self.gathered_records`` when :meth:`compute` runs.
        """
        return None

    def _local_states(self) -> dict[str, torch.Tensor]:
        """The states this rank contributes: its own, or identities if its data does not count."""
        if self.context.holds_data(self.cp_gathered):
            return self._states
        return {name: torch.full(spec.shape, spec.identity, dtype=torch.float64)
                for name, spec in self._specs.items()}

    # -------------------------------------------------------------- resuming

    def state_dict(self) -> dict[str, Any]:
        return {"states": {k: v.detach().cpu().clone() for k, v in self._states.items()}}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        states = state_dict["states"]
        missing = set(self._specs) - set(states)
        if missing:
            raise ValueError(f"{type(self).__name__}.load_state_dict: missing states {sorted(missing)}")
        device = self._state_device()
        self._states = {k: torch.as_tensor(states[k], dtype=torch.float64).to(device).reshape(spec.shape)
                        for k, spec in self._specs.items()}

    # ------------------------------------------------------- Twinkle helpers

    def gather_results(self, local_results: list) -> list:
        """Twinkle's helper for user-written metrics: all-gather picklable results over DP.

        Returns the concatenation of every data-parallel rank's list.
        """
        context = self.context
        if not context.distributed or context.dp_size == 1:
            return list(local_results)
        gathered: list = [None] * context.dp_size
        dist.all_gather_object(gathered, list(local_results), group=context.dp_group)
        return [item for rank_results in gathered for item in rank_results]
