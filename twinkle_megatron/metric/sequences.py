"""Per-sequence data: Twinkle's ragged per-sequence lists, CP partial sums and global positions.

The one place for what sequence-level metrics (GRPO/GSPO/CISPO, DPO) share:
turning ``old_logps`` / ``advantages`` given per sequence into per-token device
tensors, completing sequence sums over the context-parallel group before a
nonlinearity, and locating CP chunks in the whole sequence.
"""

from __future__ import annotations

import numbers
from typing import Any, Sequence, Union

import torch
import torch.distributed as dist

from ..parallel import ParallelContext
from .inputs import to_device


def sum_over_context_parallel(tensor: torch.Tensor, context: ParallelContext, cp_gathered: bool) -> torch.Tensor:
    """``tensor`` summed over the CP group when each CP rank holds chunks of the sequences.

    One all-reduce (no host sync) when ``cp_size > 1`` and not ``cp_gathered``;
    otherwise ``tensor`` itself. Every CP rank of the group must call it for the
    same microbatch, as every CP rank runs the same microbatches.
    """
    if context.cp_size == 1 or cp_gathered or not context.distributed:
        return tensor
    tensor = tensor.contiguous().clone()
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=context.cp_group)
    return tensor


def global_positions(local_length: int, context: ParallelContext, cp_gathered: bool,
                     device: Union[str, torch.device, None] = None) -> torch.Tensor:
    """Position in the whole sequence of each local position (Megatron's CP chunks ``i`` and ``2·cp−1−i``)."""
    positions = torch.arange(local_length, device=device)
    if context.cp_size == 1 or cp_gathered:
        return positions
    if local_length % 2:
        raise ValueError(f"a context-parallel rank holds two equal chunks of each sequence, but the local "
                         f"sequence length is {local_length} (odd)")
    half, cp_rank = local_length // 2, context.cp_rank
    second = 2 * context.cp_size - 1 - cp_rank
    return torch.where(positions < half, cp_rank * half + positions, second * half + positions - half)


def split_per_microbatch(values: Any, name: str, shapes: Sequence[tuple[int, ...]],
                         whole_sequences: bool = True) -> list[Any]:
    """Per-sequence or per-token ``values`` of a whole ``accumulate`` call, one entry per microbatch.

    ``shapes`` are the microbatches' logps shapes ``(sequences, length)``.
    Raises ``ValueError`` when the number of sequences, or a tensor's shape,
    does not match (shapes only, no host sync), and for per-token arrays
    when the sequences are not ``whole_sequences`` on this rank (CP chunks:
    which counted tokens a chunk holds is only known on all CP ranks together).
    """
    if values is None:
        return [None] * len(shapes)
    rows = [shape[0] for shape in shapes]
    total = sum(rows)
    if isinstance(values, torch.Tensor):
        packed_tokens = values.dim() == 1 and len(shapes) == 1 and total == 1 and shapes[0][1] == values.shape[0]
        if packed_tokens and values.shape[0] != 1:
            values = values.unsqueeze(0)  # the tokens of one packed sequence
        if values.dim() == 0 or values.shape[0] != total:
            raise ValueError(f"{name} has shape {tuple(values.shape)}, i.e. {values.shape[0] if values.dim() else 0} "
                             f"sequences, but the inputs hold {total} sequences")
        pieces = list(values.split(rows))
        if values.dim() > 1:
            for index, (piece, shape) in enumerate(zip(pieces, shapes)):
                if tuple(piece.shape) != tuple(shape):
                    raise ValueError(f"{name} has shape {tuple(values.shape)} but logps has shape {tuple(shape)} "
                                     f"(microbatch {index})")
        return pieces
    if not isinstance(values, (list, tuple)):
        raise ValueError(f"{name} must be a list (one entry per sequence) or a tensor, got {type(values).__name__}")
    if values and len(values) == len(shapes) and all(isinstance(v, torch.Tensor) and v.dim() >= 2 for v in values):
        for index, (value, shape) in enumerate(zip(values, shapes)):
            if tuple(value.shape) != tuple(shape):
                raise ValueError(f"{name}[{index}] has shape {tuple(value.shape)} but logps of microbatch {index} "
                                 f"has shape {tuple(shape)}")
        return list(values)
    if len(values) != total:
        raise ValueError(f"{name} has {len(values)} sequences but the inputs hold {total} sequences")
    if not whole_sequences and not all(_is_number(item) for item in values):
        raise ValueError(f"{name}: per-token arrays need whole sequences, but each context-parallel rank holds "
                         "chunks of them; pass a tensor shaped like this rank's logps, one number per sequence, "
                         "or data gathered over CP (cp_gathered=True)")
    pieces, start = [], 0
    for count in rows:
        pieces.append(list(values[start:start + count]))
        start += count
    return pieces


