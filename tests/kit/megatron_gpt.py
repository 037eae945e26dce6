"""A tiny real megatron-core ``GPTModel`` on CPU ranks, and one training step through Megatron's schedules.

Test support for checking code that hooks into Megatron training (metrics in
``forward_step``) against a single-process reference. Use inside a worker of
``twinkle_megatron.testing.distributed`` (parallel_state initialised) and inside
``twinkle_megatron.testing.cuda_shim.cpu_cuda_shim()``::

    spec = GPTSpec()
    batch = make_batch(spec, global_batch_size=8)           # identical on every rank (seeded)
    with cpu_cuda_shim():
        chunks = build_gpt_model(spec)                      # this rank's TP shard / PP stage / VPP chunks
        reports = run_forward_backward(chunks, batch, micro_batch_size=2)

What the helpers guarantee:

- **Layout-independent weights.** Every parameter of the *full* model is drawn from
  its own generator, seeded by ``(spec.seed, canonical name)`` where the canonical
  name is the parameter's name in the single-process model (local layer index
  replaced by the global one, from ``TransformerLayer.layer_number``). Each rank draws
  the full tensor and keeps its tensor-parallel shard (``tp_shard``: Megatron's
  ``partition_dim`` / ``partition_stride`` layout). So a TP×PP×VPP×CP×DP model and the
  world-1 model are the same function, for the same spec.
- **Hooks.** ``run_forward_backward`` takes any Megatron ``forward_step_func``;
  ``gpt_forward_step`` takes a ``logits_hook(logits, microbatch)`` that sees this rank's
  vocab-parallel logits of each microbatch, and a ``loss_func``. Extra ``[b, s]`` entries
  of the batch ride along through the DP/CP split into the microbatch.
- **Megatron's data layout.** The global batch is split the way Megatron-LM's
  pretraining sampler does it (microbatch ``m`` of data-parallel rank ``d`` holds
  sequences ``(m·dp + d)·mbs … +mbs``), and, under context parallelism, the sequence
  is split like ``get_batch_on_this_cp_rank``: CP rank ``i`` holds chunks ``i`` and
  ``2·cp−1−i`` of ``2·cp``.
- **Megatron's loss convention.** ``lm_loss_func`` is Megatron-LM's per-token loss
  function: it returns ``(loss_sum, num_tokens, {'lm loss': [loss_sum, num_tokens]})``
  and the config has ``calculate_per_token_loss=True``.

Limitations (megatron-core 0.16.1, local layer spec): the local ``DotProductAttention``
asserts ``context_parallel_size == 1`` (context parallelism is TE-only). For CP>1 the
layer spec gets ``GatherContextParallelAttention``, a test-only stand-in that gathers
q/k/v over the CP group and runs Megatron's own ``DotProductAttention`` on the whole
sequence (exact, not ring attention). Learned absolute position embeddings only (no RoPE);
tied input/output embeddings are not supported; no sequence parallelism, MoE or MTP.
Gradients are left as the schedule leaves them: not reduced over data/context-parallel
ranks (no ``finalize_model_grads_func``; pass one through ``make_config`` overrides, or
wrap the chunks in Megatron's DDP, which also runs under the shim).
"""

from __future__ import annotations

import copy
import inspect
import zlib
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    model_parallel_cuda_manual_seed,
)
from megatron.core.transformer import TransformerConfig, transformer_block
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.utils import get_attr_wrapped_model

from twinkle_megatron.testing.batches import cp_positions, cp_slice

__all__ = [
    "GPTSpec",
    "GatherContextParallelAttention",
    "build_gpt_model",
    "canonical_names",
    "full_parameter",
    "gpt_forward_step",
    "layer_spec",
    "lm_loss_func",
    "load_layout_independent_weights",
    "local_microbatches",
    "make_batch",
    "make_config",
    "reference_forward",
    "run_forward_backward",
    "pool_loss_reports",
    "reference_metrics",
    "sum_loss_reports",
    "tp_shard",
]


