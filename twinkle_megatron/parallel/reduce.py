"""The one place metric states cross ranks: at most two all-reduces per sync.

All ``sum`` states of all metrics travel in one float64 buffer (all-reduce SUM);
all ``max`` states, and ``min`` states negated, in a second one (all-reduce MAX).
float64 keeps token counts exact up to 2**53 and sums of per-token values
accurate to far below the 1e-5 the layout-invariance contract asks for.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .context import ParallelContext


def all_reduce_sum_and_max(context: ParallelContext, sums: Optional[torch.Tensor],
                           maxes: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """All-reduce ``sums`` with SUM and ``maxes`` with MAX over ``context.reduce_group``.

    Returns CPU tensors (the one host sync of a metric sync). An empty or missing buffer costs no collective, and a
    single process none at all; otherwise one collective per buffer. Every rank
    must call this with buffers of the same sizes (the metric declarations
    guarantee it), so the collectives always line up.
    """
    results = []
    for buffer, op in ((sums, dist.ReduceOp.SUM), (maxes, dist.ReduceOp.MAX)):
        if buffer is None or buffer.numel() == 0:
            results.append(buffer.cpu() if buffer is not None else None)
            continue
        buffer = buffer.to(torch.float64)
        if context.distributed and context.reduce_size > 1:
            dist.all_reduce(buffer, op=op, group=context.reduce_group)
        results.append(buffer.cpu())
    return results[0], results[1]


def all_gather_records(context: ParallelContext, records: list) -> list[list]:
    """All-gather one picklable list per rank over ``context.reduce_group`` (one collective).

    For the few metrics that report records rather than numbers (GRPO's top-K
    tokens) and only when they are enabled: pickling is slow, states are not.
    """
    if not context.distributed or context.reduce_size == 1:
        return [records]
    gathered: list = [None] * context.reduce_size
    dist.all_gather_object(gathered, records, group=context.reduce_group)
    return gathered
