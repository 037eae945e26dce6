"""The guard itself: every kind of host sync it must catch, what it must let through, collectives it counts."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from twinkle_megatron.testing.distributed import run_distributed
from twinkle_megatron.testing.guards import HostSyncError, count_collectives, forbid_host_sync

LABELS = torch.tensor([[1, 2, -100], [3, -100, 4]])
MASK = LABELS != -100

SYNCING = {
    "bincount(labels[mask])": lambda: torch.bincount(LABELS[MASK] % 4, minlength=4),
    "bincount with minlength": lambda: torch.bincount(LABELS.clamp(min=0).reshape(-1), minlength=8),
    "boolean-mask indexing": lambda: LABELS[MASK],
    "boolean-mask assignment": lambda: LABELS.clone().__setitem__(MASK, 0),
    "nonzero": lambda: MASK.nonzero(),
    "torch.where(cond)": lambda: torch.where(MASK),
    "masked_select": lambda: LABELS.masked_select(MASK),
    "unique": lambda: torch.unique(LABELS),
    "repeat_interleave(tensor)": lambda: torch.repeat_interleave(torch.tensor([1, 2])),
    ".item()": lambda: LABELS.sum().item(),
    "bool()": lambda: bool(MASK.any()),
    "float()": lambda: float(LABELS.sum()),
    "if tensor": lambda: 1 if MASK.all() else 0,
    "torch.equal": lambda: torch.equal(LABELS, LABELS),
    ".tolist()": lambda: LABELS.tolist(),
    ".numpy()": lambda: LABELS.numpy(),
    ".cpu()": lambda: LABELS.cpu(),
    ".to('cpu')": lambda: LABELS.to("cpu"),
    "print": lambda: str(LABELS.sum()),
}

SYNC_FREE = {
    "torch.where(cond, a, b)": lambda: torch.where(MASK, LABELS, 0),
    "sum of a mask": lambda: MASK.sum(),
    "index_add_ histogram": lambda: torch.zeros(4).index_add_(0, (LABELS % 4).reshape(-1), MASK.reshape(-1).float()),
    "integer indexing": lambda: LABELS[:, 1],
    "gather": lambda: LABELS.gather(1, torch.zeros(2, 1, dtype=torch.long)),
    "dtype cast": lambda: LABELS.to(torch.float64),
    "to where the data is": lambda: LABELS.to(MASK.device),
    "topk": lambda: LABELS.float().reshape(-1).topk(2),
    "repeat_interleave(int)": lambda: LABELS.repeat_interleave(2, dim=0),
}


@pytest.mark.parametrize("name", SYNCING)
def test_the_guard_catches(name):
    with pytest.raises(HostSyncError), forbid_host_sync():
        SYNCING[name]()


@pytest.mark.parametrize("name", SYNC_FREE)
def test_the_guard_lets_through(name):
    with forbid_host_sync():
        SYNC_FREE[name]()


def _collectives() -> dict:
    tensor = torch.ones(3)
    with count_collectives() as counts:
        dist.all_reduce(tensor)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        gathered = [None, None]
        dist.all_gather_object(gathered, {"rank": dist.get_rank()})
        dist.broadcast(tensor, src=0)
    return dict(counts)


def test_the_guard_counts_collectives_at_the_dispatcher():
    for counts in run_distributed(_collectives, world_size=2):
        # all_gather_object is two gathers on the wire: the sizes, then the bytes.
        assert counts == {"all_reduce": 2, "all_gather": 2, "broadcast": 1}


def _autograd_kernel_of_all_reduce() -> bool:
    """Whether the guard's counting kernel is registered (the dispatch table names where each kernel came from)."""
    return "testing/guards.py" in torch._C._dispatch_dump_table("c10d::allreduce_")


def _nested_counts() -> tuple:
    tensor = torch.ones(3)
    assert not _autograd_kernel_of_all_reduce()
    with count_collectives() as outer:
        dist.all_reduce(tensor)
        with forbid_host_sync() as guard:  # a guarded hook inside a counted loop: both see its collectives
            dist.all_reduce(tensor)
            dist.all_reduce(tensor.requires_grad_())
        dist.broadcast(tensor, src=0)
    removed = not _autograd_kernel_of_all_reduce()
    dist.all_reduce(tensor)  # after the counts closed: counted nowhere
    return dict(outer), dict(guard.collectives), removed


def test_counts_nest_and_end_with_their_block():
    for outer, inner, removed in run_distributed(_nested_counts, world_size=2):
        assert outer == {"all_reduce": 3, "broadcast": 1}
        assert inner == {"all_reduce": 2}
        assert removed, "the counting kernel outlived the last count"