def token_values(values: Any, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``values`` of one microbatch as a float64 tensor shaped like ``mask`` (0 where not counted).

    ``values``: a tensor shaped like ``mask``; a 1-D tensor with one number per
    sequence (spread over its counted tokens); or a list with one entry per
    sequence, a number (spread) or a 1-D array of the counted tokens' values in
    order (the ``i``-th value goes to the ``i``-th counted token, like Twinkle's
    ``align_logps_to_mask``). Also returns the number of sequences whose array
    length differs from their counted tokens (a device count: no host sync).
    """
    device = mask.device
    misaligned = torch.zeros((), dtype=torch.float64, device=device)
    if isinstance(values, torch.Tensor):
        values = values.to(device=device, dtype=torch.float64)
        if values.dim() == 1:
            values = values[:, None].expand(mask.shape)
        return torch.where(mask, values, torch.zeros((), dtype=torch.float64, device=device)), misaligned
    scalar_row = [_is_number(item) for item in values]
    # Host values (Twinkle's lists) cross to the device in one copy; device tensors stay where they are.
    scalars = _stack_on(device, [item if is_scalar else 0.0 for item, is_scalar in zip(values, scalar_row)])
    spread = scalars[:, None].expand(mask.shape)
    if all(scalar_row):
        return torch.where(mask, spread, torch.zeros((), dtype=torch.float64, device=device)), misaligned
    arrays = [torch.as_tensor([] if is_scalar else item, dtype=torch.float64).reshape(-1)
              for item, is_scalar in zip(values, scalar_row)]
    lengths = to_device(torch.tensor([len(a) for a in arrays]), device)
    if all(a.device.type == "cpu" for a in arrays):
        padded = to_device(torch.nn.utils.rnn.pad_sequence(arrays, batch_first=True), device)
    else:
        padded = torch.nn.utils.rnn.pad_sequence([a.to(device) for a in arrays], batch_first=True)
    if padded.shape[1] == 0:
        padded = torch.zeros(len(arrays), 1, dtype=torch.float64, device=device)
    rank_among_counted = mask.long().cumsum(-1) - 1
    scattered = padded.gather(1, rank_among_counted.clamp(0, padded.shape[1] - 1))
    scattered = torch.where(rank_among_counted < lengths[:, None], scattered, torch.zeros_like(scattered))
    is_scalar = to_device(torch.tensor(scalar_row), device)
    result = torch.where(is_scalar[:, None], spread, scattered)
    misaligned = (~is_scalar & (mask.sum(-1) != lengths)).sum().to(torch.float64)
    return torch.where(mask, result, torch.zeros_like(result)), misaligned


def _stack_on(device: torch.device, items: list) -> torch.Tensor:
    """Numbers and 0-d tensors as one float64 vector on ``device`` (one copy for host numbers)."""
    if all(not isinstance(item, torch.Tensor) for item in items):
        return to_device(torch.tensor([float(item) for item in items], dtype=torch.float64), device)
    return torch.stack([torch.as_tensor(item, dtype=torch.float64).reshape(()).to(device) for item in items])


def _is_number(item: Any) -> bool:
    return isinstance(item, numbers.Number) or getattr(item, "ndim", None) == 0


def as_rows(tensor: Any) -> torch.Tensor:
    """A per-token tensor as ``[sequences, length]`` (a packed ``[t]`` is one sequence)."""
    tensor = tensor if isinstance(tensor, torch.Tensor) else torch.as_tensor(tensor)
    return tensor.unsqueeze(0) if tensor.dim() == 1 else tensor


def labels_2d(batch: Any, metric: str) -> torch.Tensor:
    labels = batch.get("labels")
    if labels is None:
        raise ValueError(f"{metric} needs inputs['labels']")
    return as_rows(labels)
