"""Resuming a metric under any layout: which rank holds the loaded sums, and the loaded states.

``Metric.state_dict()`` is the global, layout-free state (the states reduced over
all ranks, see :func:`.sync.reduced_state_dicts`). Loading it back must not count
a sum once per rank: sums go to one rank (:func:`counts_loaded_sums_here`), the
identity (0) to the others; maxima and minima go to every rank (their reduction
is idempotent). So the next ``calculate()`` under any TP×PP×CP×DP layout
continues the interval as if the run had never stopped.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.distributed as dist


def counts_loaded_sums_here(metric: Any) -> bool:
    """Whether this rank counts a loaded checkpoint's sums: its states count (``metric.counts_here()``) and it is
    DP and CP rank 0 (for a metric every rank counts in, rank 0 of the reduction group). Exactly one rank answers
    True; the others hold identities."""
    context = metric.context
    if metric.every_rank_counts:
        return not context.distributed or dist.get_rank(context.reduce_group) == 0
    return context.counts_here(bool(metric.cp_gathered)) and context.dp_rank == 0 and context.cp_rank == 0


def loaded_states(metric: Any, state_dict: Mapping[str, Any], device: torch.device) -> dict[str, torch.Tensor]:
    """The states ``metric`` continues from on this rank: the saved ones (checked against its declared
    ``state_specs``, copied to ``device``), sums replaced by identities except on the rank that holds them."""
    owner = type(metric).__name__
    states = state_dict["states"]
    specs = metric.state_specs
    missing = set(specs) - set(states)
    if missing:
        raise ValueError(f"{owner}.load_state_dict: missing states {sorted(missing)}")
    holder = counts_loaded_sums_here(metric)
    loaded = {}
    for name, spec in specs.items():
        value = torch.as_tensor(states[name], dtype=torch.float64)
        if tuple(value.shape) != spec.shape:
            raise ValueError(f"{owner}.load_state_dict: state {name!r} has shape {tuple(value.shape)}, "
                             f"expected {spec.shape}")
        if spec.reduce == "sum" and not holder:
            value = torch.full(spec.shape, spec.identity, dtype=torch.float64)
        loaded[name] = value.to(device).clone()  # updated in place later: never the caller's tensor
    return loaded
