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

Each step is a named function, in order: :func:`check_token_stats_inputs`, :func:`calculate_local_pass`,
:func:`calculate_global_max` (collective 1), :func:`calculate_global_sums` (rescale, collective 2),
:func:`calculate_epilogue` (entropy and log-prob). The fused loss
(:mod:`.fused_cross_entropy`) runs the same steps: its local pass also keeps the
exponentials for the backward and reads the padding columns, which Megatron's
loss covers (the reference maximum is then over every column, its key a second
row of collective 1, and the padding columns' share of :math:`Z` a fourth row of
collective 2; entropy and log-prob do not depend on the reference).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from .kernel_select import choose_kernel, triton_local_pass
from .shard import Shard, as_token_rows, compute_dtype, decode_key, encode_key, key_floor, restore_layout, token_order
from .torch_local_pass import LocalMaxima, torch_local_pass

__all__ = ["ArgmaxStats", "TokenStats", "vocab_parallel_argmax", "vocab_parallel_argmax_stats",
           "vocab_parallel_entropy", "vocab_parallel_logprobs", "vocab_parallel_token_stats"]


class TokenStats(NamedTuple):
    """Per-token statistics, each of shape ``logits.shape[:-1]``, identical on every rank."""

    argmax: torch.Tensor
    """int64 global vocabulary id of the top-1 logit (lowest id on ties)."""
    logprobs: Optional[torch.Tensor]
    """log p(label) (float32, float64 for float64 logits); ``None`` without labels."""
    entropy: Optional[torch.Tensor]
    """Entropy of the softmax over the true vocabulary, in nats (None only in internal argmax-only calls)."""


class ArgmaxStats(NamedTuple):
    """The statistics of a reader of the argmax only (:func:`vocab_parallel_argmax_stats`), shaped like
    ``logits.shape[:-1]``, identical on every rank."""

    argmax: torch.Tensor
    """int64 global vocabulary id of the top-1 logit (lowest id on ties) of a token whose logits are finite."""
    finite: torch.Tensor
    """bool: every logit of the token in the true vocabulary, on every rank, is finite (NaN/±inf: False)."""
    vocab_size: int
    """The true vocabulary size the argmax ranged over (a label outside ``[0, vocab_size)`` is invalid)."""


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


@torch.no_grad()
def vocab_parallel_argmax_stats(logits: torch.Tensor, group: Optional[dist.ProcessGroup] = None,
                                vocab_size: Optional[int] = None, kernel: Optional[str] = None) -> ArgmaxStats:
    r"""The argmax of vocab-parallel ``logits [..., V_local]`` and whether each token's logits are finite:
    no exp, **one** collective.

    The argmax is :func:`vocab_parallel_argmax`'s. ``finite`` is the test the
    entropy of :func:`vocab_parallel_token_stats` makes (``isfinite(H)``) without
    computing it: a NaN or ``+inf`` is the local maximum ``m_r``, a ``-inf`` is
    the local minimum; a rank whose shard holds a ``-inf`` puts a NaN in place of
    its maximum, so the one all-reduce MAX of the keys gives a non-finite global
    maximum exactly when some rank holds a non-finite logit (``float64``: or a
    maximum beyond the float32 range, as in the full pass). The argmax of a
    token that is not finite is unspecified (no metric scores it).
    """
    check_token_stats_inputs(logits, None, None)
    lead_shape, cdtype = logits.shape[:-1], compute_dtype(logits.dtype)
    shard = Shard(logits.shape[-1], group, vocab_size)
    rows, order = as_token_rows(logits)
    if rows.shape[0] == 0:  # a shape: every rank skips the collective together
        return ArgmaxStats(torch.empty(lead_shape, dtype=torch.int64, device=logits.device),
                           torch.empty(lead_shape, dtype=torch.bool, device=logits.device), shard.vocab_size)
    one_rank = shard.group is None
    local = calculate_local_pass(rows, shard, None, cdtype, None, False, kernel, flag_minus_inf=True,
                                 with_keys=not one_rank)
    if one_rank:  # the local maximum is the maximum: no key to pack (its float32 value, as a key would carry)
        global_max, argmax = local.max.to(torch.float32), local.columns
    else:
        global_max, argmax = calculate_global_max(local.keys, shard)  # the one collective
    return ArgmaxStats(restore_layout(argmax, lead_shape, order),
                       restore_layout(torch.isfinite(global_max), lead_shape, order), shard.vocab_size)


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
    """The whole computation as named steps (module docstring): local pass, collective 1, rescale and
    collective 2, epilogue. ``need_sums=False``: the argmax only (the local pass without sums, collective 1)."""
    check_token_stats_inputs(logits, labels, chunk_size)
    lead_shape, cdtype = logits.shape[:-1], compute_dtype(logits.dtype)
    shard = Shard(logits.shape[-1], group, vocab_size)
    rows, order = as_token_rows(logits)
    if rows.shape[0] == 0:  # a shape: every rank skips the collectives together
        return empty_token_stats(lead_shape, cdtype, logits.device, labels is not None, need_sums)
    flat_labels = None if labels is None else token_order(labels, order).to(device=logits.device, dtype=torch.int64)
    local = calculate_local_pass(rows, shard, flat_labels, cdtype, chunk_size, need_sums, kernel)
    reference, argmax = calculate_global_max(local.keys, shard)  # collective 1
    argmax = restore_layout(argmax, lead_shape, order)
    if not need_sums:
        return TokenStats(argmax, None, None)
    reference = reference.to(cdtype)
    sums = calculate_global_sums(local, reference, shard).sums  # rescale, collective 2
    epilogue = calculate_epilogue(sums, reference, flat_labels, shard.vocab_size, ignore_index)
    logprobs = None if flat_labels is None else restore_layout(epilogue.logprobs, lead_shape, order)
    return TokenStats(argmax, logprobs, restore_layout(epilogue.entropy, lead_shape, order))


