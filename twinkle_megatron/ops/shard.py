"""Shared plumbing of the vocab-parallel ops: shard geometry, token rows, the argmax key.

Nothing here reads tensor *values* on the host: every decision is taken from
shapes, dtypes, strides and the process group, which are identical on every
rank of a tensor-parallel group, so all ranks always take the same branches and
issue the same collectives.

The argmax key
--------------
A per-token int64 key packs the local maximum ``v`` (float32) and its global
column ``j`` so that one all-reduce MAX finds the global maximum *and* breaks
ties towards the lowest global column, like ``torch.argmax``::

    bits = bitcast_int32(v)                        # IEEE-754 sign-magnitude
    s    = bits ^ ((bits >> 31) & 0x7FFFFFFF)      # two's-complement order == float order
    key  = s * 2**K + (V - 1 - j)                  # K = bit length of V - 1, V = vocabulary size

``s`` is monotone in ``v`` (negative floats have their magnitude bits flipped),
so a larger value always gives a larger key; equal values compare on
``V - 1 - j``, which is larger for the lower column. ``|s| < 2**31`` and
``K <= 32`` keep the key inside int64. The map is its own inverse, so the
winner's float32 maximum comes back bit for bit. Before encoding, ``-0.0``
becomes ``+0.0`` (they compare equal in torch) and every NaN becomes the one
canonical positive quiet NaN, which sorts above ``+inf``: a NaN anywhere in a
token's row therefore wins the MAX on every rank and poisons that token's
statistics, as it should.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

_MAX_KEY_INDEX_BITS = 32
# Candidate block widths for the two-level argmax (largest first). The pass keeps the maximum of every block
# (a [T, n/width] table: its extra memory); the full pass is bound by its exp and takes the same time at any
# width, so it keeps the smallest table. The argmax-only pass (no exp) is bound by its two argmaxes, over
# the table and within the chosen block: blocks of 64 measured fastest at 2k, 16k and 32k columns (about
# 25% under 256 at 2k), for a table of 1/64 of the fp32 logits.
_BLOCKS = (256, 128, 64, 32, 16)
_ARGMAX_ONLY_BLOCKS = (64, 32, 16)
# Default fp32 bytes of one [chunk, V_local] working buffer (the pass uses two).
# On CPU both stay in the L2 cache (~2 MiB per core here), so the chunk's five
# element-wise passes after the first read never go back to main memory; a
# 512 KiB buffer measured fastest at 4096 x 16384 (1-2 MiB within 15%).
# Accelerators want few, large kernels instead.
CPU_CHUNK_BYTES = 512 << 10
ACCELERATOR_CHUNK_BYTES = 64 << 20


class Shard:
    """Where this rank's columns sit in the global vocabulary."""

    __slots__ = ("group", "tp", "rank", "v_local", "vocab_size", "start", "n_real", "padded")

    def __init__(self, v_local: int, group: Optional[dist.ProcessGroup], vocab_size: Optional[int]) -> None:
        if v_local <= 0:
            raise ValueError(f"logits must have a non-empty vocabulary dimension, got V_local={v_local}")
        tp, rank = 1, 0
        if group is not None:
            tp = dist.get_world_size(group)
            rank = dist.get_rank(group)
            if rank < 0:
                raise ValueError("this process is not a member of `group`")
        v_global = v_local * tp
        if vocab_size is None:
            vocab_size = v_global
        elif isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
            raise TypeError(f"vocab_size must be an int or None, got {type(vocab_size).__name__}")
        elif not 1 <= vocab_size <= v_global:
            raise ValueError(f"vocab_size={vocab_size} is outside [1, V_local*tp] = [1, {v_global}] "
                             f"(V_local={v_local}, tp={tp})")
        if vocab_size - 1 >= 1 << _MAX_KEY_INDEX_BITS:
            raise ValueError(f"vocab_size={vocab_size} exceeds 2**{_MAX_KEY_INDEX_BITS}")
        self.group = group if tp > 1 else None
        self.tp = tp
        self.rank = rank
        self.v_local = v_local
        self.vocab_size = vocab_size
        self.start = rank * v_local
        # Columns at or beyond vocab_size are Megatron's padding: they are never read.
        self.n_real = max(0, min(v_local, vocab_size - self.start))
        # Whether any rank holds padding columns: a shape, the same on every rank of the group.
        self.padded = vocab_size < v_global


