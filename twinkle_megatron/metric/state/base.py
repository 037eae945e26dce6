"""The metric base: states declared once, kept on the device, reduced in one sync.

A subclass declares its states in ``__init__`` with :meth:`Metric.add_state`
(name, shape, and how it reduces across ranks: ``sum``, ``max`` or ``min``),
updates them in ``accumulate`` only through :meth:`_add`, :meth:`_maximum`,
:meth:`_minimum`, :meth:`_assign` and their token-level and finite-only forms
(device ops, never a host sync; Python numbers and values that count only when
finite are held back until the states are read, see :mod:`.pending`), and turns
the globally reduced states into Python numbers in :meth:`compute`.

``calculate()`` is collective: every rank calls it and every rank gets the same
dict. Ranks whose data does not count (earlier pipeline stages, TP ranks other
than 0, see :meth:`ParallelContext.counts_here`) contribute identity values, so
the collectives always line up and nothing is counted twice.

A subclass takes a call in one of two forms, each behind :mod:`.call_boundary` (keywords checked, NumPy
arrays as tensors, autograd off): ``accumulate_call(call)``, a :class:`.SharedCall` whose views and token
statistics the metrics of one call share (``accumulate(inputs, outputs, **kwargs)``, Twinkle's form, then makes
the call object itself), or Twinkle's ``accumulate`` overridden, for a metric that shares nothing.

When Twinkle is installed, :class:`Metric` also derives from
``twinkle.metric.Metric``, so Twinkle's ``add_metric`` / ``construct_class``
construct these classes like its own (set ``TWINKLE_MEGATRON_STANDALONE=1`` to
keep Twinkle out). Twinkle is never a dependency.
"""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass
from typing import Any, ClassVar, Iterable, Mapping, Optional, Union

import torch
import torch.distributed as dist

from ...parallel import ParallelContext
from ..inputs.keywords import check_constructor_keywords, check_outputs_read, register_call_keywords
from ..inputs.microbatches import given
from ..inputs.shared_call import SharedCall
from ..inputs.tensors import all_finite, all_host_numbers, is_host_number
from .call_boundary import checked_accumulate, checked_call
from .groups import GROUPED_SUFFIX, INVALID_GROUP_IDS, TokenSlices, check_group_names, slice_states, token_groups
from .pending import PendingUpdates
from .positions import position_buckets as check_position_buckets
from .resume import loaded_states
from .sync import Number, SyncedStates, calculate_metrics, gather_results, reduced_state_dicts, syncs_declared_states
from .token_sums import add_in_place, apply_to_states, max_totals, maximum_in_place, sum_totals

_IDENTITY = {"sum": 0.0, "max": float("-inf"), "min": float("inf")}


def twinkle_metric_base() -> type:
    """``twinkle.metric.Metric`` when Twinkle is installed and importable, else ``object``
    (``TWINKLE_MEGATRON_STANDALONE=1`` keeps Twinkle out)."""
    if os.environ.get("TWINKLE_MEGATRON_STANDALONE", "") not in ("", "0"):
        return object
    try:
        if importlib.util.find_spec("twinkle") is None:
            return object
        from twinkle.metric.base import Metric as TwinkleMetric
    except Exception:  # noqa: BLE001 - a broken or unrelated 'twinkle' must not break this package
        return object
    return TwinkleMetric


_Base = twinkle_metric_base()


@dataclass(frozen=True)
class StateSpec:
    """One declared state: its shape and its cross-rank reduction (sum, max or min)."""

    reduce: str
    shape: tuple[int, ...] = ()

    @property
    def identity(self) -> float:
        return _IDENTITY[self.reduce]