def check_token_stats_inputs(logits: torch.Tensor, labels: Optional[torch.Tensor], chunk_size: Optional[int]) -> None:
    """Types and shapes only (never values: no host sync): a clear error naming both tensors."""
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dim() < 1:
        raise ValueError("logits must have at least one dimension (the vocabulary)")
    if labels is not None:
        if not isinstance(labels, torch.Tensor):
            raise TypeError(f"labels must be a torch.Tensor or None, got {type(labels).__name__}")
        if labels.shape != logits.shape[:-1]:
            raise ValueError(f"labels has shape {tuple(labels.shape)} but logits has shape "
                             f"{tuple(logits.shape)} (expected labels of shape {tuple(logits.shape[:-1])})")
        if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
            raise TypeError(f"labels must be an integer tensor, got {labels.dtype}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                   or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")


def empty_token_stats(lead_shape: torch.Size, cdtype: torch.dtype, device: torch.device, with_labels: bool,
                      need_sums: bool) -> TokenStats:
    """The statistics of no token: empty tensors of the right shapes and dtypes, no collective."""
    empty = torch.empty(lead_shape, dtype=cdtype, device=device)
    return TokenStats(torch.empty(lead_shape, dtype=torch.int64, device=device),
                      empty.clone() if with_labels else None, empty if need_sums else None)


class LocalPass(NamedTuple):
    """This rank's part of every token (``[T]`` each unless said).

    ``max``: the maximum ``m_r`` the sums are relative to (None on a rank of padding columns only, unless the
    exponentials are kept). ``keys``: the int64 keys packing the real columns' maximum and its global column
    (:mod:`.shard`; None when not asked for); ``[2, T]`` when the sums' reference covers padding columns (kept
    exponentials of a padded vocabulary): row 1 is then the key of ``m_r``. ``stats``: ``[3, T]`` (S0, S1
    relative to ``m_r``, the label's logit or 0 off its owner), ``[4, T]`` with the padding columns' share
    ``Σ_{v >= V} e^{x−m_r}`` as row 3; None without sums."""

    max: Optional[torch.Tensor]
    keys: Optional[torch.Tensor]
    stats: Optional[torch.Tensor]
    columns: Optional[torch.Tensor] = None  # the global column of ``max`` (argmax-only, one rank: no key)


def calculate_local_pass(rows: torch.Tensor, shard: Shard, flat_labels: Optional[torch.Tensor], cdtype: torch.dtype,
                         chunk_size: Optional[int], need_sums: bool, kernel: Optional[str],
                         flag_minus_inf: bool = False, with_keys: bool = True,
                         exps: Optional[torch.Tensor] = None) -> LocalPass:
    """The local pass over this rank's real columns, by the implementation :func:`.choose_kernel` picks
    (the torch loop or the Triton kernel: same outputs, same contract). ``flag_minus_inf``: a token whose
    real columns hold a ``-inf`` gets a NaN maximum, so that its key is non-finite too (the argmax-only pass);
    without ``with_keys`` (one rank: nothing to all-reduce) the columns come unpacked instead of the keys.

    ``exps`` (the fused loss: an fp32 ``[T, V_l]`` buffer, possibly ``rows`` itself) keeps the exponentials
    for a backward: the torch loop then reads every local column, padding included, and writes
    ``e^{x − m_r}`` there (:func:`.torch_local_pass`); the kernel keeps nothing, so it is not chosen."""
    n_tokens, device = rows.shape[0], rows.device
    padding_share = exps is not None and shard.padded  # the sums' reference covers padding columns
    stats = torch.zeros(3 + padding_share, n_tokens, dtype=cdtype, device=device) if need_sums else None
    if shard.n_real == 0 and exps is None:  # this rank holds only padding columns
        return LocalPass(None, torch.full((n_tokens,), key_floor(), dtype=torch.int64, device=device), stats)
    local_labels = flat_labels - shard.start if flat_labels is not None and need_sums else None
    if exps is None and choose_kernel(kernel, rows) == "triton":
        local_max, local_col = triton_local_pass()(rows, shard.n_real, local_labels, stats, need_sums)
        maxima = LocalMaxima(local_max, local_col, local_max)
    else:
        maxima = torch_local_pass(rows, shard.n_real, local_labels, stats, cdtype, chunk_size, need_sums, exps)
    local_max = maxima.max
    if flag_minus_inf:
        local_max = local_max.masked_fill(rows[:, :shard.n_real].amin(dim=-1) == float("-inf"), float("nan"))
    if not with_keys:
        return LocalPass(local_max.to(cdtype), None, stats, maxima.column + shard.start)
    if local_max is None:  # padding columns only, with kept exponentials: no argmax candidate here
        keys = torch.full((n_tokens,), key_floor(), dtype=torch.int64, device=device)
    else:
        keys = encode_key(local_max, maxima.column + shard.start, shard.vocab_size)
    if padding_share:
        keys = torch.stack([keys, encode_key(maxima.reference, torch.zeros_like(keys), shard.vocab_size)])
    return LocalPass(maxima.reference.to(cdtype), keys, stats)


