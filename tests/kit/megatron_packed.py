"""Packed sequences (THD) through the tiny megatron-core GPTModel on CPU (test support).

megatron-core runs packed sequences only through Transformer Engine's attention
(its local ``DotProductAttention`` asserts ``packed_seq_params is None``), which
cannot run on CPU. ``PackedSequenceAttention`` is the test's stand-in core
attention: given ``packed_seq_params`` (``qkv_format='thd'``: megatron's
``Attention`` hands it ``[t, heads, dim]``), it runs Megatron's
``DotProductAttention`` on the row with a causal mask that is block-diagonal over
the sequences of ``cu_seqlens_q_padded``, so every token attends to the earlier
tokens of its own sequence only: each packed sequence computes exactly what it
computes alone. Everything else (embeddings, MLPs, the output layer, the loss,
the schedules, instrument()'s hooks) is megatron-core's own code.

Under context parallelism each rank holds its pieces of every packed sequence
(megatron-core's THD split: chunks ``i`` and ``2·cp−1−i`` of each sequence,
``twinkle_megatron.testing.batches.thd_positions``); the stand-in then gathers q/k/v over the CP
group into the whole row, attends there and keeps this rank's rows (exact, like
``kit.megatron_gpt.GatherContextParallelAttention`` for unpacked rows).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.dot_product_attention import DotProductAttention

from kit.megatron_gpt import GatherContextParallelAttention, layer_spec
from twinkle_megatron.testing.batches import thd_positions


class PackedSequenceAttention(GatherContextParallelAttention):
    """``DotProductAttention`` with a block-diagonal causal mask for THD rows (see the module docstring); unpacked
    rows as :class:`GatherContextParallelAttention` attends them."""

    def forward(self, query, key, value, attention_mask, *args: Any, packed_seq_params=None, **kwargs: Any):
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, *args, **kwargs)
        cp_size = dist.get_world_size(self.cp_group) if dist.is_initialized() else 1
        local = None
        if cp_size > 1:  # this rank's pieces of every sequence -> the whole row
            padded = packed_seq_params.cu_seqlens_q_padded.long().cpu()
            pieces = [thd_positions(padded, cp_size, rank) for rank in range(cp_size)]
            local = pieces[dist.get_rank(self.cp_group)].to(query.device)
            order = torch.argsort(torch.cat(pieces)).to(query.device)
            query, key, value = (_GatherRows.apply(t, self.cp_group, order, local) for t in (query, key, value))
        query, key, value = (t.unsqueeze(1) for t in (query, key, value))  # [t, 1, heads, dim]
        context = DotProductAttention.forward(self, query, key, value,
                                              thd_attention_mask(packed_seq_params, query.size(0)), *args, **kwargs)
        return context if local is None else context.index_select(0, local)


class _GatherRows(torch.autograd.Function):
    """All-gather the CP ranks' rows along dim 0 and put them in the whole row's order; backward sums the
    gradient over the CP group and keeps this rank's rows."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, order: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        ctx.group, ctx.local = group, local
        return torch.cat(parts, 0).index_select(0, order)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad.index_select(0, ctx.local), None, None, None


def thd_attention_mask(params: PackedSeqParams, length: int) -> torch.Tensor:
    """``[1, 1, t, t]``, True = masked: a token sees the earlier tokens of its own packed sequence."""
    bounds = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
    positions = torch.arange(length)
    sequence = torch.searchsorted(bounds.long().cpu()[1:], positions, right=True)
    visible = (sequence[:, None] == sequence[None, :]) & (positions[None, :] <= positions[:, None])
    return ~visible[None, None].to(bounds.device)


def packed_layer_spec(config: TransformerConfig):
    """The kit's local layer spec (under CP too) with :class:`PackedSequenceAttention` as the core attention."""
    spec = copy.deepcopy(layer_spec(config))
    spec.submodules.self_attention.submodules.core_attention = PackedSequenceAttention
    return spec


def packed_seq_params(cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor) -> PackedSeqParams:
    """megatron-core's ``PackedSeqParams`` of one THD row (as ``get_thd_batch_on_this_cp_rank`` builds them)."""
    max_length = int((cu_seqlens_padded[1:] - cu_seqlens_padded[:-1]).max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens.int(), cu_seqlens_kv=cu_seqlens.int(),
                           cu_seqlens_q_padded=cu_seqlens_padded.int(), cu_seqlens_kv_padded=cu_seqlens_padded.int(),
                           max_seqlen_q=max_length, max_seqlen_kv=max_length)