class Metric(_Base):
    """Twinkle's ``Metric(device_mesh, process_group)``, with device states and one sync.

    Args:
        device_mesh: a :class:`ParallelContext`, a Twinkle or torch device mesh,
            or None (then megatron-core's parallel_state, ``process_group`` or
            the world is used; see :meth:`ParallelContext.resolve`).
        process_group: the data-parallel group (what Twinkle passes).
        cp_gathered: whether the data passed is complete on every context-parallel
            rank (then CP rank 0 counts it once) or each CP rank passes its own
            chunks (``False``: every CP rank counts). ``None`` (default): decided
            per microbatch from the shapes, see :func:`.context_parallel.align_to_cp_rank`.
        group_names: names of the groups (datasets of a blend, domains) the
            metric also reports per group, as ``key/<name>`` (see :mod:`.groups`).
        group_key: the ``inputs`` key of the group ids (megatron-core's
            ``BlendedDataset`` names it ``dataset_id``).
        position_buckets, seq_length: also report per bucket of token positions, ``key/pos_<first>-<last>``
            (edges, or a number of equal buckets over ``seq_length``; see :mod:`.positions`).
    """

    nonfinite_loss_state: ClassVar[Optional[str]] = None
    """The sum state counting the non-finite losses the metric left out (a loss metric's), read by
    :meth:`nonfinite_loss_count`; None: the metric takes no loss."""
    call_keywords: ClassVar[tuple[str, ...]] = ()
    """The ``accumulate`` keywords the metric reads (per-call values): their near misses warn (see
    :mod:`..inputs.keywords`)."""
    output_keys: ClassVar[tuple[str, ...]] = ()
    """The ``outputs`` keys the metric reads, one of which a call needs to add anything (empty: none needed)."""
    reports_positions: ClassVar[bool] = False
    """Whether the metric knows each token's position, so that ``position_buckets`` can be given."""
    token_statistics: ClassVar[tuple[str, ...]] = ("argmax", "logprobs", "entropy")
    """The per-token statistics of the logits the metric reads (see :mod:`..tokens.logits_pass`): a collection whose
    metrics read no ``logprobs`` or ``entropy`` makes the argmax-only pass. Undeclared: all of them."""

    def token_statistics_for(self, outputs: Any) -> tuple[str, ...]:
        """What one call with these ``outputs`` reads of the logits' statistics (default: ``token_statistics``);
        a :class:`MetricCollection` makes the pass its metrics need together."""
        return self.token_statistics

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        register_call_keywords(cls.call_keywords)
        if "accumulate_call" in cls.__dict__:
            cls.accumulate_call = checked_call(cls.__dict__["accumulate_call"])
        if "accumulate" in cls.__dict__:
            cls.accumulate = checked_accumulate(cls.__dict__["accumulate"])

    def __init__(self, device_mesh: Any = None, process_group: Any = None, *, cp_gathered: Optional[bool] = None,
                 group_names: Optional[Any] = None, group_key: str = "dataset_id",
                 position_buckets: Optional[Any] = None, seq_length: Optional[int] = None, **kwargs: Any) -> None:
        check_constructor_keywords(self, kwargs, Metric)
        # ``...``: the placeholder Twinkle's documentation writes (``Metric(device_mesh=...)``).
        device_mesh = device_mesh if given(device_mesh) else None
        process_group = process_group if given(process_group) else None
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
        self._pending_updates = PendingUpdates()  # updates held back, folded into the states when they are read
        self.group_names = check_group_names(group_names)
        self.group_key = group_key
        self.position_buckets = check_position_buckets(position_buckets, seq_length)
        if self.position_buckets is not None and not self.reports_positions:
            raise ValueError(f"{type(self).__name__} has no per-token statistics by position; position_buckets "
                             "is an option of the token-level metrics (Accuracy, TokenStatsMetric, LossMetric, "
                             "GRPOMetric and its variants)")
        if self.group_names:
            self.add_state(INVALID_GROUP_IDS, "sum")

    # ---------------------------------------------------------------- states

    def add_state(self, name: str, reduce: str = "sum", shape: tuple[int, ...] = (), grouped: bool = False) -> None:
        """Declare a state; it starts at the identity of its reduction (0, -inf or +inf).

        ``grouped``: also keep it per slice of each partition (see :mod:`.groups`):
        a ``[G, *shape]`` twin ``name/groups`` when the metric has ``group_names``,
        a ``[B, *shape]`` twin ``name/positions`` when it has ``position_buckets``;
        :meth:`_add_token_sums` and :meth:`_maximum_token_values` fill them all.
        """
        if reduce not in _IDENTITY:
            raise ValueError(f"state {name!r}: reduce must be one of {sorted(_IDENTITY)}, got {reduce!r}")
        self._specs[name] = StateSpec(reduce, tuple(shape))
        self._states[name] = torch.full(tuple(shape), _IDENTITY[reduce], dtype=torch.float64,
                                        device=self._state_device())
        if grouped:
            for suffix, labels in self.partitions():
                self.add_state(name + suffix, reduce, (len(labels), *shape))

    def partitions(self) -> list[tuple[str, tuple[str, ...]]]:
        """(twin suffix, slice names) of each partition the metric reports: groups, position buckets."""
        parts = [(GROUPED_SUFFIX, self.group_names)] if self.group_names else []
        if self.position_buckets is not None:
            parts.append(self.position_buckets.partition)
        return parts

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

    def _add(self, name: str, value: Union[torch.Tensor, Number, list]) -> None:
        """``state += value``. Python numbers (a number, or a list of one per element of the state) are added on
        the host until the states are read (see :mod:`.pending`): no launch per call."""
        if self._pending_updates.pend_host("add", name, value, self._states):
            return
        self._pending_updates.settle(self._states, (name,), "add")
        state = self._states[name]  # updated in place: one op (launch) per update, no float64 copy first
        if not isinstance(value, torch.Tensor):  # a NumPy scalar and the like
            value = self._as_state(name, value)
        if value.device == state.device and value.shape == state.shape:
            state.add_(value.detach())
        else:
            self._states[name] = state + self._as_state(name, value)

    def _maximum(self, name: str, value: Union[torch.Tensor, Number, list]) -> None:
        if self._pending_updates.pend_host("max", name, value, self._states):
            return
        self._pending_updates.settle(self._states, (name,), "max")
        self._states[name] = torch.maximum(self._states[name], self._as_state(name, value))

    def _minimum(self, name: str, value: Union[torch.Tensor, Number]) -> None:
        self._pending_updates.settle(self._states, (name,), "min")
        self._states[name] = torch.minimum(self._states[name], self._as_state(name, value))

    def _assign(self, name: str, value: Union[torch.Tensor, Number, list]) -> None:
        if self._pending_updates.pend_host("replace", name, value, self._states):
            return
        self._pending_updates.settle(self._states, (name,), "replace")
        value = self._as_state(name, value)
        self._states[name] = value.expand(self._specs[name].shape).clone()

    def _add_token_sums(self, sums: Mapping[str, torch.Tensor], counted: Optional[torch.Tensor] = None,
                        groups: Optional[TokenSlices] = None, totals: Optional[Mapping[str, torch.Tensor]] = None
                        ) -> None:
        """Add Σ over the tokens of each per-token tensor of ``sums`` (one shape) to its state, per slice to its
        twins, and each tensor of ``totals`` (shaped like its state) to its state; tokens not ``counted`` add 0,
        whatever their value. A fixed number of ops for any number of sums (see :mod:`.token_sums`)."""
        self._apply_totals({**sum_totals(self._specs, sums, counted, groups), **(totals or {})})

    def _add_to_groups(self, sums: Mapping[str, torch.Tensor], counted: Optional[torch.Tensor],
                       groups: Optional[TokenSlices]) -> None:
        """:meth:`_add_token_sums` for the twins only (the states themselves have their totals from elsewhere)."""
        self._apply_totals(sum_totals(self._specs, sums, counted, groups, slices_only=True))

    def _maximum_token_values(self, maxima: Mapping[str, torch.Tensor], counted: Optional[torch.Tensor] = None,
                              groups: Optional[TokenSlices] = None) -> None:
        """Apply the max over the tokens of each per-token tensor of ``maxima`` (one shape) to its state, and
        per slice to its twins; tokens not ``counted`` count as -inf. A fixed number of ops, as for sums."""
        self._apply_totals({}, max_totals(self._specs, maxima, counted, groups))

    def _apply_totals(self, sums: Mapping[str, torch.Tensor], maxima: Optional[Mapping[str, torch.Tensor]] = None
                      ) -> None:
        """Apply the totals now: add each tensor of ``sums`` to its state, take the max of each of ``maxima`` and its
        state (each shaped like its state): one op for all sums, one for all maxima (see
        :func:`.token_sums.apply_to_states`)."""
        self._pending_updates.settle(self._states, sums, "add")
        self._pending_updates.settle(self._states, maxima or (), "max")
        self._states = apply_to_states(apply_to_states(self._states, sums, add_in_place), maxima or {},
                                       maximum_in_place)

    def _token_groups(self, ids: Any, like: torch.Tensor, selected: torch.Tensor,
                      positions: Optional[torch.Tensor] = None) -> Optional[TokenSlices]:
        """The partitions of a microbatch's tokens (see :mod:`.groups`): their groups from ``ids``, their
        position buckets from ``positions`` (shaped like ``like``). ``selected`` tokens (before the metric's
        checks leave values out: the same tokens in every metric fed the same inputs) with an id outside
        ``[0, G)`` are added to ``invalid_group_ids``. None when no partition applies."""
        parts = []
        if self.group_names and ids is not None:
            groups = token_groups(ids, like, len(self.group_names))
            self._add(INVALID_GROUP_IDS, (selected * ~groups.in_range).sum())  # a mask, or a microbatch's count
            parts.append(groups)
        if self.position_buckets is not None and positions is not None:
            parts.append(self.position_buckets.of(positions.to(like.device), like.shape))
        return TokenSlices(parts) if parts else None

    def group_ids_of(self, batch: Any, output: Any) -> Any:
        """A microbatch's group ids: the ``group_ids`` keyword's entry, else ``inputs[group_key]``."""
        if not self.group_names:
            return None
        ids = output.get("group_ids") if hasattr(output, "get") else None
        return ids if ids is not None else (batch.get(self.group_key) if hasattr(batch, "get") else None)

    def _assign_finite(self, name: str, value: Union[torch.Tensor, Number], nonfinite_count: str) -> None:
        """Assign ``value`` if it is finite; else keep the state and add 1 to ``nonfinite_count``.

        For "latest value" states such as ``grad_norm``: a NaN on one rank would
        otherwise win or lose the MAX depending on which rank holds it.
        """
        if is_host_number(value):  # checked on the host: no launch
            if math.isfinite(value):
                self._assign(name, value)
            else:
                self._add(nonfinite_count, 1.0)
            return
        self._pending_updates.settle(self._states, (name,), None)  # read below
        value = self._as_state(name, value).reshape(self._specs[name].shape)
        finite = all_finite([value])
        self._states[name] = torch.where(finite, value, self._states[name])
        self._add(nonfinite_count, (~finite).sum())

    def _add_finite(self, values: Mapping[str, Union[torch.Tensor, Number]], nonfinite_count: str) -> None:
        """Add each of ``values`` (one value per state, a number or a one-element tensor: a microbatch's loss and
        its token count) to its state if every one of them is finite; else add nothing and 1 to
        ``nonfinite_count``.

        Python numbers are checked on the host. Otherwise the values are copied (float64: one op per tensor; the
        caller may change its tensors in place later) and held back until the states are read, then checked and
        added with every other pending row in a fixed number of ops (see :mod:`.pending`), where checking and
        adding each at once costs about ten.
        """
        if all_host_numbers(values.values()):  # checked on the host: no launch
            if all(map(math.isfinite, values.values())):
                for name, value in values.items():
                    self._add(name, value)
            else:
                self._add(nonfinite_count, 1.0)
            return
        row = {}
        for name, value in values.items():
            if not isinstance(value, torch.Tensor):
                row[name] = float(value)
            elif value.numel() == 1:
                row[name] = value.detach().to(torch.float64, copy=True).reshape(())
            else:
                raise ValueError(f"{type(self).__name__}: {name!r} takes one value here, got shape "
                                 f"{tuple(value.shape)}")
        self._pending_updates.pend_finite(row, nonfinite_count, self._states)

    def _fold_pending(self, names: Optional[Iterable[str]] = None) -> None:
        """Fold what is held back for ``names`` (default: every state) into the states (see :mod:`.pending`)."""
        self._pending_updates.fold(self._states, names)

    # ---------------------------------------------------------- the Twinkle API

    @property
    def context(self) -> ParallelContext:
        """The parallel layout: resolved at construction, or on first use when a metric is
        built before ``torch.distributed`` is initialised."""
        if self._context is None:
            self._context = ParallelContext.resolve(self.device_mesh, self.process_group)
        return self._context

    def accumulate(self, inputs: Any, outputs: Any = None, **kwargs: Any) -> None:
        """Twinkle's form: one call's microbatches (see the subclass). A metric that shares per-call values with
        others implements :meth:`accumulate_call`; used alone, it reads a call of its own."""
        self.accumulate_call(SharedCall(inputs, outputs, kwargs, frozenset(self.token_statistics_for(outputs))))

    def accumulate_call(self, call: SharedCall) -> None:
        """Add one call (``call.inputs``, ``call.outputs``, ``call.kwargs``), reading what the metrics of the call
        share through ``call`` (its views per spec, each microbatch's token statistics and classes)."""
        raise NotImplementedError(f"{type(self).__name__} implements neither accumulate nor accumulate_call")

    @classmethod
    def reads_shared_call(cls) -> bool:
        """Whether a collection hands this metric its :class:`.SharedCall` (``accumulate_call``): the metric
        implements it, and no subclass overrides Twinkle's ``accumulate`` (whose code must then run)."""
        return cls.accumulate is Metric.accumulate and cls.accumulate_call is not Metric.accumulate_call

    def compute(self, states: SyncedStates) -> dict[str, Number]:
        """Results from the globally reduced states (scalars as floats, others as CPU tensors; gathered
        records in ``states.records``)."""
        raise NotImplementedError

    def results(self, states: SyncedStates) -> dict[str, Number]:
        """:meth:`compute` of the global states, then of each slice's of each partition (``key/<group name>``,
        ``key/pos_<first>-<last>``; slices with data).

        A slice's view holds each twin state's row for the slice, and the
        identity of every other state, so ``compute`` reports just the slice's
        statistics (nothing where the slice saw no data).
        """
        check_outputs_read(self)
        results = self.compute(states)
        for suffix, labels in self.partitions():
            for index, label in enumerate(labels):
                for key, value in self.compute(SyncedStates(slice_states(self._specs, states, suffix, index))).items():
                    results[f"{key}/{label}"] = value
        if self.group_names and states[INVALID_GROUP_IDS] > 0:
            results[INVALID_GROUP_IDS] = int(states[INVALID_GROUP_IDS])
        return results

    @syncs_declared_states
    def calculate(self) -> dict[str, Number]:
        """Reduce the states over all ranks, compute the results and reset (Twinkle's semantics).

        Collective: every rank calls it and every rank gets the same dict.
        Returns ``{}`` when no rank saw any data.
        """
        return calculate_metrics([self])

    def reset(self) -> None:
        """Back to the identity of every state."""
        self._pending_updates.clear()
        device = self._state_device()
        self._states = {
            name: torch.full(spec.shape, spec.identity, dtype=torch.float64, device=device)
            for name, spec in self._specs.items()
        }

    # --------------------------------------------------------- the sync protocol (see .sync)

    every_rank_counts: ClassVar[bool] = False
    """True for values every rank holds alike or measures itself (timings): then no rank contributes identities."""

    @property
    def state_specs(self) -> Mapping[str, StateSpec]:
        """The declared states: name -> shape and reduction."""
        return self._specs

    def before_sync(self) -> None:
        """Write host-side values that join the sync (timers) into their states; called by every sync."""

    def counts_here(self) -> bool:
        """Whether this rank's states count in the global reduction (see :meth:`ParallelContext.counts_here`)."""
        return self.every_rank_counts or self.context.counts_here(bool(self.cp_gathered))

    def nonfinite_loss_count(self) -> Optional[torch.Tensor]:
        """The non-finite losses this rank counted since the last reset (the ``nonfinite_loss_state``; a device
        tensor, nothing read on the host), or None for a metric that takes no loss. The tracker compares it step by
        step to count the steps with a non-finite loss."""
        if self.nonfinite_loss_state is None:
            return None
        return self.sync_states()[self.nonfinite_loss_state].detach().clone()

    def sync_states(self) -> dict[str, torch.Tensor]:
        """The states this rank contributes: its own, or identities if its data does not count."""
        self._fold_pending()
        if self.counts_here():
            return self._states
        return {name: torch.full(spec.shape, spec.identity, dtype=torch.float64)
                for name, spec in self._specs.items()}

    def sync_records(self) -> Optional[list]:
        """Picklable records to gather from every rank, or None (the default: numbers only).

        A metric that returns a list here costs the sync one extra collective;
        the records of all ranks whose data counts are in ``states.records``
        when :meth:`compute` runs.
        """
        return None

    def extra_state(self, states: SyncedStates) -> dict[str, Any]:
        """Host-side entries of :meth:`state_dict`, from the synced states (the same on every rank)."""
        return {}

    # -------------------------------------------------------------- resuming

    def state_dict(self) -> dict[str, Any]:
        """The metric's global, layout-free state (collective: every rank calls it, like ``calculate()``).

        The states are reduced over all ranks (the same two collectives as
        ``calculate()``), so a checkpoint taken under one TP×PP×CP×DP layout
        resumes correctly under any other. Every rank returns the same dict.
        """
        return reduced_state_dicts([self])[0]

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict` of a run under any layout (sums to one rank, maxima and minima
        to every rank; see :mod:`.resume`)."""
        self._pending_updates.clear()
        self._states = loaded_states(self, state_dict, self._state_device())

    # ------------------------------------------------------- Twinkle helpers

    def gather_results(self, local_results: list) -> list:
        """Twinkle's helper for user-written metrics: all-gather picklable results. Collective: returns, on
        every rank, the concatenation of the lists of every rank whose data counts (the last pipeline stage,
        TP rank 0, see :meth:`ParallelContext.counts_here`) in rank order, each once; one ``all_gather_object``
        over the reduction group."""
        return gather_results(self, local_results)
