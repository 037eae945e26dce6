r"""The local pass of :func:`~.token_stats.vocab_parallel_token_stats` as one fused Triton kernel.

One program per token row of the local shard ``rows [T, V_l]`` reads the row
once, in blocks of ``BLOCK`` columns (bf16/fp16/fp32 loaded, fp32 arithmetic),
and writes what the torch loop of :func:`~.torch_local_pass.torch_local_pass`
writes: the local maximum :math:`m_r`, its first column, and

.. math::

    S_0 = \sum_{v < n} e^{x_v - m_r}, \qquad S_1 = \sum_{v < n} e^{x_v - m_r}(x_v - m_r),

plus the label's logit :math:`x_y` when this shard owns :math:`y`; ``n`` is the
number of real (non-padding) columns, and columns at or beyond it are masked
out of every load. The two TP collectives and the epilogue that follow are the
torch path's, unchanged (:func:`~.token_stats._token_stats`).

**Online sums.** Each lane ``l`` of a block keeps partial sums
:math:`s_0^{(l)}, s_1^{(l)}` over the columns ``l, l + BLOCK, ...`` it has seen,
all relative to one running row maximum :math:`M` (a scalar of the program).
A block with maximum :math:`b` moves it to :math:`M' = \max(M, b)`; with
:math:`\delta = M - M' \le 0`, a term :math:`e^{x-M}` becomes
:math:`e^{\delta}e^{x-M}` and :math:`x - M'` is :math:`(x - M) + \delta`, so

.. math::

    s_0' = e^{\delta} s_0, \qquad s_1' = e^{\delta}\,(s_1 + \delta\, s_0)
          = e^{\delta} s_1 + (e^{\delta}\delta)\, s_0

(computed in the second form: :math:`|e^{\delta}\delta| \le 1/e`, while
:math:`\delta s_0` alone overflows for a spread near the float32 maximum), then
the block's own terms :math:`e^{d}` and :math:`e^{d} d`, :math:`d = x - M'`,
are added. Only the block maximum is reduced across lanes per block (one
``exp`` per element, which keeps the SFU below the memory rate on current
GPUs); the lane sums are reduced once at the end, so :math:`M` there is the row
maximum and :math:`S_0 = \sum_l s_0^{(l)}`, :math:`S_1 = \sum_l s_1^{(l)}`.
When :math:`M` does not move, :math:`\delta = 0` and :math:`e^{\delta} = 1`
leave the sums bit for bit unchanged.

**Non-finite values.** The sums run over the finite columns only (others are
masked to :math:`-\infty`, which contributes nothing), with :math:`M = -\infty`
until the first finite value: there :math:`e^{\delta} = 0` and the
:math:`\delta s_0` term is skipped (:math:`s_0 = 0`), so no
:math:`\infty - \infty` or :math:`0\cdot\infty` arises. A row with any NaN or
:math:`\pm\infty` among its real columns gets :math:`S_0 = S_1 = \mathrm{NaN}`,
which makes its entropy and log-prob NaN after the epilogue, on every rank,
exactly as the torch path's arithmetic does (there NaN/:math:`+\infty` turn
every :math:`x - m` into NaN and :math:`-\infty` adds
:math:`e^{-\infty}\cdot(-\infty)` to :math:`S_1`).

**Argmax.** Each lane keeps its best value and column under ``torch.argmax``'s
order: a NaN is larger than everything (the first NaN stays), otherwise ``>``,
so a lane keeps the first column of its maximum. The final cross-lane step
takes the lowest column among the lanes holding a NaN if there is one, else
among those equal to the maximum (:math:`-0.0 = +0.0`, :math:`+\infty`, and an
all-:math:`-\infty` row, whose argmax is its first column). The returned
maximum is that column's value (NaN, :math:`\pm\infty` or finite), which is
what ``amax`` gives: the int64 key of :mod:`.shard` then orders the ranks.

Memory: nothing but the ``[T]`` outputs; the shard is read once (plus one
element per row for the label). Offsets are computed in int64.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import triton
import triton.language as tl

__all__ = ["triton_local_pass", "launch_config", "SUPPORTED_DTYPES"]

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Default launch: each thread loads 16 bytes per block (one vector load: 8 bf16 or 4 fp32), 8 warps, so a
# block is 4 KiB of logits; two pipeline stages keep the next block's load in flight. The registers of this
# configuration (benchmarks/kernel_resources.py: about 60-80 on sm_90) leave room for several programs per
# SM. To be confirmed on a GPU: benchmarks/gpu_timings.py times a sweep of (block, warps, stages).
_BLOCK_BYTES = 4 << 10
_BYTES_PER_THREAD = 16
_MAX_WARPS = 8
_NUM_STAGES = 2
_NO_COLUMN = tl.constexpr(2**31 - 1)  # marks a lane that has not seen a real column yet


@triton.jit
def _local_pass_kernel(x_ptr, labels_ptr, max_ptr, col_ptr, stats_ptr,
                       n_cols, stride_row, stride_col, stats_stride,
                       HAS_LABELS: tl.constexpr, NEED_SUMS: tl.constexpr, BLOCK: tl.constexpr,
                       NUM_STAGES: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = x_ptr + row * stride_row
    lanes = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_col = tl.full([BLOCK], _NO_COLUMN, tl.int32)
    s0 = tl.zeros([BLOCK], tl.float32)
    s1 = tl.zeros([BLOCK], tl.float32)
    running_max = tl.max(best, axis=0)  # -inf, a float32 scalar carried through the loop
    for start in tl.range(0, n_cols, BLOCK, num_stages=NUM_STAGES):
        cols = start + lanes
        real = cols < n_cols
        x = tl.load(row_ptr + cols.to(tl.int64) * stride_col, mask=real, other=float("-inf")).to(tl.float32)
        # argmax: NaN beats everything, else strictly greater; a lane's first real column always enters.
        x_nan = x != x
        take = real & ((x > best) | (x_nan & (best == best)) | (best_col == _NO_COLUMN))
        best = tl.where(take, x, best)
        best_col = tl.where(take, cols, best_col)
        if NEED_SUMS:
            finite = real & (tl.abs(x) < float("inf"))
            new_max = tl.maximum(running_max, tl.max(tl.where(finite, x, float("-inf")), axis=0))
            # Shift relative to new_max; while no finite value was seen (running_max = -inf) the sums are
            # 0 and any finite gap will do, so gap = 0 there and no -inf - -inf is ever formed.
            shift = tl.where(new_max > float("-inf"), new_max, 0.0)
            gap = tl.where(running_max > float("-inf"), running_max - shift, 0.0)
            scale = tl.exp(gap)
            # s1' = e^gap (s1 + gap s0), with e^gap * gap (|.| <= 1/e) formed first: gap * s0 alone can
            # overflow (a -1.5e38 plateau, then 1.5e38) where the product with e^gap = 0 is just 0.
            s1 = scale * s1 + (scale * gap) * s0
            s0 = scale * s0
            d = tl.where(finite, x - shift, 0.0)
            # A NaN or +-inf real column makes its lane's S0 NaN for good (and S1 through the rescale).
            e = tl.where(finite, tl.exp(d), tl.where(real, float("nan"), 0.0))
            s0 += e
            s1 += tl.where(finite, e * d, 0.0)
            running_max = new_max

    nan_lane = best != best
    has_nan = tl.max(nan_lane.to(tl.int32), axis=0) > 0
    top = tl.max(tl.where(nan_lane, float("-inf"), best), axis=0)
    candidate = tl.where(has_nan, nan_lane, best == top) & (best_col != _NO_COLUMN)
    column = tl.min(tl.where(candidate, best_col, _NO_COLUMN), axis=0)
    tl.store(max_ptr + row, tl.where(has_nan, float("nan"), top))
    tl.store(col_ptr + row, column.to(tl.int64))
    if NEED_SUMS:
        s0_row = tl.sum(s0, axis=0)
        tl.store(stats_ptr + row, s0_row)
        tl.store(stats_ptr + stats_stride + row, tl.where(s0_row == s0_row, tl.sum(s1, axis=0), float("nan")))
        if HAS_LABELS:
            label = tl.load(labels_ptr + row)
            owned = (label >= 0) & (label < n_cols)
            picked = tl.load(row_ptr + tl.where(owned, label, 0) * stride_col, mask=owned, other=0.0)
            tl.store(stats_ptr + 2 * stats_stride + row, picked.to(tl.float32))


def launch_config(n_cols: int, element_size: int, block: Optional[int] = None, num_warps: Optional[int] = None,
                  num_stages: Optional[int] = None) -> tuple[int, int, int]:
    """``(BLOCK, num_warps, num_stages)`` for rows of ``n_cols`` columns of ``element_size`` bytes.

    Default: at most ``_BLOCK_BYTES`` (4 KiB) of logits per block, a power of
    two no wider than the row; ``block * element_size / 16`` threads (one
    16-byte load each), as warps, 1 to 8; a two-stage software pipeline.
    Explicit values override each part (``benchmarks/gpu_timings.py`` times each, ``tests/test_cuda.py``
    checks that they agree).
    """
    if block is None:
        block = min(triton.next_power_of_2(max(1, n_cols)), max(16, _BLOCK_BYTES // element_size))
    if block < 1 or block & (block - 1):
        raise ValueError(f"block must be a power of two, got {block}")
    if num_warps is None:
        num_warps = max(1, min(_MAX_WARPS, block * element_size // (32 * _BYTES_PER_THREAD)))
    if num_stages is None:
        num_stages = _NUM_STAGES
    return block, num_warps, num_stages


def triton_local_pass(rows: torch.Tensor, n_real: int, local_labels: Optional[torch.Tensor],
                      stats: Optional[torch.Tensor], need_sums: bool, block: Optional[int] = None,
                      num_warps: Optional[int] = None, num_stages: Optional[int] = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused local pass over ``rows[:, :n_real]``; the contract of ``torch_local_pass``.

    Returns ``(local_max float32 [T], local_column int64 [T])``; with ``need_sums``
    fills ``stats[0]`` (S0), ``stats[1]`` (S1) and, with ``local_labels`` (label −
    shard start, int64 ``[T]``), ``stats[2]`` (the label's logit, 0 where this shard
    does not own it). ``block`` / ``num_warps`` / ``num_stages`` override
    :func:`launch_config`.
    """
    if rows.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"the Triton token-statistics kernel takes {', '.join(map(str, SUPPORTED_DTYPES))} "
                        f"logits, got {rows.dtype}")
    if need_sums and stats is None:
        raise ValueError("need_sums needs a stats buffer")
    n_tokens = rows.shape[0]
    local_max = torch.empty(n_tokens, dtype=torch.float32, device=rows.device)
    local_col = torch.empty(n_tokens, dtype=torch.int64, device=rows.device)
    has_labels = need_sums and local_labels is not None
    block, num_warps, num_stages = launch_config(n_real, rows.element_size(), block, num_warps, num_stages)
    # Triton launches on the current CUDA device: make it the logits' one.
    on_device = torch.cuda.device(rows.device) if rows.device.type == "cuda" else contextlib.nullcontext()
    with on_device:
        _local_pass_kernel[(n_tokens,)](
            rows, local_labels.contiguous() if has_labels else local_col, local_max, local_col,
            stats if need_sums else local_max, n_real, rows.stride(0), rows.stride(1),
            stats.stride(0) if need_sums else 0,
            HAS_LABELS=has_labels, NEED_SUMS=need_sums, BLOCK=block, NUM_STAGES=num_stages, num_warps=num_warps)
    return local_max, local_col


def is_interpreted() -> bool:
    """Whether this process runs the kernel in Triton's interpreter (``TRITON_INTERPRET=1`` at import)."""
    return not isinstance(_local_pass_kernel, triton.runtime.JITFunction)
