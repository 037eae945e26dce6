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

**One pass, two collectives: the statistics' own steps** (:mod:`.token_stats`),
with the exponentials kept. The local pass (fp32 arithmetic: bf16 and fp16 are
upcast, like Megatron's ``.float()``) reads the label's logit and the argmax first,
then writes :math:`e = e^{x - m_r}` into the saved buffer: the logits themselves
for fp32 logits (Megatron's cross-entropy overwrites them too), an fp32 copy
otherwise (Megatron's ``.float()`` copy) — the same memory Megatron saves for its
backward, plus one ``[chunk, V_l]`` work buffer. Since the loss covers the padding
columns, the pass reads them too: :math:`m_r` is the maximum over every local
column, and with a padded vocabulary the sums gain
:math:`P = \sum_{v \ge V} e^{x_v - m_r}`. **Collective 1** (all-reduce MAX) carries
the argmax keys and, with padding, the key of :math:`m_r`, so that :math:`M` is
the maximum over all columns, as in Megatron's loss; the **rescale** and
**collective 2** (all-reduce SUM) give :math:`Z_V`, :math:`\sum_{v<V} e^{x_v-M}(x_v-M)`,
:math:`x_y` and :math:`P`; the statistics' **epilogue** gives the entropy, the
log-prob and :math:`x_y - M`; :math:`Z = Z_V + P`. Megatron's cross-entropy alone
takes three collectives (max, label logit, sum of exps), and the statistics two more.
The fused Triton kernel of the statistics keeps no exponentials: this pass is
the torch loop's.

**Backward**, from the saved :math:`e` and the per-token factor
:math:`c = e^{m_r - M}/Z` (one pass, in place, as Megatron's):

.. math::

    \frac{\partial L}{\partial x_v} = g\,(c\,e_v - [v = y]), \qquad g = \frac{\partial L}{\partial \ell}.

Nothing here synchronises with the host; the collectives' sizes are shapes.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from .shard import Shard, as_token_rows, restore_layout, token_order
from .token_stats import (
    TokenStats,
    calculate_epilogue,
    calculate_global_max,
    calculate_global_sums,
    calculate_local_pass,
    check_token_stats_inputs,
)

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
    check_token_stats_inputs(logits, labels, chunk_size)
    if not logits.dtype.is_floating_point:
        raise TypeError(f"logits must be a floating-point tensor, got {logits.dtype}")
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
        exps = rows if rows.dtype == torch.float32 else torch.empty(rows.shape, dtype=torch.float32,
                                                                      device=rows.device)
        local = calculate_local_pass(rows, shard, flat_labels, torch.float32, chunk_size, need_sums=True, kernel=None,
                                     exps=exps)
        reference, argmax = calculate_global_max(local.keys, shard)  # collective 1
        sums, scale = calculate_global_sums(local, reference, shard)  # rescale, collective 2
        epilogue = calculate_epilogue(sums, reference, flat_labels, shard.vocab_size, ignore_index)

        # Megatron's loss, over every column: Z with the padding's share, x_y - M wherever some rank owns y.
        z_all = sums[0] + sums[3] if shard.padded else sums[0]
        log_z_all = torch.log(z_all) if shard.padded else epilogue.log_z
        in_range = (flat_labels >= 0) & (flat_labels < shard.v_local * shard.tp)
        loss = log_z_all - torch.where(in_range, epilogue.label_logit, torch.zeros((), device=z_all.device))

        # A view made here cannot be saved: the logits themselves are, when they hold the exponentials.
        in_logits = exps is rows and rows.untyped_storage().data_ptr() == logits.untyped_storage().data_ptr()
        # The labels' local columns, a tensor of our own (the caller's labels may change before the backward).
        ctx.save_for_backward(logits if in_logits else exps, scale / z_all, flat_labels - shard.start)
        ctx.layout = (tuple(logits.shape), order, in_logits)
        ctx.mark_non_differentiable(argmax, epilogue.logprobs, epilogue.entropy)
        return tuple(restore_layout(t, lead_shape, order)
                     for t in (loss, argmax, epilogue.logprobs, epilogue.entropy))

    @staticmethod
    def backward(ctx, grad_loss, *unused):  # noqa: D102
        exps, factor, local_labels = ctx.saved_tensors
        shape, order, in_logits = ctx.layout
        if in_logits:
            exps = as_token_rows(exps)[0]
        grad = token_order(grad_loss, order).to(torch.float32)
        # softmax - one_hot, times the incoming gradient, in place in the saved exponentials (like Megatron).
        exps.mul_((factor * grad).unsqueeze(1))
        owned = (local_labels >= 0) & (local_labels < exps.shape[1])
        rows = torch.arange(exps.shape[0], device=exps.device)
        exps.index_put_((rows, local_labels.clamp(0, exps.shape[1] - 1)),
                        torch.where(owned, grad, torch.zeros((), device=grad.device)).neg(), accumulate=True)
        permuted = [shape[d] for d in order] + [shape[-1]]
        grad_logits = exps.view(permuted)
        if order != tuple(range(len(order))):
            inverse = sorted(range(len(order)), key=lambda d: order[d])
            grad_logits = grad_logits.permute(*inverse, len(order))
        return grad_logits, None, None, None, None, None