@dataclass(frozen=True)
class GPTSpec:
    """The layout-independent description of the tiny model. ``vocab_size`` is the (padded) size the
    model is built with: keep it a multiple of every TP size you test."""

    num_layers: int = 4
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_query_groups: Optional[int] = None  # None: multi-head attention; else GQA with this many groups
    ffn_hidden_size: Optional[int] = None  # None: 4 × hidden_size
    vocab_size: int = 64
    max_sequence_length: int = 16
    gated_linear_unit: bool = False  # True: gated fc1 = [gate; up] (GeGLU with the default gelu)
    add_bias_linear: bool = True
    seed: int = 1234
    init_std: float = 0.2


# --------------------------------------------------------------------------------------------------
# Model


def make_config(spec: GPTSpec, **overrides: Any) -> TransformerConfig:
    """A CPU/fp32 ``TransformerConfig`` for ``spec`` with the sizes of the initialised parallel_state.

    Dropout is off (the step is deterministic); ``batch_p2p_comm`` is off under virtual pipelining
    (on gloo the interleaved schedule gives wrong results with batched p2p). ``overrides`` win.
    """
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    kwargs: dict[str, Any] = dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        ffn_hidden_size=spec.ffn_hidden_size,
        gated_linear_unit=spec.gated_linear_unit,
        add_bias_linear=spec.add_bias_linear,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=parallel_state.get_context_parallel_world_size(),
        use_cpu_initialization=True,
        # perform_initialization stays True: Megatron's CPU init is what marks the sharded weights
        # (tensor_model_parallel / partition_dim); the values are then overwritten.
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        calculate_per_token_loss=True,
        batch_p2p_comm=vpp is None,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


