"""A global batch and the piece of it each rank holds under a Megatron layout.

Data parallelism splits the batch (dim 0) into contiguous blocks; context
parallelism splits each sequence (dim 1) into ``2·cp`` chunks and gives CP rank
``i`` chunks ``i`` and ``2·cp−1−i`` (Megatron-LM's ``get_batch_on_this_cp_rank``);
tensor parallelism gives rank ``r`` the vocabulary columns ``[r·V/tp, (r+1)·V/tp)``
of the logits (Megatron's vocab-parallel output layer); microbatches split the
DP block along dim 0. (Megatron-LM's pretraining sampler interleaves the DP
ranks' microbatches instead; a feed that needs that order builds it itself.)

Public: a feed of :func:`~twinkle_megatron.testing.invariance.assert_layout_invariant`
takes its rank's part of the global batch with these. Plain torch, no megatron-core
(but :meth:`RankView.megatron`, which reads megatron-core's ``parallel_state``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def cp_positions(seq_length: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Global sequence positions held by CP rank ``cp_rank`` (chunks ``r`` and ``2·cp−1−r`` of ``2·cp``)."""
    if cp_size == 1:
        return torch.arange(seq_length)
    if seq_length % (2 * cp_size):
        raise ValueError(f"sequence length {seq_length} is not divisible by 2·cp = {2 * cp_size}")
    chunk = seq_length // (2 * cp_size)
    return torch.cat([torch.arange(i * chunk, (i + 1) * chunk) for i in (cp_rank, 2 * cp_size - 1 - cp_rank)])


def cp_slice(tensor: torch.Tensor, dim: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """This CP rank's part of ``tensor`` along its sequence dimension ``dim`` (Megatron-LM's
    ``get_batch_on_this_cp_rank``)."""
    if cp_size == 1:
        return tensor
    index = cp_positions(tensor.size(dim), cp_size, cp_rank).to(tensor.device)
    return tensor.index_select(dim, index)


def split_microbatches(tensor: torch.Tensor, num_microbatches: int) -> list[torch.Tensor]:
    """``num_microbatches`` contiguous pieces of ``tensor`` along dim 0."""
    return list(tensor.chunk(num_microbatches, dim=0))


@dataclass(frozen=True)
class RankView:
    """Where a rank sits in a TP × PP × CP × DP layout, and the part of a global batch it holds there.

    ``RankView()`` is the single process: it holds the whole batch and is the
    last pipeline stage. ``RankView.megatron()`` reads this worker's place from
    megatron-core's ``parallel_state``.
    """

    tp_rank: int = 0
    tp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    last_stage: bool = True

    @classmethod
    def megatron(cls) -> RankView:
        from megatron.core import parallel_state as ps

        return cls(tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=ps.get_tensor_model_parallel_world_size(),
                   cp_rank=ps.get_context_parallel_rank(), cp_size=ps.get_context_parallel_world_size(),
                   dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_world_size(),
                   last_stage=ps.is_pipeline_last_stage(ignore_virtual=True))

    def rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """This DP rank's contiguous block of rows (dim 0) of a global tensor."""
        block = tensor.shape[0] // self.dp_size
        return tensor[self.dp_rank * block:(self.dp_rank + 1) * block]

    def chunks(self, tensor: torch.Tensor, seq_dim: int = 1) -> torch.Tensor:
        """This CP rank's two chunks of every sequence (dim ``seq_dim``)."""
        return cp_slice(tensor, seq_dim, self.cp_size, self.cp_rank)

    def tokens(self, tensor: torch.Tensor, seq_dim: int = 1) -> torch.Tensor:
        """This rank's part of a ``[B, S, ...]`` global tensor: its DP rows, its CP chunks of each row."""
        return self.chunks(self.rows(tensor), seq_dim)

    def vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """This TP rank's columns of full (padded) logits ``[..., V]``: ``[r·V/tp, (r+1)·V/tp)``."""
        width = logits.shape[-1] // self.tp_size
        return logits[..., self.tp_rank * width:(self.tp_rank + 1) * width]


def thd_positions(cu_seqlens_padded: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Indices into a packed row held by CP rank ``cp_rank``: of every sequence (padded lengths from
    ``cu_seqlens_padded``, each a multiple of ``2·cp``) its chunks ``r`` and ``2·cp−1−r`` of ``2·cp``, sequence
    after sequence (megatron-core's THD split, Transformer Engine's ``thd_get_partitioned_indices``)."""
    starts, ends = cu_seqlens_padded[:-1].tolist(), cu_seqlens_padded[1:].tolist()
    pieces = [start + cp_positions(end - start, cp_size, cp_rank) for start, end in zip(starts, ends)]
    return torch.cat(pieces)
