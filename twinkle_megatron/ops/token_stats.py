r"""Vocab-parallel token statistics: argmax, label log-prob and entropy in one pass, two collectives.

Rank :math:`r` of the tensor-parallel ``group`` holds the logits of global
columns :math:`[rV_l, (r+1)V_l)` (Megatron's ``VocabParallel`` layout). For a
token with logits :math:`x_v` over the true vocabulary :math:`v < V` (padding
columns :math:`v \ge V` are never read):

.. math::

    m = \max_v x_v, \qquad Z = \sum_v e^{x_v - m}, \qquad
    \log p(y) = x_y - m - \log Z, \qquad
    H = -\sum_v p_v \log p_v = \log Z - \frac{1}{Z}\sum_v e^{x_v - m}(x_v - m).

**Local pass** (one read of the shard, ``chunk_size`` tokens at a time, fp32
arithmetic): for each token, the local maximum :math:`m_r` and its first
column, and the sums relative to the *local* maximum

.. math::

    S_0^{(r)} = \sum_{v \in r} e^{x_v - m_r}, \qquad
    S_1^{(r)} = \sum_{v \in r} e^{x_v - m_r}(x_v - m_r),

plus the label's logit :math:`x_y` from the one rank whose columns hold
:math:`y` (0 elsewhere). Two implementations compute it, with one contract
(:func:`torch_local_pass`): a chunked torch loop (the reference, and the CPU
path) and a fused one-read Triton kernel for GPUs
(:mod:`.triton_token_stats`); ``kernel=`` or the environment variable
``TWINKLE_MEGATRON_TOKEN_STATS_KERNEL`` picks one (:mod:`.kernel_select`).
Everything after it -- collectives and epilogue -- is the same code for both.

**Collective 1** -- all-reduce MAX of one int64 key per token that packs
:math:`m_r` and its global column (see :mod:`.shard`): it gives :math:`m` and
the argmax, ties going to the lowest global column.

**Rescale** with :math:`\delta_r = m_r - m \le 0`:

.. math::

    e^{\delta_r} S_0^{(r)} = \sum_{v \in r} e^{x_v - m}, \qquad
    e^{\delta_r}\big(S_1^{(r)} + \delta_r S_0^{(r)}\big) = \sum_{v \in r} e^{x_v - m}(x_v - m).

**Collective 2** -- all-reduce SUM of the packed ``[3, T]`` buffer
:math:`(e^{\delta_r}S_0^{(r)},\ e^{\delta_r}(S_1^{(r)} + \delta_r S_0^{(r)}),\ x_y\,[y \in r])`,
which gives :math:`Z`, :math:`\sum_v e^{x_v-m}(x_v-m)` and :math:`x_y`.

Every term of :math:`S_1` has the same sign (:math:`x_v - m \le 0`), so
:math:`H = \log Z + (-S_1/Z)` adds two non-negative numbers: no cancellation,
whatever the magnitude of the logits (a formulation through
:math:`\sum_v x_v e^{x_v}` loses :math:`\epsilon|m|` absolutely). All exponents
are :math:`\le 0`, so large logits (``±1e4``, or anything whose spread
:math:`m - x_v` stays below the float32 maximum, i.e. :math:`|x| < 1.7\cdot 10^{38}`)
cannot overflow; :math:`Z \ge 1` because the maximum contributes exactly :math:`e^0`.

Both collectives cover all tokens of all chunks at once: a call costs exactly
two collectives over ``group`` whatever the number of tokens or chunks
(:func:`vocab_parallel_argmax` one), none when ``group`` has one rank, and none
when there are no tokens (``T`` is a shape, the same on every rank).

Edge cases:

* ``vocab_size``: columns at or beyond it are sliced away, never read.
* Labels outside ``[0, vocab_size)`` (including padding columns) give NaN;
  labels equal to ``ignore_index`` give 0 (this wins over everything else).
* A token with a non-finite logit in a non-padding column (NaN, ``+inf`` or
  ``-inf``) gets NaN entropy and NaN log-prob: NaN or ``+inf`` turn every
  :math:`x - m` into NaN, and ``-inf`` makes a term
  :math:`e^{-\infty}\cdot(-\infty)` NaN in :math:`S_1`; the log-prob is set to NaN
  wherever the entropy is not finite. Its argmax follows ``torch.argmax``: a NaN
  counts as larger than everything, so it is the lowest global column holding a
  NaN (else a ``+inf``), the same on every rank.
* ``float64`` logits are summed in float64 but compared across ranks at float32
  resolution (the key carries a float32 maximum): values closer than a float32
  ulp in different shards tie and go to the lower column, and a maximum beyond
  the float32 range counts as non-finite. The sums stay exact: the rescaling
  uses each shard's own float64 maximum.

The logits are read, never written. Nothing here synchronises with the host.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from .kernel_select import choose_kernel, triton_local_pass
from .shard import (
    Shard,
    as_token_rows,
    block_width,
    compute_dtype,
    decode_key,
    default_chunk_size,
    encode_key,
    key_floor,
    restore_layout,
    token_order,
)

__all__ = ["TokenStats", "vocab_parallel_argmax", "vocab_parallel_entropy", "vocab_parallel_logprobs",
           "vocab_parallel_token_stats"]


class TokenStats(NamedTuple):
    """Per-token statistics, each of shape ``logits.shape[:-1]``, identical on every rank."""

    argmax: torch.Tensor
    """int64 global vocabulary id of the top-1 logit (lowest id on ties)."""
    logprobs: Optional[torch.Tensor]
    """log p(label) (float32, float64 for float64 logits); ``None`` without labels."""
    entropy: Optional[torch.Tensor]
    """Entropy of the softmax over the true vocabulary, in nats (None only in internal argmax-only calls)."""


def vocab_parallel_token_stats(logits: torch.Tensor, labels: Optional[torch.Tensor] = None,
                               group: Optional[dist.ProcessGroup] = None, vocab_size: Optional[int] = None,
                               chunk_size: Optional[int] = None, ignore_index: int = -100,
                               kernel: Optional[str] = None) -> TokenStats:
    """Argmax, log-prob of ``labels`` and entropy of vocab-parallel ``logits``: one pass, two collectives.

    Args:
        logits: this rank's vocabulary shard ``[..., V_local]`` in any leading
            layout (``[b, s, v]``, ``[s, b, v]``, ``[t, v]``); any float dtype
            (bf16/fp16 are computed in fp32). Never modified.
        labels: global vocabulary ids of shape ``logits.shape[:-1]``, or None.
        group: the tensor-parallel group the vocabulary is split over; None or a
            group of one rank means the whole vocabulary is local.
        vocab_size: the true vocabulary size; columns at or beyond it (Megatron's
            padding) are ignored. Default: ``V_local * group size``.
        chunk_size: tokens per chunk of the local pass (bounds the working
            memory to a few ``[chunk_size, V_local]`` fp32 buffers). Default:
            512 KiB per buffer on CPU (two buffers stay in the L2 cache), 64 MiB
            on accelerators; at least one token.
        ignore_index: labels equal to it get log-prob 0.
        kernel: the local pass's implementation: ``"torch"`` (the chunked torch
            loop), ``"triton"`` (the fused kernel of :mod:`.triton_token_stats`)
            or ``"auto"``; None reads ``TWINKLE_MEGATRON_TOKEN_STATS_KERNEL``
            (default ``"auto"``: the kernel only on a CUDA device kind with a
            passing device check recorded, see :mod:`.kernel_select`).
            ``chunk_size`` applies to the torch loop only.

    Returns:
        :class:`TokenStats` ``(argmax, logprobs, entropy)``; ``logprobs`` is None
        when ``labels`` is None.

    >>> import torch
    >>> from twinkle_megatron.ops import vocab_parallel_token_stats
    >>> logits = torch.tensor([[0.0, 0.0, 2.0, 9.0]])  # the last column is padding: vocab_size=3
    >>> stats = vocab_parallel_token_stats(logits, torch.tensor([2]), vocab_size=3)
    >>> stats.argmax.tolist(), round(stats.logprobs.item(), 4), round(stats.entropy.item(), 4)
    ([2], -0.2395, 0.6656)
    """
    return _token_stats(logits, labels, group, vocab_size, chunk_size, ignore_index, need_sums=True, kernel=kernel)


def vocab_parallel_argmax(logits: torch.Tensor, group: Optional[dist.ProcessGroup] = None,
                          vocab_size: Optional[int] = None, kernel: Optional[str] = None) -> torch.Tensor:
    r"""int64 global argmax of vocab-parallel ``logits [..., V_local]``, shape ``logits.shape[:-1]``, one collective.

    .. math::

        \hat y = \min \{\, v < V : x_v = \max_{u < V} x_u \,\}

    (the lowest global id on ties, like ``torch.argmax``; columns at or beyond
    the true vocabulary size ``V`` are never candidates; a NaN counts as larger
    than everything). The local pass without its sums, then **one** all-reduce
    MAX of the int64 keys (see :mod:`.shard`); no collective without a group or
    without tokens. Identical on every rank of ``group``.
    """
    return _token_stats(logits, None, group, vocab_size, None, -100, need_sums=False, kernel=kernel).argmax


def vocab_parallel_logprobs(logits: torch.Tensor, labels: torch.Tensor,
                            group: Optional[dist.ProcessGroup] = None, vocab_size: Optional[int] = None,
                            ignore_index: int = -100, kernel: Optional[str] = None) -> torch.Tensor:
    r"""log p(``labels``) under vocab-parallel ``logits [..., V_local]``, shape ``logits.shape[:-1]``, two collectives.

    .. math::

        \log p(y) = x_y - m - \log \sum_{v < V} e^{x_v - m}, \qquad m = \max_{v < V} x_v

    over the true vocabulary ``V`` (padding columns carry no probability).
    Labels equal to ``ignore_index`` give 0; labels outside ``[0, V)`` give NaN,
    and so does a token with a non-finite logit. float32 (float64 for float64
    logits), identical on every rank of ``group``; the entropy of the same pass
    comes for free with :func:`vocab_parallel_token_stats`.
    """
    if labels is None:
        raise ValueError("vocab_parallel_logprobs needs labels")
    return _token_stats(logits, labels, group, vocab_size, None, ignore_index, need_sums=True,
                        kernel=kernel).logprobs


def vocab_parallel_entropy(logits: torch.Tensor, group: Optional[dist.ProcessGroup] = None,
                           vocab_size: Optional[int] = None, kernel: Optional[str] = None) -> torch.Tensor:
    r"""Entropy (nats) of the softmax of vocab-parallel ``logits [..., V_local]``, two collectives.

    .. math::

        H = -\sum_{v<V} p_v \log p_v = \log Z - \frac{1}{Z} \sum_{v<V} e^{x_v - m}(x_v - m),
        \qquad Z = \sum_{v<V} e^{x_v - m}, \quad m = \max_{v<V} x_v

    Both terms are non-negative (:math:`x_v - m \le 0`): no cancellation for
    large logits. A token with a non-finite logit gets NaN. Shape
    ``logits.shape[:-1]``, float32 (float64 for float64 logits), identical on
    every rank of ``group``.
    """
    return _token_stats(logits, None, group, vocab_size, None, -100, need_sums=True, kernel=kernel).entropy


@torch.no_grad()
def _token_stats(logits: torch.Tensor, labels: Optional[torch.Tensor], group: Optional[dist.ProcessGroup],
                 vocab_size: Optional[int], chunk_size: Optional[int], ignore_index: int,
                 need_sums: bool, kernel: Optional[str] = None) -> TokenStats:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dim() < 1:
        raise ValueError("logits must have at least one dimension (the vocabulary)")
    lead_shape = logits.shape[:-1]
    if labels is not None:
        if not isinstance(labels, torch.Tensor):
            raise TypeError(f"labels must be a torch.Tensor or None, got {type(labels).__name__}")
        if labels.shape != lead_shape:
            raise ValueError(f"labels has shape {tuple(labels.shape)} but logits has shape "
                             f"{tuple(logits.shape)} (expected labels of shape {tuple(lead_shape)})")
        if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
            raise TypeError(f"labels must be an integer tensor, got {labels.dtype}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                   or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    cdtype = compute_dtype(logits.dtype)
    shard = Shard(logits.shape[-1], group, vocab_size)
    device = logits.device

    rows, order = as_token_rows(logits)
    n_tokens = rows.shape[0]
    if n_tokens == 0:  # a shape: every rank skips the collectives together
        empty = torch.empty(lead_shape, dtype=cdtype, device=device)
        return TokenStats(torch.empty(lead_shape, dtype=torch.int64, device=device),
                          empty.clone() if labels is not None else None,
                          empty if need_sums else None)

    n_valid = shard.n_valid
    flat_labels = None
    if labels is not None:
        flat_labels = token_order(labels, order).to(device=device, dtype=torch.int64)
    # stats rows: S0 = sum e^{x-m}, S1 = sum e^{x-m}(x-m), the label's logit (0 off its owner).
    stats = torch.zeros(3, n_tokens, dtype=cdtype, device=device) if need_sums else None
    if n_valid > 0:
        # The local pass, by either implementation (same outputs, same contract).
        local_labels = flat_labels - shard.start if flat_labels is not None and need_sums else None
        if choose_kernel(kernel, rows) == "triton":
            local_max, local_col = triton_local_pass()(rows, n_valid, local_labels, stats, need_sums)
        else:
            local_max, local_col = torch_local_pass(rows, n_valid, local_labels, stats, cdtype, chunk_size,
                                                     need_sums)
        keys = encode_key(local_max, local_col + shard.start, shard.vocab_size)
        local_max = local_max.to(cdtype)
    else:  # this rank holds only padding columns
        local_max = None
        keys = torch.full((n_tokens,), key_floor(), dtype=torch.int64, device=device)

    # Collective 1: global max and argmax (lowest global column on ties).
    if shard.group is not None:
        dist.all_reduce(keys, op=dist.ReduceOp.MAX, group=shard.group)
    global_max, argmax = decode_key(keys, shard.vocab_size)
    argmax = restore_layout(argmax, lead_shape, order)
    if not need_sums:
        return TokenStats(argmax, None, None)

    global_max = global_max.to(cdtype)
    if local_max is not None:  # (delta == 0 without a group, except for float64's float32 key)
        delta = local_max - global_max
        scale = torch.exp(delta)
        s0, s1 = stats[0], stats[1]
        s1.addcmul_(delta, s0).mul_(scale)
        s0.mul_(scale)
    # Collective 2: the packed partial sums, already relative to the global max.
    if shard.group is not None:
        dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=shard.group)

    log_z = torch.log(stats[0])
    entropy = log_z - stats[1] / stats[0]
    logprobs = None
    if flat_labels is not None:
        nan = torch.full((), float("nan"), dtype=cdtype, device=device)
        logprobs = stats[2] - global_max - log_z
        valid = (flat_labels >= 0) & (flat_labels < shard.vocab_size) & torch.isfinite(entropy)
        logprobs = torch.where(valid, logprobs, nan)
        logprobs = torch.where(flat_labels == ignore_index, torch.zeros((), dtype=cdtype, device=device),
                               logprobs)
        logprobs = restore_layout(logprobs, lead_shape, order)
    return TokenStats(argmax, logprobs, restore_layout(entropy, lead_shape, order))


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
    by column, a few hundred columns per token.
    """
    n_tokens, n_cols = rows.shape
    device = rows.device
    if chunk_size is None:
        chunk_size = default_chunk_size(device, n_cols)
    chunk_size = min(chunk_size, n_tokens)
    width = block_width(n_cols)
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

    for start in range(0, n_tokens, chunk_size):
        stop = min(start + chunk_size, n_tokens)
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
    columns = first_max_column(rows, block_max if width else None, width, chunk_size)
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
        cols.clamp_(max=n_cols - 1)  # a short tail block repeats its last column; first hit wins
        first = rows[start:stop].gather(1, cols).argmax(dim=-1, keepdim=True)
        torch.gather(cols, 1, first, out=columns[start:stop].unsqueeze(1))
    return columns