class SequenceParallelLayerNorm(torch.nn.LayerNorm):
    """Test-only: a torch LayerNorm usable with sequence parallelism.

    Megatron's local norm refuses ``sequence_parallel`` (its TE/Apex norms mark their
    weights so that the partial gradients of each TP rank's sequence slice get summed);
    this one marks them the same way (``param.sequence_parallel``).
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5):
        super().__init__(hidden_size, eps=eps)
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel


def layer_spec(config: TransformerConfig):
    """Megatron's local (non-TE) GPT layer spec; under CP>1 with the gathering CP attention, under
    sequence parallelism with ``SequenceParallelLayerNorm``."""
    spec = get_gpt_layer_local_spec()
    if config.context_parallel_size > 1 or config.sequence_parallel:
        spec = copy.deepcopy(spec)
    if config.context_parallel_size > 1:
        spec.submodules.self_attention.submodules.core_attention = GatherContextParallelAttention
    if config.sequence_parallel:
        spec.submodules.input_layernorm = SequenceParallelLayerNorm
        spec.submodules.pre_mlp_layernorm = SequenceParallelLayerNorm
    return spec


def build_gpt_model(spec: GPTSpec, *, config: Optional[TransformerConfig] = None,
                    layer_spec_fn: Callable[[TransformerConfig], Any] = layer_spec) -> list[GPTModel]:
    """This rank's model chunks (one per virtual pipeline stage; one without VPP) with the
    layout-independent weights of ``spec``. Call with parallel_state initialised, inside the shim.

    Seeds Megatron's RNG tracker with ``model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)``
    (the plain call needs CUDA; the inference tracker's ``fork()`` is a no-op, fine without dropout).
    """
    config = config or make_config(spec)
    seed_kwargs = {"inference_rng_tracker": True}
    if "force_reset_rng" in inspect.signature(model_parallel_cuda_manual_seed).parameters:
        seed_kwargs["force_reset_rng"] = True  # a tracker inherited from the parent would need CUDA
    model_parallel_cuda_manual_seed(spec.seed, **seed_kwargs)
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    chunks = []
    # The final norm comes from transformer_block.LayerNormImpl, not from the layer spec.
    final_norm = transformer_block.LayerNormImpl
    if config.sequence_parallel:
        transformer_block.LayerNormImpl = SequenceParallelLayerNorm
    try:
        for vp_stage in range(vpp or 1):
            chunks.append(_build_chunk(spec, config, layer_spec_fn, vp_stage if vpp else None))
    finally:
        transformer_block.LayerNormImpl = final_norm
    return chunks


def _build_chunk(spec: GPTSpec, config: TransformerConfig, layer_spec_fn: Callable[[TransformerConfig], Any],
                 stage: Optional[int]) -> GPTModel:
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec_fn(config),
        vocab_size=spec.vocab_size,
        max_sequence_length=spec.max_sequence_length,
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
        share_embeddings_and_output_weights=False,
        position_embedding_type="learned_absolute",
        vp_stage=stage,
    )
    _label_gated_fc1(model, config)
    load_layout_independent_weights(model, spec)
    return model


def _label_gated_fc1(model: GPTModel, config: TransformerConfig) -> None:
    """Mark a gated fc1 ``[gate; up]`` with its stride 2 where megatron-core does not.

    Every release lays the gated fc1 out the same way on a TP rank (``[gate_r; up_r]``: the MLP
    chunks its local output in two), but only 0.16 and later label it ``partition_stride=2``;
    earlier ones leave the default 1. Labelling it here lets ``tp_shard`` read one layout.
    """
    if not config.gated_linear_unit:
        return
    for name, param in model.named_parameters():
        if ".mlp.linear_fc1." in f".{name}" and getattr(param, "tensor_model_parallel", False) \
                and getattr(param, "partition_stride", 1) == 1:
            param.partition_stride = 2


def canonical_names(model: torch.nn.Module) -> dict[str, str]:
    """Local parameter name -> its name in the single-process model (global transformer layer index)."""
    model = get_attr_wrapped_model(model, "decoder", return_model_obj=True)
    layer_index = {}
    if getattr(model, "decoder", None) is not None:
        for local, layer in enumerate(model.decoder.layers):
            layer_index[f"decoder.layers.{local}."] = f"decoder.layers.{layer.layer_number - 1}."
    names = {}
    for name, _ in model.named_parameters():
        canonical = name
        for local_prefix, global_prefix in layer_index.items():
            if name.startswith(local_prefix):
                canonical = global_prefix + name[len(local_prefix):]
                break
        names[name] = canonical
    return names


def full_parameter(spec: GPTSpec, name: str, shape: Sequence[int]) -> torch.Tensor:
    """The full (unsharded) value of parameter ``name`` (canonical name) of the ``spec`` model.

    Depends only on (seed, name, shape): norm weights ``1 + 0.1·N(0,1)``, everything else
    ``init_std·N(0,1)`` (biases included, so sharded biases are tested too).
    """
    gen = torch.Generator().manual_seed(spec.seed * 1_000_003 + zlib.crc32(name.encode()))
    values = torch.randn(tuple(shape), generator=gen, dtype=torch.float64)
    parts = name.split(".")
    if len(parts) > 1 and "norm" in parts[-2] and parts[-1] == "weight":
        return (1.0 + 0.1 * values).float()
    return (spec.init_std * values).float()


def tp_shard(full: torch.Tensor, param: torch.nn.Parameter, tp_size: Optional[int] = None,
             tp_rank: Optional[int] = None) -> torch.Tensor:
    """This TP rank's part of ``full``, the full (single-process) value of local parameter ``param``.

    Megatron's layout: a sharded parameter (``tensor_model_parallel``) is cut along ``partition_dim``
    into ``tp × partition_stride`` equal blocks and rank ``r`` holds blocks ``r, r + tp, …`` in order.
    Stride 1 is a contiguous block (ColumnParallel QKV — stored group-major ``[groups, (heads/group + 2)
    · head_dim]``, so a block is whole query groups —, RowParallel proj/fc2, VocabParallelEmbedding, the
    output layer); a gated fc1 ``[gate; up]`` has stride 2, so each rank holds ``[gate_r; up_r]``.
    Sizes default to parallel_state's."""
    tp_size = parallel_state.get_tensor_model_parallel_world_size() if tp_size is None else tp_size
    tp_rank = parallel_state.get_tensor_model_parallel_rank() if tp_rank is None else tp_rank
    if tp_size == 1 or not getattr(param, "tensor_model_parallel", False):
        return full
    stride = getattr(param, "partition_stride", 1)
    blocks = full.chunk(tp_size * stride, param.partition_dim)
    return torch.cat(blocks[tp_rank::tp_size], param.partition_dim)


_SHARDED_MODULES = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)


