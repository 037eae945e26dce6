"""A global batch and the piece of it each rank sees under a Megatron layout.

Data parallelism splits the batch (dim 0) into contiguous blocks; context
parallelism splits each sequence (dim 1) into ``2·cp`` chunks and gives CP rank
``i`` chunks ``i`` and ``2·cp−1−i`` (Megatron-LM's ``get_batch_on_this_cp_rank``);
microbatches split the DP block along dim 0.
"""

from __future__ import annotations

import torch
from megatron_gpt import cp_slice


def dp_cp_shard(tensor: torch.Tensor, dp_rank: int, dp_size: int, cp_rank: int = 0, cp_size: int = 1,
                seq_dim: int = 1) -> torch.Tensor:
    """This rank's part of a ``[B, S, ...]`` global tensor."""
    block = tensor.shape[0] // dp_size
    return cp_slice(tensor[dp_rank * block:(dp_rank + 1) * block], seq_dim, cp_size, cp_rank)


def split_microbatches(tensor: torch.Tensor, num_microbatches: int) -> list[torch.Tensor]:
    return list(tensor.chunk(num_microbatches, dim=0))


def megatron_rank_shard(tensor: torch.Tensor) -> torch.Tensor:
    """``dp_cp_shard`` with this worker's ranks from megatron's parallel_state."""
    from megatron.core import parallel_state as ps

    return dp_cp_shard(tensor, ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(),
                       ps.get_context_parallel_rank(), ps.get_context_parallel_world_size())
