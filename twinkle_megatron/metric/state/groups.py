"""Per-group statistics (per dataset of a blend, per domain): one ``[G]`` sum per statistic, in the same sync.

A metric built with ``group_names=["web", "code", ...]`` (G groups, known at
construction) reads an integer group id per sample (``[b]``) or per token
(``[b, s]``, or one number for the whole microbatch) with each microbatch: the
``accumulate`` keyword ``group_ids`` (one tensor for the call's samples, or a
list with one per microbatch) or ``inputs[group_key]`` (default
``"dataset_id"``, the key megatron-core's ``BlendedDataset`` gives each
sample). Each grouped statistic then has a twin state ``name/groups`` of shape
``[G]`` (an ``index_add`` per microbatch, no host sync) in the collection's one
sync: no extra collective. The metric's own ``compute`` turns each group's
slice into results, reported as ``key/<group name>`` for every group that saw
data. Ids outside ``[0, G)`` leave their tokens out of every group (the global
statistics keep them) and are counted in ``invalid_group_ids``.

The mechanism is general: a *partition* of the tokens into named slices, each
slice a row of the twin state. Groups are one partition (twin ``name/groups``);
position buckets (:mod:`.positions`) are another (twin ``name/positions``,
slices ``pos_<first>-<last>``), filled by the same ``index_add`` from the
bucket of each token's position. A metric may have both: each statistic is
then reported per group and per bucket (``loss/web``, ``loss/pos_0-511``).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence

import torch

from ..inputs.tensors import to_device

GROUPED_SUFFIX = "/groups"
POSITIONS_SUFFIX = "/positions"
TWIN_SUFFIXES = (GROUPED_SUFFIX, POSITIONS_SUFFIX)
INVALID_GROUP_IDS = "invalid_group_ids"


class TokenGroups(NamedTuple):
    """The slice of each token of a microbatch in one partition (its group, its position bucket), shaped
    like its tokens; ``suffix`` names the partition's twin states."""

    ids: torch.Tensor  # int64, clamped into [0, G)
    in_range: torch.Tensor  # bool: the id was inside [0, G)
    num_groups: int
    suffix: str = GROUPED_SUFFIX

    def of_sequences(self) -> TokenGroups:
        """The group of each sequence (row) of ``[b, s]`` tokens: its first token's (a sequence has one)."""
        if self.ids.dim() != 2:
            return self
        return TokenGroups(self.ids[:, 0], self.in_range[:, 0], self.num_groups, self.suffix)

    def select(self, rows: Callable[[torch.Tensor], torch.Tensor]) -> TokenGroups:
        """The groups of some entries: ``rows`` applied to the ids and to ``in_range`` (e.g. chosen rows)."""
        return TokenGroups(rows(self.ids), rows(self.in_range), self.num_groups, self.suffix)

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """``[G]`` float64: Σ values per group (``values`` shaped like the tokens, 0 where not counted); for
        ``[K, *tokens]`` values (K statistics stacked) ``[K, G]``, in the same three ops."""
        ids, in_range, values = self.ids, self.in_range, values.to(torch.float64)
        stacked = values.shape[:values.dim() - ids.dim()]  # () or (K,)
        if ids.dim() == 2 and ids.stride(0) == 0 and in_range.stride(0) == 0:
            # One row of slices for every row (position buckets of padded rows): add up the rows first.
            ids, in_range, values = ids[0], in_range[0], values.sum(-2)
        values = torch.where(in_range, values, 0.0).reshape(*stacked, -1)
        totals = torch.zeros((*stacked, self.num_groups), dtype=torch.float64, device=values.device)
        return totals.index_add_(len(stacked), ids.reshape(-1), values)

    def max(self, values: torch.Tensor) -> torch.Tensor:
        """``[G]`` float64: max of values per group (``values`` -inf where not counted; -inf for empty groups);
        for ``[K, *tokens]`` values ``[K, G]``."""
        stacked = values.shape[:values.dim() - self.ids.dim()]
        values = torch.where(self.in_range, values.to(torch.float64), float("-inf")).reshape(*stacked, -1)
        maxima = torch.full((*stacked, self.num_groups), float("-inf"), dtype=torch.float64, device=values.device)
        ids = self.ids.reshape(-1).expand(values.shape)
        return maxima.scatter_reduce_(len(stacked), ids, values, reduce="amax")


class TokenSlices(tuple):
    """A microbatch's partitions of its tokens (:class:`TokenGroups` each: groups, position buckets)."""

    def of_sequences(self) -> TokenSlices:
        """The partitions a whole sequence belongs to: its group (a sequence has no one position)."""
        return TokenSlices(part.of_sequences() for part in self if part.suffix != POSITIONS_SUFFIX)

    def select(self, rows: Callable[[torch.Tensor], torch.Tensor]) -> TokenSlices:
        """Each partition's slices of some entries (see :meth:`TokenGroups.select`)."""
        return TokenSlices(part.select(rows) for part in self)


def token_groups(ids: Any, like: torch.Tensor, num_groups: int) -> Optional[TokenGroups]:
    """The groups of ``like``'s tokens (``[b, s]``, or ``[b]`` for one value per sequence) from ``ids``.

    ``ids``: one number for the microbatch, one per sample (``[b]``) or one per
    token (shaped like ``like``). ``ValueError`` for any other shape (shapes
    only: no host sync). None when ``ids`` is None.
    """
    if ids is None:
        return None
    ids = ids if isinstance(ids, torch.Tensor) else torch.as_tensor(ids)
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"group ids must be integers, got {ids.dtype}")
    ids = to_device(ids, like.device).to(torch.int64)
    if ids.dim() == 0:
        ids = ids.expand(like.shape)
    elif tuple(ids.shape) != tuple(like.shape):
        if like.dim() >= 1 and ids.dim() == 1 and ids.shape[0] == like.shape[0]:
            ids = ids.reshape(-1, *([1] * (like.dim() - 1))).expand(like.shape)
        else:
            raise ValueError(f"group ids have shape {tuple(ids.shape)} but the microbatch holds tokens of shape "
                             f"{tuple(like.shape)}: give one id per sample, one per token, or one number")
    in_range = (ids >= 0) & (ids < num_groups)
    return TokenGroups(ids.clamp(0, num_groups - 1), in_range, num_groups)


def check_group_names(group_names: Optional[Sequence[str]]) -> tuple[str, ...]:
    """``group_names`` as a tuple of distinct, non-empty names without ``/`` (they end keys)."""
    names = tuple(group_names or ())
    for name in names:
        if not isinstance(name, str) or not name or "/" in name:
            raise ValueError(f"group names must be non-empty strings without '/', got {name!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"group names must be distinct, got {list(names)}")
    return names


def slice_states(specs: Mapping[str, Any], states: Mapping[str, Any], suffix: str, index: int) -> dict[str, Any]:
    """The states of one slice of a partition: row ``index`` of each ``suffix`` twin, the identity of every
    other state (``specs``: name -> declared state with ``shape`` and ``identity``)."""
    view: dict[str, Any] = {}
    for name, spec in specs.items():
        if name.endswith(TWIN_SUFFIXES):
            continue
        twin = states.get(name + suffix)
        if twin is not None:
            view[name] = float(twin[index]) if spec.shape == () else twin[index]
        else:
            view[name] = spec.identity if spec.shape == () else torch.full(spec.shape, spec.identity,
                                                                             dtype=torch.float64)
    return view
