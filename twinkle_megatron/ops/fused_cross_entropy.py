r"""Megatron's vocab-parallel cross-entropy and the token statistics from one pass, two collectives.

Rank :math:`r` of the tensor-parallel ``group`` holds the logits of global
columns :math:`[rV_l, (r+1)V_l)`; :math:`V_p = tp\cdot V_l` columns exist
(Megatron's padded vocabulary), of which the first :math:`V` are tokens
(``vocab_size``). For a token with label :math:`y`:

**The loss** is Megatron's (``tensor_parallel.vocab_parallel_cross_entropy``,
no label smoothing), over *all* :math:`V_p` columns, padding included, as the
model trains:

.. math::

    M = \max_{v < V_p} x_v, \qquad Z = \sum_{v < V_p} e^{x_v - M}, \qquad
    \ell = \log Z - [0 \le y < V_p]\,(x_y - M)

(a label outside :math:`[0, V_p)`, e.g. ``-100``, gets :math:`\log Z`, like
Megatron's; the loss mask removes it), and its gradient is Megatron's

.. math::

    \frac{\partial \ell}{\partial x_v} = \operatorname{softmax}(x)_v - [v = y].

**The statistics** are :func:`.token_stats.vocab_parallel_token_stats`'s, over
the true vocabulary :math:`v < V` (padding never wins the argmax and carries no
probability): argmax, :math:`\log p(y) = x_y - M - \log Z_V` and
:math:`H = \log Z_V - \frac{1}{Z_V}\sum_{v<V} e^{x_v-M}(x_v - M)` with
:math:`Z_V = \sum_{v<V} e^{x_v-M}` (both are invariant to the reference
:math:`M`, so one reference serves the loss and the statistics).

**One pass** over the shard, ``chunk_size`` tokens at a time, in fp32 (bf16 and
fp16 are upcast, like Megatron's ``.float()``): the local maximum
:math:`m_r` over all local columns (and, over the true ones, the block maxima
for the argmax and the label's logit, read before anything is overwritten),
then :math:`d = x - m_r`, :math:`e = e^{d}` and

.. math::

    S_0 = \sum_{v<V} e, \quad S_1 = \sum_{v<V} e\,d, \quad P = \sum_{v \ge V} e

(:math:`P` only when the vocabulary is padded). :math:`e` is written into the
saved buffer: the logits themselves for fp32 logits (Megatron's cross-entropy
overwrites them too), an fp32 copy otherwise (Megatron's ``.float()`` copy) —
the same memory Megatron saves for its backward, plus one ``[chunk, V_l]`` work
buffer.

**Collective 1**: all-reduce MAX of the int64 argmax keys of :mod:`.shard`
(and, with padding, in the same buffer, the key of :math:`m_r` itself, so that
:math:`M` is the maximum over all columns, as in Megatron's loss).
**Collective 2**: all-reduce SUM of :math:`e^{\delta}S_0`,
:math:`e^{\delta}(S_1 + \delta S_0)`, :math:`x_y` (from its owner) and
:math:`e^{\delta}P`, :math:`\delta = m_r - M \le 0`. Megatron's cross-entropy
alone takes three (max, label logit, sum of exps), and the statistics two more.

**Backward**, from the saved :math:`e` and the per-token factor
:math:`c = e^{\delta}/Z` (one pass, in place, as Megatron's):

.. math::

    \frac{\partial L}{\partial x_v} = g\,(c\,e_v - [v = y]), \qquad g = \frac{\partial L}{\partial \ell}.

Nothing here synchronises with the host; the collectives' sizes are shapes.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from .shard import (
    Shard,
    as_token_rows,
    block_width,
    decode_key,
    default_chunk_size,
    encode_key,
    key_floor,
    restore_layout,
    token_order,
)
from .token_stats import TokenStats
from .torch_local_pass import first_max_column

__all__ = ["LossAndStats", "vocab_parallel_cross_entropy_with_stats"]


class LossAndStats(NamedTuple):
    """Per-token loss (differentiable) and statistics, each of shape ``logits.shape[:-1]``."""

    loss: torch.Tensor
    stats: TokenStats


def vocab_parallel_cross_entropy_with_stats(logits: torch.Tensor, labels: torch.Tensor,
                                            group: Optional[dist.ProcessGroup] = None,
                                            vocab_size: Optional[int] = None, ignore_index: int = -100,
                                            chunk_size: Optional[int] = None) -> LossAndStats:
    """Megatron's vocab-parallel cross-entropy of ``logits`` (with its gradient) and the token statistics.

    Args:
        logits: this rank's vocabulary shard ``[..., V_local]`` (Megatron's ``[s, b, V/tp]``);
            fp32 logits are **overwritten** with their exponentials (as Megatron's cross-entropy does).
        labels: global vocabulary ids of shape ``logits.shape[:-1]``.
        group: the tensor-parallel group; None or one rank: the whole vocabulary is local.
        vocab_size: the true vocabulary of the statistics (default: every column); the loss always
            covers every column, like Megatron's.
        ignore_index: labels equal to it get log-prob 0 in the statistics (the loss is Megatron's).
        chunk_size: tokens per chunk of the pass (bounds the work buffer).

    Returns:
        :class:`LossAndStats`: ``loss`` (float32, with grad) and :class:`TokenStats`.

    >>> import torch
    >>> from twinkle_megatron.ops.fused_cross_entropy import vocab_parallel_cross_entropy_with_stats
    >>> logits = torch.tensor([[0.0, 1.0, 2.0]], requires_grad=True)
    >>> loss, stats = vocab_parallel_cross_entropy_with_stats(logits.clone(), torch.tensor([2]))
    >>> round(loss.item(), 4), stats.argmax.tolist(), round(stats.logprobs.item(), 4)
    (0.4076, [2], -0.4076)
    """
    if not isinstance(logits, torch.Tensor) or not logits.dtype.is_floating_point or logits.dim() < 1:
        raise TypeError("logits must be a floating-point tensor with a vocabulary dimension")
    if not isinstance(labels, torch.Tensor) or labels.shape != logits.shape[:-1]:
        raise ValueError(f"labels must be a tensor of shape {tuple(logits.shape[:-1])}, got "
                         f"{tuple(labels.shape) if isinstance(labels, torch.Tensor) else type(labels).__name__}")
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise TypeError(f"labels must be an integer tensor, got {labels.dtype}")
    loss, argmax, logprobs, entropy = _FusedCrossEntropy.apply(logits, labels, group, vocab_size, ignore_index,
                                                               chunk_size)
    return LossAndStats(loss, TokenStats(argmax, logprobs, entropy))


class _FusedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, group, vocab_size, ignore_index, chunk_size):  # noqa: D102
        shard = Shard(logits.shape[-1], group, vocab_size)
        lead_shape = logits.shape[:-1]
        rows, order = as_token_rows(logits)
        flat_labels = token_order(labels, order).to(device=logits.device, dtype=torch.int64)
        padded = shard.vocab_size < shard.v_local * shard.tp  # the same on every rank (shapes)
        exps = rows if rows.dtype == torch.float32 else torch.empty(rows.shape, dtype=torch.float32,
                                                                      device=rows.device)
        local = _local_pass(rows, exps, flat_labels - shard.start, shard.n_valid, padded, chunk_size)
        keys = local.keys(shard)

        # Collective 1: argmax keys (and the all-column maxima when the vocabulary is padded).
        if shard.group is not None:
            dist.all_reduce(keys, op=dist.ReduceOp.MAX, group=shard.group)
        valid_max, argmax = decode_key(keys[0], shard.vocab_size)
        reference = decode_key(keys[1], shard.vocab_size)[0] if padded else valid_max
        delta = local.reference_max - reference  # <= 0
        scale = torch.exp(delta)
        sums = local.sums
        sums[1].addcmul_(delta, sums[0]).mul_(scale)
        sums[0].mul_(scale)
        if padded:
            sums[3].mul_(scale)
        # Collective 2: Z_V, sum e(x - M) over the true vocabulary, the label's logit, the padding's share.
        if shard.group is not None:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=shard.group)

        z_true = sums[0]
        z_all = z_true + sums[3] if padded else z_true
        label_logit = sums[2] - reference  # x_y - M where some rank owns y
        in_range = (flat_labels >= 0) & (flat_labels < shard.v_local * shard.tp)
        loss = torch.log(z_all) - torch.where(in_range, label_logit, torch.zeros((), device=z_all.device))

        log_z = torch.log(z_true)
        entropy = log_z - sums[1] / z_true
        valid = (flat_labels >= 0) & (flat_labels < shard.vocab_size) & torch.isfinite(entropy)
        logprobs = torch.where(valid, label_logit - log_z, torch.full((), float("nan"), device=log_z.device))
        logprobs = torch.where(flat_labels == ignore_index, torch.zeros((), device=log_z.device), logprobs)

        owned = (local.local_labels >= 0) & (local.local_labels < shard.v_local)
        # A view made here cannot be saved: the logits themselves are, when they hold the exponentials.
        in_logits = exps.untyped_storage().data_ptr() == logits.untyped_storage().data_ptr()
        ctx.save_for_backward(logits if in_logits else exps, scale / z_all,
                              local.local_labels.clamp(0, shard.v_local - 1), owned)
        ctx.layout = (tuple(logits.shape), order, in_logits)
        ctx.mark_non_differentiable(argmax, logprobs, entropy)
        return tuple(restore_layout(t, lead_shape, order) for t in (loss, argmax, logprobs, entropy))

    @staticmethod
    def backward(ctx, grad_loss, *unused):  # noqa: D102
        exps, factor, columns, owned = ctx.saved_tensors
        shape, order, in_logits = ctx.layout
        if in_logits:
            exps = as_token_rows(exps)[0]
        grad = token_order(grad_loss, order).to(torch.float32)
        # softmax - one_hot, times the incoming gradient, in place in the saved exponentials (like Megatron).
        exps.mul_((factor * grad).unsqueeze(1))
        rows = torch.arange(exps.shape[0], device=exps.device)
        exps.index_put_((rows, columns), torch.where(owned, grad, torch.zeros((), device=grad.device)).neg(),
                        accumulate=True)
        permuted = [shape[d] for d in order] + [shape[-1]]
        grad_logits = exps.view(permuted)
        if order != tuple(range(len(order))):
            inverse = sorted(range(len(order)), key=lambda d: order[d])
            grad_logits = grad_logits.permute(*inverse, len(order))
        return grad_logits, None, None, None, None, None


class _LocalPass(NamedTuple):
    valid_max: Optional[torch.Tensor]  # per token, over the true columns (None: this rank holds none)
    valid_column: Optional[torch.Tensor]  # its first local column
    reference_max: torch.Tensor  # over every local column
    sums: torch.Tensor  # [3 or 4, T]: S0, S1 (true columns), label logit, padding share
    local_labels: torch.Tensor

    def keys(self, shard: Shard) -> torch.Tensor:
        """``[1 or 2, T]`` int64: the argmax key, and with padding the key of the all-column maximum."""
        n_tokens = self.reference_max.shape[0]
        if self.valid_max is None:
            argmax_key = torch.full((n_tokens,), key_floor(), dtype=torch.int64, device=self.reference_max.device)
        else:
            argmax_key = encode_key(self.valid_max, self.valid_column + shard.start, shard.vocab_size)
        if self.sums.shape[0] == 3:
            return argmax_key.unsqueeze(0)
        zero = torch.zeros_like(argmax_key)
        return torch.stack([argmax_key, encode_key(self.reference_max, zero, shard.vocab_size)])


def _local_pass(rows: torch.Tensor, exps: torch.Tensor, local_labels: torch.Tensor, n_valid: int, padded: bool,
                chunk_size: Optional[int]) -> _LocalPass:
    """One read of ``rows [T, V_l]``: maxima, argmax column, label logit; ``exps`` ← e^{x - m_r}; the sums."""
    n_tokens, n_cols = rows.shape
    device = rows.device
    chunk_size = min(chunk_size or default_chunk_size(device, n_cols), max(n_tokens, 1))
    width = block_width(n_valid)
    sums = torch.zeros(4 if padded else 3, n_tokens, dtype=torch.float32, device=device)
    valid_max = torch.empty(n_tokens, dtype=torch.float32, device=device) if n_valid else None
    valid_column = torch.empty(n_tokens, dtype=torch.int64, device=device) if n_valid else None
    reference_max = torch.empty(n_tokens, dtype=torch.float32, device=device)
    owned = (local_labels >= 0) & (local_labels < n_cols)
    # The label's logit, read before the rows are overwritten (fp32 logits hold the exponentials after).
    picked = rows.gather(1, local_labels.clamp(0, n_cols - 1).unsqueeze(1)).squeeze(1).to(torch.float32)
    torch.where(owned, picked, torch.zeros((), device=device), out=sums[2])
    work = torch.empty(chunk_size, n_cols, dtype=torch.float32, device=device)
    for start in range(0, n_tokens, chunk_size):
        stop = min(start + chunk_size, n_tokens)
        x, e, d = rows[start:stop], exps[start:stop], work[:stop - start]
        if x.dtype != torch.float32:  # bf16/fp16/fp64: computed in fp32 like Megatron's .float()
            x = e.copy_(x)
        m = reference_max[start:stop]
        if n_valid:
            true_columns = x[:, :n_valid]
            if width:
                n_full = n_valid // width
                table = torch.amax(true_columns[:, :n_full * width].unflatten(-1, (n_full, width)), dim=-1)
                if n_full * width < n_valid:
                    table = torch.cat([table, torch.amax(true_columns[:, n_full * width:], dim=-1, keepdim=True)], 1)
                torch.amax(table, dim=-1, out=valid_max[start:stop])
                valid_column[start:stop] = first_max_column(true_columns, table, width, stop - start)
            else:
                torch.amax(true_columns, dim=-1, out=valid_max[start:stop])
                valid_column[start:stop] = true_columns.argmax(dim=-1)
            if n_valid < n_cols:
                torch.maximum(valid_max[start:stop], torch.amax(x[:, n_valid:], dim=-1), out=m)
            else:
                m.copy_(valid_max[start:stop])
        else:
            torch.amax(x, dim=-1, out=m)
        torch.sub(x, m.unsqueeze(1), out=d)  # d = x - m_r (x read for the last time)
        torch.exp(d, out=e)  # e = e^{x - m_r}: overwrites fp32 logits
        d.mul_(e)
        torch.sum(e[:, :n_valid], dim=-1, out=sums[0, start:stop])
        torch.sum(d[:, :n_valid], dim=-1, out=sums[1, start:stop])
        if padded:
            torch.sum(e[:, n_valid:], dim=-1, out=sums[3, start:stop])
    return _LocalPass(valid_max, valid_column, reference_max, sums, local_labels)
