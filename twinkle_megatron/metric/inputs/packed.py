"""Packed sequences (Megatron's THD format): which sub-sequence each token is in, and where.

With packing, a microbatch row (``[1, t]`` labels, ``[t, 1, V]`` logits) holds
several sequences one after the other, described by megatron-core's
``PackedSeqParams``: ``cu_seqlens_q`` (``[n + 1]`` cumulative real lengths) and
``cu_seqlens_q_padded`` (the cumulative lengths each sequence occupies, padding
included; the same as ``cu_seqlens_q`` without padding). A metric reads them
from ``inputs['packed_seq_params']`` (the object) or ``inputs['cu_seqlens']``
(and ``inputs['cu_seqlens_padded']``).

Under context parallelism megatron-core splits *each* sequence, not the row:
every sequence's padded length is a multiple of ``2·cp``, its ``2·cp`` chunks
are dealt like a whole sequence's (CP rank ``i`` gets chunks ``i`` and
``2·cp−1−i``), and a rank's row is the concatenation of its pieces of every
sequence (Transformer Engine's ``thd_get_partitioned_indices``, called by
megatron-core's ``get_thd_batch_on_this_cp_rank``). So the rank's piece of
sequence ``j`` has ``L_j / cp`` tokens, and :func:`packed_sequences` maps each
local token back to its sequence, its position in it, and whether it is real
(padding is not). Everything is device arithmetic on ``cu_seqlens`` (a
``repeat_interleave`` of known output size): no host sync; the number of sequences is a shape.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence

import torch

from ...parallel import ParallelContext
from .tensors import to_device


class PackedSequences(NamedTuple):
    """Per local token of a packed row (``[t]``): its sequence, its position in it, whether it is real."""

    index: torch.Tensor  # int64 [t]: the sub-sequence (0 … count−1) the token belongs to
    positions: torch.Tensor  # int64 [t]: position in its whole sub-sequence (CP chunks mapped back)
    real: torch.Tensor  # bool [t]: a real token, not padding between (or after) the sequences
    count: int  # the number of sub-sequences

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """``[count]`` float64: Σ of ``values`` (per token, ``[t]`` or ``[1, t]``) over each sub-sequence."""
        totals = torch.zeros(self.count, dtype=torch.float64, device=values.device)
        return totals.index_add_(0, self.index.to(values.device), values.reshape(-1).to(torch.float64))


def packed_cu_seqlens(batch: Any) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """``(cu_seqlens, cu_seqlens_padded)`` of a packed microbatch, or None when it is not packed."""
    if hasattr(batch, "parts"):  # a concatenation of microbatches
        if any(_cu_seqlens_of(part) is not None for part in batch.parts):
            raise ValueError("packed microbatches (cu_seqlens) cannot be concatenated: pass the outputs as a list "
                             "with one entry per microbatch")
        return None
    return _cu_seqlens_of(batch)


def _cu_seqlens_of(batch: Any) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    if not hasattr(batch, "get"):
        return None
    params = batch.get("packed_seq_params")
    if params is not None:
        real = getattr(params, "cu_seqlens_q", None)
        padded = getattr(params, "cu_seqlens_q_padded", None)
    else:
        real, padded = batch.get("cu_seqlens"), batch.get("cu_seqlens_padded")
    if real is None:
        return None
    real = torch.as_tensor(real)
    padded = real if padded is None else torch.as_tensor(padded)
    if real.dim() != 1 or real.shape != padded.shape or real.numel() < 2:
        raise ValueError(f"cu_seqlens {tuple(real.shape)} and cu_seqlens_padded {tuple(padded.shape)} must be "
                         "1-D, of the same length n + 1 for n packed sequences (n >= 1)")
    return real, padded


def packed_sequences(cu_seqlens: tuple[torch.Tensor, torch.Tensor], local_length: int, context: ParallelContext,
                     cp_gathered: bool, device: torch.device) -> PackedSequences:
    """Each of ``local_length`` local tokens of a packed row: sequence, position, realness (see the module).

    ``cp_gathered``: the row holds whole sequences (no CP split, or data gathered
    over CP); else this CP rank's pieces of them.
    """
    real_cu, padded_cu = (to_device(c, device).to(torch.int64) for c in cu_seqlens)
    cp, rank = (1, 0) if cp_gathered else (context.cp_size, context.cp_rank)
    padded_lengths = padded_cu[1:] - padded_cu[:-1]
    real_lengths = real_cu[1:] - real_cu[:-1]
    local_lengths = padded_lengths // cp
    local_ends = torch.cumsum(local_lengths, 0)
    local_starts = local_ends - local_lengths
    token = torch.arange(local_length, device=device)
    count = padded_lengths.shape[0]
    # Each token's sequence: sequence j repeated over its L_j / cp tokens, the tokens after the last sequence
    # given to it too (not real); output_size is a shape, so no host sync.
    tail = (local_length - local_ends[-1:]).clamp(min=0)
    sequences = torch.arange(count + 1, device=device).clamp(max=count - 1)  # the tail: the last sequence's
    index = torch.repeat_interleave(sequences, torch.cat([local_lengths, tail]), output_size=local_length)
    offset = token - local_starts[index]
    if cp > 1:
        half = local_lengths[index] // 2
        positions = torch.where(offset < half, rank * half + offset, (2 * cp - 1 - rank) * half + offset - half)
    else:
        positions = offset
    real = (token < local_ends[-1]) & (positions < real_lengths[index])
    return PackedSequences(index, positions, real, count)


def packed_microbatches(batches: Sequence[Any], lengths: Sequence[int], context: ParallelContext,
                        cp_gathered: Sequence[bool], devices: Sequence[torch.device]
                        ) -> list[Optional[PackedSequences]]:
    """Stage 4 of the input pipeline (:mod:`.view`): the sub-sequences of each packed microbatch of a
    call (None for an unpacked one), from its ``cu_seqlens`` and its local row length after the CP alignment."""
    packed = []
    for batch, length, gathered, device in zip(batches, lengths, cp_gathered, devices):
        cu_seqlens = packed_cu_seqlens(batch)
        packed.append(None if cu_seqlens is None else packed_sequences(cu_seqlens, length, context, gathered, device))
    return packed