@torch.no_grad()
def load_layout_independent_weights(model: torch.nn.Module, spec: GPTSpec) -> None:
    """Overwrite every parameter of this rank's chunk with its slice of ``full_parameter``."""
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    names = canonical_names(model)
    module = get_attr_wrapped_model(model, "decoder", return_model_obj=True)
    if tp_size > 1:
        for path, sub in module.named_modules():
            weight = getattr(sub, "weight", None)
            if isinstance(sub, _SHARDED_MODULES) and weight is not None \
                    and not getattr(weight, "tensor_model_parallel", False):
                raise RuntimeError(f"{path}.weight is not marked tensor-parallel; build with "
                                   "perform_initialization=True (Megatron marks the weights it initialises)")
    for name, param in module.named_parameters():
        full_shape = list(param.shape)
        if tp_size > 1 and getattr(param, "tensor_model_parallel", False):
            full_shape[param.partition_dim] *= tp_size
        full = full_parameter(spec, names[name], full_shape)
        param.copy_(tp_shard(full, param, tp_size, tp_rank))


# --------------------------------------------------------------------------------------------------
# Context parallelism (test-only attention)


class _GatherSequence(torch.autograd.Function):
    """All-gather CP chunks along dim 0 into natural sequence order; backward sums the gradient over
    the CP group and keeps this rank's rows."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        cp_size, cp_rank = dist.get_world_size(group), dist.get_rank(group)
        seq_length = x.size(0) * cp_size
        parts = [torch.empty_like(x) for _ in range(cp_size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        gathered_positions = torch.cat([cp_positions(seq_length, cp_size, r) for r in range(cp_size)])
        ctx.group = group
        ctx.local = cp_positions(seq_length, cp_size, cp_rank).to(x.device)
        return torch.cat(parts, 0).index_select(0, torch.argsort(gathered_positions).to(x.device))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad.index_select(0, ctx.local), None


def _gather_together(parts: tuple[torch.Tensor, ...], group) -> tuple[torch.Tensor, ...]:
    """:class:`_GatherSequence` of several ``[s/cp, b, ...]`` tensors in one all-gather (and one all-reduce
    backward): packed along their last dimensions, gathered, split again. The same numbers as gathering each."""
    cp_size = dist.get_world_size(group)
    packed = torch.cat([part.reshape(*part.shape[:2], -1) for part in parts], dim=-1)
    gathered = _GatherSequence.apply(packed, group).split([part[0, 0].numel() for part in parts], dim=-1)
    # Contiguous: DotProductAttention views them.
    return tuple(whole.reshape(part.size(0) * cp_size, *part.shape[1:]).contiguous()
                 for whole, part in zip(gathered, parts))


# megatron-core 0.15 and later pass process groups as ``pg_collection``; 0.13 and 0.14 take none.
_ACCEPTS_PG_COLLECTION = "pg_collection" in inspect.signature(DotProductAttention.__init__).parameters


class GatherContextParallelAttention(DotProductAttention):
    """Test-only context-parallel core attention for the local layer spec.

    megatron-core's local ``DotProductAttention`` supports no context parallelism (TE's
    ring attention does). This stand-in gathers q/k/v (``[s/cp, b, heads, dim]``) and an
    explicit attention mask (``[b, 1, s/cp, s]``, sliced over queries) over the CP group,
    runs Megatron's ``DotProductAttention`` on the whole sequence and keeps this rank's
    query rows: the exact same numbers as without CP, at the cost of O(s²) per rank.
    """

    def __init__(self, config: TransformerConfig, *args: Any, pg_collection=None, **kwargs: Any):
        local_config = copy.copy(config)
        local_config.context_parallel_size = 1  # DotProductAttention asserts it
        if _ACCEPTS_PG_COLLECTION:
            kwargs["pg_collection"] = pg_collection
        super().__init__(local_config, *args, **kwargs)
        cp = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        self.cp_group = cp if cp is not None else parallel_state.get_context_parallel_group()

    def forward(self, query, key, value, attention_mask, *args: Any, **kwargs: Any):
        cp_size = dist.get_world_size(self.cp_group)
        if cp_size == 1:
            return super().forward(query, key, value, attention_mask, *args, **kwargs)
        seq_length = query.size(0) * cp_size
        query, key, value = _gather_together((query, key, value), self.cp_group)
        if attention_mask is not None:
            # [b, 1, s/cp, s]: gathered over the query dimension.
            mask = _GatherSequence.apply(attention_mask.transpose(0, 2), self.cp_group)
            attention_mask = mask.transpose(0, 2)
        context = super().forward(query, key, value, attention_mask, *args, **kwargs)
        local = cp_positions(seq_length, cp_size, dist.get_rank(self.cp_group)).to(context.device)
        return context.index_select(0, local)


# --------------------------------------------------------------------------------------------------
# Data


def make_batch(spec: GPTSpec, global_batch_size: int = 8, seq_length: Optional[int] = None, *, seed: int = 0,
               mask_fraction: float = 0.25, attention_mask: bool = False) -> dict[str, torch.Tensor]:
    """A seeded global batch (same on every rank): ``tokens``, ``labels`` (next token), ``loss_mask``
    (about ``mask_fraction`` of the positions off), ``position_ids``, and, with
    ``attention_mask=True``, an explicit causal ``attention_mask [1, 1, s, s]`` (True = masked)."""
    seq_length = seq_length or spec.max_sequence_length
    gen = torch.Generator().manual_seed(seed)
    stream = torch.randint(0, spec.vocab_size, (global_batch_size, seq_length + 1), generator=gen)
    batch = {
        "tokens": stream[:, :-1].contiguous(),
        "labels": stream[:, 1:].contiguous(),
        "loss_mask": (torch.rand(global_batch_size, seq_length, generator=gen) >= mask_fraction).float(),
        "position_ids": torch.arange(seq_length).repeat(global_batch_size, 1),
    }
    if attention_mask:
        causal = torch.triu(torch.ones(seq_length, seq_length, dtype=torch.bool), diagonal=1)
        batch["attention_mask"] = causal[None, None]
    return batch


_SEQUENCE_DIM = {"attention_mask": 2}  # every other batch entry is [b, s, ...]


def local_microbatches(batch: Mapping[str, Optional[torch.Tensor]], micro_batch_size: int,
                       dp_size: Optional[int] = None, dp_rank: Optional[int] = None,
                       cp_size: Optional[int] = None, cp_rank: Optional[int] = None) -> list[dict]:
    """Split a global batch into this rank's microbatches: Megatron-LM's pretraining sampler over
    data-parallel ranks (microbatch ``m`` of rank ``d``: sequences ``(m·dp + d)·mbs …``), then
    ``get_batch_on_this_cp_rank`` over context-parallel ranks. Sizes and ranks default to
    parallel_state's. An entry whose batch dimension is 1 (a shared mask) is broadcast, None is kept."""
    dp_size = parallel_state.get_data_parallel_world_size() if dp_size is None else dp_size
    dp_rank = parallel_state.get_data_parallel_rank() if dp_rank is None else dp_rank
    cp_size = parallel_state.get_context_parallel_world_size() if cp_size is None else cp_size
    cp_rank = parallel_state.get_context_parallel_rank() if cp_rank is None else cp_rank
    global_batch_size = batch["tokens"].size(0)
    if global_batch_size % (micro_batch_size * dp_size):
        raise ValueError(f"global batch {global_batch_size} is not divisible by micro batch "
                         f"{micro_batch_size} × data-parallel size {dp_size}")
    microbatches = []
    for m in range(global_batch_size // (micro_batch_size * dp_size)):
        start = (m * dp_size + dp_rank) * micro_batch_size
        micro = {}
        for key, value in batch.items():
            if value is not None:
                if value.size(0) != 1 or global_batch_size == 1:
                    value = value[start:start + micro_batch_size]
                if value.dim() > 1:  # per-sample entries ([b]: a dataset_id) have no sequence to split
                    value = cp_slice(value, _SEQUENCE_DIM.get(key, 1), cp_size, cp_rank)
            micro[key] = value
        microbatches.append(micro)
    return microbatches


# --------------------------------------------------------------------------------------------------
# One step through Megatron's schedule


def lm_loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Megatron-LM's per-token ``loss_func``: ``(loss_sum, num_tokens, {'lm loss': [sum, count]})``."""
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.reshape(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    report = torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])
    return loss, num_tokens, {"lm loss": report}