def calculate_global_max(keys: torch.Tensor, shard: Shard) -> tuple[torch.Tensor, torch.Tensor]:
    """Collective 1: all-reduce MAX of the keys; the global maximum ``M`` the sums are rescaled to, and the
    argmax (lowest column on ties). ``M`` is the real columns' maximum, or with ``[2, T]`` keys (a reference
    over padding columns too) the maximum over every column."""
    if shard.group is not None:
        dist.all_reduce(keys, op=dist.ReduceOp.MAX, group=shard.group)
    if keys.dim() == 1:
        return decode_key(keys, shard.vocab_size)
    argmax = decode_key(keys[0], shard.vocab_size)[1]
    return decode_key(keys[1], shard.vocab_size)[0], argmax


class GlobalSums(NamedTuple):
    """The sums of every rank relative to ``M`` (:func:`calculate_global_sums`), and this rank's
    ``e^{m_r − M}`` (None on a rank without a maximum), which turns its own ``e^{x − m_r}`` into ``e^{x − M}``."""

    sums: torch.Tensor
    scale: Optional[torch.Tensor]


def calculate_global_sums(local: LocalPass, reference: torch.Tensor, shard: Shard) -> GlobalSums:
    """Rescale this rank's sums to the global maximum ``M`` (``δ = m_r − M``), then collective 2: all-reduce
    SUM of the packed ``[3 or 4, T]`` buffer, giving ``Z``, ``Σ e^{x−M}(x−M)``, the label's logit (and the
    padding columns' share)."""
    stats, scale = local.stats, None
    if local.max is not None:  # (delta == 0 without a group, except for float64's float32 key)
        delta = local.max - reference
        scale = torch.exp(delta)
        s0, s1 = stats[0], stats[1]
        s1.addcmul_(delta, s0).mul_(scale)
        s0.mul_(scale)
        if stats.shape[0] > 3:
            stats[3].mul_(scale)
    if shard.group is not None:
        dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=shard.group)
    return GlobalSums(stats, scale)


class Epilogue(NamedTuple):
    """The per-token results of :func:`calculate_epilogue`, ``[T]`` each."""

    log_z: torch.Tensor
    """``log Z`` over the true vocabulary."""
    entropy: torch.Tensor
    label_logit: Optional[torch.Tensor]
    """``x_y − M`` (``−M`` where no rank owns ``y``); None without labels."""
    logprobs: Optional[torch.Tensor]
    """``log p(y)``, with the NaN and ``ignore_index`` rules; None without labels."""


def calculate_epilogue(sums: torch.Tensor, reference: torch.Tensor, flat_labels: Optional[torch.Tensor],
                       vocab_size: int, ignore_index: int) -> Epilogue:
    """From the global sums relative to ``M``: ``H = log Z − S1 / Z`` (two non-negative terms: no
    cancellation; NaN for a non-finite logit) and ``log p(y) = (x_y − M) − log Z``, NaN for a label outside
    ``[0, V)`` or a token whose entropy is not finite, 0 for ``ignore_index`` (which wins)."""
    log_z = torch.log(sums[0])
    entropy = log_z - sums[1] / sums[0]
    if flat_labels is None:
        return Epilogue(log_z, entropy, None, None)
    cdtype, device = sums.dtype, sums.device
    label_logit = sums[2] - reference
    valid = (flat_labels >= 0) & (flat_labels < vocab_size) & torch.isfinite(entropy)
    logprobs = torch.where(valid, label_logit - log_z, torch.full((), float("nan"), dtype=cdtype, device=device))
    logprobs = torch.where(flat_labels == ignore_index, torch.zeros((), dtype=cdtype, device=device), logprobs)
    return Epilogue(log_z, entropy, label_logit, logprobs)
