"""Exact structural budgets: count collectives, forbid host syncs."""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Iterator

import torch
import torch.distributed as dist

COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all",
    "all_to_all_single", "broadcast", "broadcast_object_list", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "gather", "gather_object", "scatter", "scatter_object_list", "barrier",
    "send", "recv", "isend", "irecv", "batch_isend_irecv",
)


@contextlib.contextmanager
def count_collectives() -> Iterator[Counter]:
    """Count every ``torch.distributed`` collective and p2p call made inside the block."""
    counts: Counter = Counter()
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def counting(name, function):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return function(*args, **kwargs)
        return wrapper

    for name, function in originals.items():
        setattr(dist, name, counting(name, function))
    try:
        yield counts
    finally:
        for name, function in originals.items():
            setattr(dist, name, function)


class HostSyncError(AssertionError):
    pass


_SYNCING = ("item", "tolist", "__bool__", "__float__", "__int__", "numpy", "cpu")


@contextlib.contextmanager
def forbid_host_sync(allow_cpu: bool = True) -> Iterator[None]:
    """Make the tensor methods that copy a value to the host raise inside the block.

    ``.cpu()`` is only forbidden with ``allow_cpu=False`` (on a CPU test machine
    it is a no-op, but on GPU it would be a sync).
    """
    originals = {name: getattr(torch.Tensor, name) for name in _SYNCING}

    def refuse(name):
        def raising(self, *args, **kwargs):
            raise HostSyncError(f"host sync: Tensor.{name}() called")
        return raising

    for name in _SYNCING:
        if name == "cpu" and allow_cpu:
            continue
        setattr(torch.Tensor, name, refuse(name))
    try:
        yield
    finally:
        for name, function in originals.items():
            setattr(torch.Tensor, name, function)