def gpt_forward_step(data_iterator, model, *,
                     logits_hook: Optional[Callable[[torch.Tensor, dict], Any]] = None,
                     loss_func: Callable = lm_loss_func):
    """Megatron-LM-style ``forward_step(data_iterator, model) -> (output, partial(loss_func, loss_mask))``.

    Without ``logits_hook`` the model computes the per-token loss itself (``labels=`` passed, logits
    never leave ``GPTModel``). With it, the last stage asks the model for its logits — this rank's
    vocabulary shard, ``[b, s, vocab/tp]`` — calls ``logits_hook(logits, microbatch)`` and then computes
    the same per-token loss with Megatron's ``compute_language_model_loss`` on an ``[s, b, v]`` copy
    (Megatron's vocab-parallel cross-entropy overwrites its fp32 input in place; the hook's tensor is
    left intact). Bind the keywords with ``functools.partial``.
    """
    batch = next(data_iterator)
    post_process = get_attr_wrapped_model(model, "post_process")
    kwargs = dict(input_ids=batch["tokens"], position_ids=batch["position_ids"],
                  attention_mask=batch.get("attention_mask"))
    if post_process and logits_hook is not None:
        logits = model(**kwargs)
        logits_hook(logits, batch)
        gpt = get_attr_wrapped_model(model, "compute_language_model_loss", return_model_obj=True)
        output = gpt.compute_language_model_loss(batch["labels"], logits.transpose(0, 1).contiguous())
    else:
        output = model(**kwargs, labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])


