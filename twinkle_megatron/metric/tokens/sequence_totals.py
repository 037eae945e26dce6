"""Sequence-level values under context parallelism: partial sums completed over the CP group, counted once.

With CP each rank holds two chunks of every sequence, so a per-sequence value that is not a plain sum
(GSPO's geometric-mean ratio, DPO's pair margin) needs the sequence's partial sums from every CP rank
before the nonlinearity: :func:`sum_over_context_parallel` adds them (one all-reduce per microbatch, no
host sync), and :func:`counts_sequences_here` then counts each sequence on one CP rank only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...parallel import ParallelContext


def sum_over_context_parallel(tensor: torch.Tensor, context: ParallelContext, cp_gathered: bool) -> torch.Tensor:
    """``tensor`` summed over the CP group when each CP rank holds chunks of the sequences.

    One all-reduce (no host sync) when ``cp_size > 1`` and the data is not
    ``cp_gathered``; otherwise ``tensor`` itself. Every CP rank of the group must
    call it for the same microbatch, as every CP rank runs the same microbatches.
    """
    if context.cp_size == 1 or cp_gathered or not context.distributed:
        return tensor
    tensor = tensor.contiguous().clone()
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=context.cp_group)
    return tensor


def counts_sequences_here(context: ParallelContext, cp_gathered: bool) -> bool:
    """Whether this CP rank counts the sequence-level values completed by :func:`sum_over_context_parallel`, so
    that each sequence counts once: after the sum every CP rank holds them, so CP rank 0 alone counts them;
    ``cp_gathered`` data reaches the metric's states on CP rank 0 only already (:meth:`CPAlignment.counts_here`)."""
    return cp_gathered or context.cp_rank == 0