def as_token_rows(logits: torch.Tensor) -> Tuple[torch.Tensor, Tuple[int, ...]]:
    """View ``logits [..., V]`` as ``[T, V]`` rows without copying when the strides allow.

    Returns the rows and the permutation of the leading dims the rows follow
    (identity for the usual contiguous ``[b,s,v]`` / ``[s,b,v]`` / ``[t,v]``). A
    transposed view (``[s,b,v]`` data seen as ``[b,s,v]``) is read in memory
    order and the per-token results are permuted back by :func:`restore_layout`.
    Only a layout no permutation can flatten (e.g. a strided slice of the
    leading dims) is copied.
    """
    lead = logits.dim() - 1
    identity = tuple(range(lead))
    v = logits.shape[-1]
    try:
        return logits.view(-1, v), identity
    except RuntimeError:
        pass
    order = tuple(sorted(identity, key=lambda d: -logits.stride(d)))
    try:
        return logits.permute(*order, lead).view(-1, v), order
    except RuntimeError:
        return logits.reshape(-1, v), identity


def token_order(tensor: torch.Tensor, order: Tuple[int, ...]) -> torch.Tensor:
    """Flatten a per-token tensor (shape ``logits.shape[:-1]``) in the order of :func:`as_token_rows`."""
    if order != tuple(range(tensor.dim())):
        tensor = tensor.permute(*order)
    return tensor.reshape(-1)


def restore_layout(flat: torch.Tensor, lead_shape: torch.Size, order: Tuple[int, ...]) -> torch.Tensor:
    """Inverse of :func:`token_order`: ``[T]`` results back to ``lead_shape``."""
    if order == tuple(range(len(lead_shape))):
        return flat.view(lead_shape)
    permuted = flat.view([lead_shape[d] for d in order])
    inverse = [0] * len(order)
    for position, dim in enumerate(order):
        inverse[dim] = position
    return permuted.permute(*inverse).contiguous()


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    if not dtype.is_floating_point:
        raise TypeError(f"logits must be a floating-point tensor, got {dtype}")
    return torch.float64 if dtype == torch.float64 else torch.float32


def default_chunk_size(device: torch.device, n_cols: int) -> int:
    budget = CPU_CHUNK_BYTES if device.type == "cpu" else ACCELERATOR_CHUNK_BYTES
    return max(1, budget // (4 * max(1, n_cols)))


def block_width(n_cols: int, argmax_only: bool = False) -> int:
    """Width of the blocks of the two-level argmax (0: search the row directly); see ``_BLOCKS``."""
    for width in _ARGMAX_ONLY_BLOCKS if argmax_only else _BLOCKS:
        if n_cols >= 4 * width:
            return width
    return 0


def key_bits(vocab_size: int) -> int:
    return max(1, (vocab_size - 1).bit_length())


def encode_key(values: torch.Tensor, columns: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Pack float32 ``values`` and global ``columns`` into int64 keys (see the module docstring)."""
    v = values.to(torch.float32) + 0.0  # -0.0 -> +0.0
    v = torch.where(torch.isnan(v), torch.full_like(v, float("nan")), v)
    bits = v.view(torch.int32)
    s = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return s.to(torch.int64) * (1 << key_bits(vocab_size)) + (vocab_size - 1 - columns)


def decode_key(keys: torch.Tensor, vocab_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`encode_key`: (float32 values, int64 global columns)."""
    scale = 1 << key_bits(vocab_size)
    s = torch.div(keys, scale, rounding_mode="floor")
    columns = (vocab_size - 1) - (keys - s * scale)
    s = s.to(torch.int32)
    bits = s ^ ((s >> 31) & 0x7FFFFFFF)
    return bits.view(torch.float32), columns


def key_floor() -> int:
    """A key below every real key: what a rank holding only padding columns contributes."""
    return -(1 << 63)