def run_forward_backward(model: torch.nn.Module | Sequence[torch.nn.Module],
                         batch: Mapping[str, torch.Tensor], *, micro_batch_size: int,
                         forward_step_func: Optional[Callable] = None, forward_only: bool = False,
                         **schedule_kwargs: Any) -> list:
    """One forward(-backward) step of the global ``batch`` through ``get_forward_backward_func()``.

    Splits ``batch`` over DP/CP ranks and microbatches (``local_microbatches``), gives every model
    chunk its own iterator over this rank's microbatches, and returns what the schedule returns:
    on the last pipeline stage the list of per-microbatch loss reports (``{'lm loss': [sum, count]}``
    with the default forward step), elsewhere ``[]``. ``forward_step_func`` defaults to
    ``gpt_forward_step``; extra keywords go to the schedule.
    """
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    microbatches = local_microbatches(batch, micro_batch_size)
    iterators = [iter(microbatches) for _ in chunks]
    forward_backward = get_forward_backward_func()
    return forward_backward(
        forward_step_func=forward_step_func or gpt_forward_step,
        data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=len(microbatches),
        seq_length=batch["tokens"].size(1),
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
        **schedule_kwargs,
    )


def sum_loss_reports(reports: Sequence[Mapping[str, torch.Tensor]], key: str = "lm loss",
                     group=None) -> Optional[torch.Tensor]:
    """Megatron-LM's reduction of the reports: sum ``[loss_sum, num_tokens]`` over microbatches, then
    all-reduce over DP×CP (``group`` defaults to that group). Call it on every rank: the last-stage
    ranks all-reduce and get the float64 ``[loss_sum, num_tokens]``, the others (reports ``[]``) get
    None without communicating."""
    group = group or parallel_state.get_data_parallel_group(with_context_parallel=True)
    last_stage = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    total = torch.zeros(2, dtype=torch.float64)
    for report in reports:
        total += report[key].double()
    if last_stage:  # every rank of a DP×CP group sits on the same pipeline stage
        dist.all_reduce(total, group=group)
        return total
    return None


