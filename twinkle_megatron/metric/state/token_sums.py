"""Many per-token statistics of one microbatch applied to their states together: a fixed number of ops.

A metric adds several per-token sums per microbatch (GRPO: tokens, log-prob sums, KL terms, clip counts…),
each also per slice of each partition (groups, position buckets; see :mod:`.groups`). One op per sum is one
kernel launch on an accelerator and several microseconds of Python and dispatch on a CPU, so the K values
are handled together instead:

* stacked once, ``[K, *tokens]`` (:func:`stack_per_token`), masked once with ``torch.where`` (not a product:
  a NaN or Inf outside the counted tokens never leaks into a sum);
* reduced once over the token dimensions (``[K]``), and once per partition (``[K, G]``, one ``index_add``
  or ``scatter_reduce`` for all K: :func:`slice_totals`);
* applied to all their states by one op (:func:`add_in_place`, :func:`maximum_in_place`:
  ``torch._foreach_add_`` / ``torch._foreach_maximum_``, the multi-tensor ops ``torch.optim`` uses; one
  launch on an accelerator when the states and values share a dtype and device).

No value is read on the host: shapes only.
"""

from __future__ import annotations

from typing import Callable, Container, Mapping, Optional, Sequence

import torch

from .groups import TokenSlices


def stack_per_token(values: Sequence[torch.Tensor], counted: Optional[torch.Tensor], fill: float) -> torch.Tensor:
    """``[K, *tokens]``: the K per-token tensors (one shape; dtypes promoted by the stack itself, so bool counts
    among float values become those floats) with ``fill`` where ``counted`` (bool, shaped like the tokens) is
    False; ``counted`` None: as given."""
    stacked = values[0].unsqueeze(0) if len(values) == 1 else torch.stack(list(values))
    return stacked if counted is None else torch.where(counted, stacked, fill)


def token_totals(stacked: torch.Tensor, reduce: str) -> torch.Tensor:
    """``[K]`` float64: each row of a ``[K, *tokens]`` stack reduced over its tokens (``'sum'`` or ``'max'``); a
    ``[K]`` stack (K numbers: one value per microbatch) is its own total."""
    if stacked.dim() == 1:
        return stacked.to(torch.float64)
    dims = tuple(range(1, stacked.dim()))  # never empty: an empty dim list would reduce every dimension
    return stacked.sum(dims, dtype=torch.float64) if reduce == "sum" else stacked.amax(dims).to(torch.float64)


def slice_totals(stacked: torch.Tensor, names: Sequence[str], slices: Optional[TokenSlices],
                 declared: Container[str], reduce: str) -> dict[str, torch.Tensor]:
    """Twin state name -> its ``[G]`` totals, for each partition of ``slices`` and each of the K ``names``
    (row k of ``stacked``) that has a twin in ``declared``; ``reduce``: ``'sum'`` or ``'max'`` per slice."""
    totals: dict[str, torch.Tensor] = {}
    for part in slices or ():
        twins = [(row, name + part.suffix) for row, name in enumerate(names) if name + part.suffix in declared]
        if not twins:
            continue
        per_slice = part.sum(stacked) if reduce == "sum" else part.max(stacked)  # [K, G]: all K at once
        rows = per_slice.unbind(0)
        totals.update((twin, rows[row]) for row, twin in twins)
    return totals


def add_in_place(states: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
    """``states[i] += values[i]`` for every i, in one op (each value shaped like its state)."""
    torch._foreach_add_(list(states), list(values))


def maximum_in_place(states: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
    """``states[i] = max(states[i], values[i])`` for every i, in one op (NaN propagates, as ``torch.maximum``)."""
    torch._foreach_maximum_(list(states), list(values))


def sum_totals(declared: Container[str], sums: Mapping[str, torch.Tensor], counted: Optional[torch.Tensor],
               slices: Optional[TokenSlices], slices_only: bool = False) -> dict[str, torch.Tensor]:
    """State name -> what to add to it: Σ over the tokens of each per-token tensor of ``sums`` (one shape) for
    the state of its name, per slice for its twins (those ``declared``); tokens not ``counted`` add 0, whatever
    their value. ``slices_only``: the twins alone. A fixed number of ops for any number of sums."""
    names = list(sums)
    stacked = stack_per_token(list(sums.values()), counted, 0.0)
    totals = {} if slices_only else dict(totals_of(names, token_totals(stacked, "sum")))
    totals.update(slice_totals(stacked, names, slices, declared, "sum"))
    return totals


def max_totals(declared: Container[str], maxima: Mapping[str, torch.Tensor], counted: Optional[torch.Tensor],
               slices: Optional[TokenSlices]) -> dict[str, torch.Tensor]:
    """State name -> what to apply to its max: the max over the tokens of each per-token tensor of ``maxima``
    (one shape; none for no tokens) and per slice for its twins; tokens not ``counted`` count as -inf."""
    names = list(maxima)
    stacked = stack_per_token(list(maxima.values()), counted, float("-inf"))
    totals = dict(totals_of(names, token_totals(stacked, "max"))) if stacked[0].numel() else {}
    totals.update(slice_totals(stacked, names, slices, declared, "max"))
    return totals


def totals_of(names: Sequence[str], totals: torch.Tensor) -> Mapping[str, torch.Tensor]:
    """Name -> its 0-d total, from the ``[K]`` totals of K stacked statistics (views: no op)."""
    return dict(zip(names, totals.unbind(0)))


def apply_to_states(states: dict[str, torch.Tensor], values: Mapping[str, torch.Tensor],
                    update: Callable[[list, list], None]) -> dict[str, torch.Tensor]:
    """Apply each value to the state of its name (shaped alike) in place, all in one op ``update``
    (:func:`add_in_place`, :func:`maximum_in_place`); returns the states. States on the CPU follow values
    on another device (all of them move, as the states follow the first device data comes from); values
    on another device than states already there are copied to them."""
    if not values:
        return states
    device = next(iter(states.values())).device
    first = next(iter(values.values())).device
    if first != device and device.type == "cpu":
        states, device = {name: state.to(first) for name, state in states.items()}, first
    update([states[name] for name in values],
         [value if value.device == device else value.to(device, non_blocking=True) for value in values.values()])
    return states
