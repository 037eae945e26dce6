"""The local pass of the token statistics in torch: the reference, the CPU path and the fused loss's pass.

One read of this rank's vocabulary shard, ``chunk_size`` tokens at a time, fp32
arithmetic: per token the local maximum ``m_r``, its first column, and the sums
``S0 = Σ e^{x−m_r}``, ``S1 = Σ e^{x−m_r}(x−m_r)`` relative to it, plus the label's
logit on the rank whose columns hold it (formulas: :mod:`.token_stats`). The fused
Triton kernel (:mod:`.triton_token_stats`) has the same contract.

The fused loss (:mod:`.fused_cross_entropy`) runs the same pass with an ``exps``
buffer: the exponentials are then written there (its backward reads them), every
local column is read (Megatron's loss covers the padded vocabulary), and the sums
are relative to the maximum over all of them.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .shard import block_width, default_chunk_size

__all__ = ["LocalMaxima", "first_max_column", "torch_local_pass"]


class LocalMaxima(NamedTuple):
    """Per token of this rank: the maximum over the real columns and its first local column (None when the
    rank holds no real column), and the maximum ``m_r`` the sums are relative to (``max`` itself, except
    with kept exponentials of a shard with padding columns: the maximum over every local column)."""

    max: Optional[torch.Tensor]
    column: Optional[torch.Tensor]
    reference: torch.Tensor


def torch_local_pass(rows: torch.Tensor, n_real: int, local_labels: Optional[torch.Tensor],
                     stats: Optional[torch.Tensor], cdtype: torch.dtype, chunk_size: Optional[int],
                     need_sums: bool, exps: Optional[torch.Tensor] = None) -> LocalMaxima:
    """The local pass in torch over the real columns ``rows[:, :n_real]``.

    Returns :class:`LocalMaxima`: the per-token local maximum (``cdtype``), its
    first local column (int64) and the reference (the maximum itself here); with
    ``need_sums`` fills ``stats[0]`` (S0), ``stats[1]`` (S1) and,
    given ``local_labels`` (label − shard start), ``stats[2]``: the label's
    logit where ``0 <= local_label < n_real``, else 0. The Triton kernel
    (:func:`.triton_token_stats.triton_local_pass`) has the same contract (it
    returns the maximum and the column).

    With ``exps`` (an fp32 ``[T, V_l]`` buffer, which may be ``rows`` itself; needs
    ``need_sums``), every column of ``rows`` is read: the reference maximum
    ``m_r`` is over all of them, ``exps`` receives ``e^{x − m_r}`` (overwriting
    ``rows`` when it is the same buffer: the label's logit and the argmax are read
    first), the label's logit is taken wherever ``0 <= local_label < V_l``, and
    ``stats[3]`` (a fourth row, needed when the shard has padding columns) is
    ``Σ_{v >= n_real} e^{x − m_r}``, the padding columns' share.
    """
    label_columns = n_real if exps is None else rows.shape[1]
    if local_labels is not None:  # read before exps may overwrite the rows
        owned = (local_labels >= 0) & (local_labels < label_columns)
        picked = rows.gather(1, local_labels.clamp(0, label_columns - 1).unsqueeze(1)).squeeze(1)
        torch.where(owned, picked.to(cdtype), torch.zeros((), dtype=cdtype, device=rows.device), out=stats[2])
    return _local_pass(rows if exps is not None else rows[:, :n_real], n_real, stats, cdtype, chunk_size,
                       need_sums, exps)


def _local_pass(rows: torch.Tensor, n_real: int, stats: Optional[torch.Tensor], cdtype: torch.dtype,
                chunk_size: Optional[int], need_sums: bool, exps: Optional[torch.Tensor]) -> LocalMaxima:
    """One read of ``rows [T, n]``: per-token maxima and the first column of the real one; fills the sums.

    Per chunk of ``chunk_size`` tokens (``x`` upcast to fp32 first for bf16/fp16,
    into the exponentials' buffer): block maxima of the real columns and their
    maximum (``amax``), with padding columns (``exps`` only) the reference ``m``
    over all, ``d = x - m``, ``e = exp(d)``, ``d *= e``, and the sums of ``e`` and
    ``d`` over the real columns (one sum over ``[e, d]`` without ``exps``: both
    live in one ``[2, chunk, n]`` work buffer, reused by every chunk).

    The argmax is found in two levels because ``torch.max(dim)`` with indices is
    about five times slower than the vectorised ``amax`` on CPU: the chunk loop
    keeps the maximum of every block of ``width`` columns (a ``[T, n/width]``
    side table), then the first block holding the row maximum is searched column
    by column: up to 256 columns per token in the full pass, 64 in the argmax-only
    one (:func:`.shard.block_width`). The search runs once after the loop, or per
    chunk before the exponentials overwrite it when they are kept.
    """
    n_tokens, n_cols = rows.shape
    device = rows.device
    if chunk_size is None:
        chunk_size = default_chunk_size(device, n_cols)
    chunk_size = min(chunk_size, max(n_tokens, 1))  # (no token: the fused loss's empty microbatch)
    # Without sums there is no working buffer to bound: the maxima are one op over all tokens.
    pass_chunk = chunk_size if need_sums else max(n_tokens, 1)
    width = block_width(n_real, argmax_only=not need_sums)
    n_full = n_real // width if width else 0
    has_tail = bool(width) and n_full * width < n_real
    # bf16/fp16 chunks are upcast once into a buffer; argmax-only needs no upcast at all.
    cast = need_sums and rows.dtype != cdtype
    table_dtype = cdtype if cast else rows.dtype
    # With exps the first maximum's column is searched per chunk, before the exponentials overwrite the rows:
    # the table of block maxima then holds one chunk, else every token (searched after the loop).
    search_per_chunk = exps is not None
    if width:
        block_max = torch.empty(pass_chunk if search_per_chunk else n_tokens, n_full + has_tail, dtype=table_dtype,
                                device=device)
    local_max = torch.empty(n_tokens, dtype=table_dtype, device=device) if n_real else None
    # Padding columns (read only when exps are kept) move the reference above the real maximum.
    reference = local_max if n_cols == n_real else torch.empty(n_tokens, dtype=table_dtype, device=device)
    columns = torch.empty(n_tokens, dtype=torch.int64, device=device) if n_real and search_per_chunk else None
    if need_sums:
        # Without exps: [0] e^{x-m}, [1] x-m then e^{x-m}(x-m), one sum over both gives (S0, S1).
        work = torch.empty(1 if exps is not None else 2, chunk_size, n_cols, dtype=cdtype, device=device)

    for start in range(0, n_tokens, pass_chunk):
        stop = min(start + pass_chunk, n_tokens)
        n = stop - start
        x = rows[start:stop]
        if need_sums:  # e: the exponentials (kept, or the work buffer's first row), d: its last row
            e, d = (work[0, :n] if exps is None else exps[start:stop]), work[-1, :n]
        if cast:
            x = e.copy_(x)
        if n_real:
            m = local_max[start:stop]
            real = x[:, :n_real]
            if width:
                table = block_max[:n] if search_per_chunk else block_max[start:stop]
                torch.amax(real[:, :n_full * width].unflatten(-1, (n_full, width)), dim=-1, out=table[:, :n_full])
                if has_tail:
                    torch.amax(real[:, n_full * width:], dim=-1, keepdim=True, out=table[:, n_full:])
                torch.amax(table, dim=-1, out=m)
            else:
                torch.amax(real, dim=-1, out=m)
            if search_per_chunk:
                columns[start:stop] = first_max_column(real, table if width else None, width, n)
        if reference is not local_max:
            if n_real:
                torch.maximum(m, torch.amax(x[:, n_real:], dim=-1), out=reference[start:stop])
            else:
                torch.amax(x, dim=-1, out=reference[start:stop])
            m = reference[start:stop]
        if not need_sums:
            continue
        torch.sub(x, m.unsqueeze(1), out=d)  # x read for the last time
        torch.exp(d, out=e)  # with exps: overwrites fp32 logits held in the same buffer
        d.mul_(e)
        if exps is None:
            torch.sum(work[:, :n], dim=-1, out=stats[:2, start:stop])
        else:
            torch.sum(e[:, :n_real], dim=-1, out=stats[0, start:stop])
            torch.sum(d[:, :n_real], dim=-1, out=stats[1, start:stop])
            if n_cols > n_real:
                torch.sum(e[:, n_real:], dim=-1, out=stats[3, start:stop])

    if need_sums:
        del work
    if n_real and not search_per_chunk:
        columns = first_max_column(rows[:, :n_real], block_max if width else None, width, pass_chunk)
    local_max = local_max.to(cdtype) if n_real else None
    return LocalMaxima(local_max, columns, local_max if n_cols == n_real else reference.to(cdtype))


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