def reference_forward(model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Full-vocabulary logits ``[b, s, vocab]`` of a single-process (TP1, PP1) model on the whole batch."""
    return model(input_ids=batch["tokens"], position_ids=batch["position_ids"],
                 attention_mask=batch.get("attention_mask"))


def pool_loss_reports(reports: Sequence[Mapping[str, torch.Tensor]], group=None) -> Optional[dict[str, float]]:
    """Every key of the reports pooled the way Megatron-LM's ``train_step`` pools them (``training.py``, read at
    ``core_v0.16.1`` and ``core_v0.19.0``): the keys of the first microbatch's dict; ``[sum, count]`` entries summed
    over microbatches, all-reduced over DP×CP, ``sum / count``; one-element entries averaged over microbatches.
    Call it on every rank: last-stage ranks get the dict, the others None (like ``sum_loss_reports``)."""
    group = group or parallel_state.get_data_parallel_group(with_context_parallel=True)
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return None
    pooled = {}
    for key in reports[0]:
        values = [report[key].reshape(-1) for report in reports]
        if values[0].numel() == 2:
            total = torch.vstack(values).sum(dim=0)
            dist.all_reduce(total, group=group)
            pooled[key] = float(total[0] / total[1])
        else:
            pooled[key] = float(torch.cat(values).mean())
    return pooled


BLEND_IDS = (0, 1, 1, 0, 2, 0, 1, 2)  # one dataset_id per sample of 8, as a BlendedDataset gives


def blended_batch(spec: GPTSpec, true_vocab: int, global_batch_size: int = 8, seed: int = 4) -> dict[str, torch.Tensor]:
    """:func:`make_batch` with tokens and labels inside the ``true_vocab`` (the model's vocabulary is padded past
    it) and a ``dataset_id`` per sample (:data:`BLEND_IDS`, repeated): the batch of the per-dataset tests."""
    batch = make_batch(spec, global_batch_size, seed=seed)
    batch["labels"] = batch["labels"] % true_vocab
    batch["tokens"] = batch["tokens"] % true_vocab
    batch["dataset_id"] = torch.tensor([BLEND_IDS[i % len(BLEND_IDS)] for i in range(global_batch_size)])
    return batch


def blended_reference(spec: GPTSpec, true_vocab: int, group_names: Sequence[str], timeout: float) -> dict[str, float]:
    """:func:`reference_metrics` of :func:`blended_batch` on one forked rank (float64, full vocabulary)."""
    from twinkle_megatron.testing.cuda_shim import cpu_cuda_shim
    from twinkle_megatron.testing.distributed import Layout, run_distributed

    def one_rank() -> dict:
        with cpu_cuda_shim():
            return reference_metrics(spec, blended_batch(spec, true_vocab), true_vocab, group_names)

    return run_distributed(one_rank, layout=Layout(), timeout=timeout)[0]


def reference_metrics(spec: GPTSpec, batch: Mapping[str, torch.Tensor], vocab_size: int,
                      group_names: Sequence[str] = (), group_key: str = "dataset_id",
                      model: Optional[torch.nn.Module] = None, position_edges: Sequence[int] = ()
                      ) -> dict[str, float]:
    """World 1 (call inside a one-rank worker and the shim), float64, full vocabulary: ``accuracy``,
    ``correct_tokens``, ``total_tokens``, ``logprob``, ``entropy`` over the tokens of the loss mask, and ``loss``
    (Megatron's per-token cross-entropy over the padded vocabulary); with ``group_names`` each of them again as
    ``key/<name>`` over the samples whose ``batch[group_key]`` is the group's index; with ``position_edges``
    ``e_0 < … < e_B`` each again as ``key/pos_<e_b>-<e_{b+1} - 1>`` over the tokens at positions ``e_b ≤ p < e_{b+1}``
    of their sequence. ``model``: the single-process ``GPTModel`` to evaluate (a trained one); default: ``spec``'s,
    freshly built."""
    from kit.references import accuracy_reference, token_stats_reference

    if model is None:
        (model,) = build_gpt_model(spec)
    with torch.no_grad():
        logits = reference_forward(model, batch).double()
    labels = batch["labels"]
    losses = torch.nn.functional.cross_entropy(logits.reshape(-1, spec.vocab_size), labels.reshape(-1),
                                               reduction="none").reshape(labels.shape)
    everything = torch.ones(labels.shape, dtype=torch.bool)
    slices = {None: everything}
    slices.update({name: (batch[group_key] == index)[:, None] & everything for index, name in enumerate(group_names)})
    positions = torch.arange(labels.shape[1]).expand(labels.shape)
    slices.update({f"pos_{first}-{end - 1}": (positions >= first) & (positions < end)
                   for first, end in zip(position_edges[:-1], position_edges[1:])})
    results = {}
    for name, selected in slices.items():
        mask = batch["loss_mask"].bool() & selected
        values = {**accuracy_reference(logits, labels, mask, vocab_size),
                  **token_stats_reference(logits, labels, mask, vocab_size), "loss": float(losses[mask].mean())}
        results.update({key if name is None else f"{key}/{name}": value for key, value in values.items()})
    return results
