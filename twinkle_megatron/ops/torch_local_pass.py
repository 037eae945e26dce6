"""The local pass of :func:`~.token_stats.vocab_parallel_token_stats` in torch: the reference and the CPU path.

One read of this rank's vocabulary shard, ``chunk_size`` tokens at a time, fp32
arithmetic: per token the local maximum ``m_r``, its first column, and the sums
``S0 = Σ e^{x−m_r}``, ``S1 = Σ e^{x−m_r}(x−m_r)`` relative to it, plus the label's
logit on the rank whose columns hold it (formulas: :mod:`.token_stats`). The fused
Triton kernel (:mod:`.triton_token_stats`) has the same contract.
"""

from __future__ import annotations

from typing import Optional

import torch

from .shard import block_width, default_chunk_size

__all__ = ["first_max_column", "torch_local_pass"]


def torch_local_pass(rows: torch.Tensor, n_valid: int, local_labels: Optional[torch.Tensor],
                      stats: Optional[torch.Tensor], cdtype: torch.dtype, chunk_size: Optional[int],
                      need_sums: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The local pass in torch over the real columns ``rows[:, :n_valid]``.

    Returns the per-token local maximum (``cdtype``) and its first local column
    (int64); with ``need_sums`` fills ``stats[0]`` (S0), ``stats[1]`` (S1) and,
    given ``local_labels`` (label − shard start), ``stats[2]``: the label's
    logit where ``0 <= local_label < n_valid``, else 0. The Triton kernel
    (:func:`.triton_token_stats.triton_local_pass`) has the same contract.
    """
    local_max, local_col = _local_pass(rows[:, :n_valid], stats, cdtype, chunk_size, need_sums)
    if local_labels is not None:
        owned = (local_labels >= 0) & (local_labels < n_valid)
        picked = rows.gather(1, local_labels.clamp(0, n_valid - 1).unsqueeze(1)).squeeze(1)
        torch.where(owned, picked.to(cdtype), torch.zeros((), dtype=cdtype, device=rows.device), out=stats[2])
    return local_max, local_col


def _local_pass(rows: torch.Tensor, stats: Optional[torch.Tensor], cdtype: torch.dtype,
                chunk_size: Optional[int], need_sums: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One read of ``rows [T, n]``: per-token local max and its first column; fills ``stats[0:2]``.

    Per chunk of ``chunk_size`` tokens (``x`` upcast to fp32 first for bf16/fp16):
    block maxima and the row maximum ``m`` (``amax``), ``d = x - m``,
    ``e = exp(d)``, ``d *= e``, and one sum over ``[e, d]`` for ``(S0, S1)``; the
    two ``[chunk, n]`` buffers are reused by every chunk.

    The argmax is found in two levels because ``torch.max(dim)`` with indices is
    about five times slower than the vectorised ``amax`` on CPU: the chunk loop
    keeps the maximum of every block of ``width`` columns (a ``[T, n/width]``
    side table), then the first block holding the row maximum is searched column
    by column: up to 256 columns per token in the full pass, 64 in the argmax-only
    one (:func:`.shard.block_width`).
    """
    n_tokens, n_cols = rows.shape
    device = rows.device
    if chunk_size is None:
        chunk_size = default_chunk_size(device, n_cols)
    chunk_size = min(chunk_size, n_tokens)
    # Without sums there is no working buffer to bound: the maxima are one op over all tokens.
    pass_chunk = chunk_size if need_sums else n_tokens
    width = block_width(n_cols, argmax_only=not need_sums)
    n_full = n_cols // width if width else 0
    has_tail = bool(width) and n_full * width < n_cols
    # bf16/fp16 chunks are upcast once into a buffer; argmax-only needs no upcast at all.
    cast = need_sums and rows.dtype != cdtype
    table_dtype = cdtype if cast else rows.dtype
    if width:
        block_max = torch.empty(n_tokens, n_full + has_tail, dtype=table_dtype, device=device)
    local_max = torch.empty(n_tokens, dtype=table_dtype, device=device)
    if need_sums:
        # [0]: e^{x-m}, [1]: x-m then e^{x-m}(x-m); one sum over both gives (S0, S1).
        work = torch.empty(2, chunk_size, n_cols, dtype=cdtype, device=device)

    for start in range(0, n_tokens, pass_chunk):
        stop = min(start + pass_chunk, n_tokens)
        n = stop - start
        x = rows[start:stop]
        if cast:
            x = work[1, :n].copy_(x)
        m = local_max[start:stop]
        if width:
            table = block_max[start:stop]
            torch.amax(x[:, :n_full * width].unflatten(-1, (n_full, width)), dim=-1, out=table[:, :n_full])
            if has_tail:
                torch.amax(x[:, n_full * width:], dim=-1, keepdim=True, out=table[:, n_full:])
            torch.amax(table, dim=-1, out=m)
        else:
            torch.amax(x, dim=-1, out=m)
        if not need_sums:
            continue
        shifted = work[1, :n]
        if cast:
            shifted.sub_(m.unsqueeze(1))  # in place on the upcast copy
        else:
            torch.sub(x, m.unsqueeze(1), out=shifted)
        shifted.mul_(torch.exp(shifted, out=work[0, :n]))
        torch.sum(work[:, :n], dim=-1, out=stats[:2, start:stop])

    if need_sums:
        del work
    columns = first_max_column(rows, block_max if width else None, width, pass_chunk)
    return local_max.to(cdtype), columns


def first_max_column(rows: torch.Tensor, block_max: Optional[torch.Tensor], width: int,
                      chunk_size: int) -> torch.Tensor:
    """First column of each row's maximum (NaN counts as the largest value, like ``torch.argmax``)."""
    n_tokens, n_cols = rows.shape
    if block_max is None:
        return rows.argmax(dim=-1)
    block = block_max.argmax(dim=-1)  # first block holding the maximum
    offsets = torch.arange(width, device=rows.device)
    columns = torch.empty(n_tokens, dtype=torch.int64, device=rows.device)
    # Bound the [tokens, width] index/candidate temporaries like the main pass.
    step = max(1, (chunk_size * n_cols) // (3 * width))
    for start in range(0, n_tokens, step):
        stop = min(start + step, n_tokens)
        cols = (block[start:stop] * width).unsqueeze(1) + offsets
        if n_cols % width:
            cols.clamp_(max=n_cols - 1)  # a short tail block repeats its last column; first hit wins
        first = rows[start:stop].gather(1, cols).argmax(dim=-1, keepdim=True)
        torch.gather(cols, 1, first, out=columns[start:stop].unsqueeze(1))
    return columns
