"""A tiny real megatron-core GPTModel with MoE layers on CPU ranks (test support, on top of ``megatron_gpt``).

Megatron's local layer spec with ``num_experts`` experts per layer (``SequentialMLP``
experts, megatron-core's ``TopKRouter``, the all-gather token dispatcher), built by
``megatron_gpt.build_gpt_model`` with layout-independent weights: every expert's
weights are drawn under its *global* name (``local_experts.{j}`` of EP rank ``r`` is
expert ``r·E/ep + j``), so any TP×PP×EP×DP model is the single-process model.

Two things megatron-core 0.16.1 needs here, each a workaround for a CPU-only,
TE-less install, not a change of what Megatron computes:

- ``allow_router_without_te()`` (shipped in ``twinkle_megatron.testing``): ``RouterGatingLinearFunction.forward`` tests
  ``te_general_gemm is not None``, but ``moe_utils`` defines that name only when
  Transformer Engine imports; without TE every router call raises ``NameError``.
  Defining it as ``None`` (what the check means) selects megatron-core's own
  ``torch.mm`` / ``torch.addmm`` path.
- The all-to-all dispatcher cannot run on gloo CPU ranks: it hands its split sizes
  to ``all_to_all_single`` as tensors, converting them to lists only for CUDA
  tensors (``maybe_move_tensor_to_cpu`` returns CPU tensors unchanged), which gloo
  refuses (``TypeError``); and it synchronises on a CUDA event. The all-gather
  dispatcher runs (expert parallelism included), so the tests use it.

Activation recomputation (``recompute_granularity``) runs on CPU inside
``recompute_rng_on_cpu()``: megatron-core's ``CheckpointFunction`` saves the CUDA
generator's state with ``torch.cuda.random.get_rng_state()``, which raises on a
CPU build; inside the block it returns the CPU generator's state (restoring it
goes through ``torch.cuda._lazy_call``, which only queues while CUDA is not
initialised). Nothing random runs in these models (no dropout).

Also: ``add_bias_linear`` must be False (megatron-core 0.16.1's expert MLP adds its
bias in place to a view returned by a custom autograd function: ``RuntimeError``).
"""

from __future__ import annotations

import contextlib
import copy
import re
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.utils import get_attr_wrapped_model

from kit.megatron_gpt import (
    GPTSpec,
    SequenceParallelLayerNorm,
    build_gpt_model,
    canonical_names,
    full_parameter,
    make_config,
    tp_shard,
)
from twinkle_megatron.testing.router_without_te import allow_router_without_te

__all__ = ["MoESpec", "allow_router_without_te", "build_moe_model", "init_parallel", "moe_config", "moe_layer_spec",
           "recompute_rng_on_cpu"]


@dataclass(frozen=True)
class MoESpec:
    """The MoE part of the tiny model (the rest is ``GPTSpec``)."""

    num_experts: int = 4
    topk: int = 2
    aux_loss_coeff: float = 1e-2  # Megatron computes and tracks load_balancing_loss
    z_loss_coeff: Optional[float] = 1e-3  # ... and z_loss


@contextlib.contextmanager
def recompute_rng_on_cpu() -> Iterator[None]:
    """``torch.cuda.random.get_rng_state`` returns the CPU generator's state inside the block (see above)."""
    original = torch.cuda.random.get_rng_state
    torch.cuda.random.get_rng_state = lambda device="cuda": torch.get_rng_state()
    try:
        yield
    finally:
        torch.cuda.random.get_rng_state = original


def init_parallel(tp: int = 1, pp: int = 1, ep: int = 1, vpp: Optional[int] = None) -> None:
    """megatron-core's parallel_state with expert parallelism (inside a ``run_distributed`` worker)."""
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             virtual_pipeline_model_parallel_size=vpp, expert_model_parallel_size=ep,
                                             create_gloo_process_groups=False)


def moe_config(spec: GPTSpec, moe: MoESpec, **overrides: Any) -> TransformerConfig:
    """``make_config`` with MoE layers everywhere, the all-gather dispatcher and parallel_state's EP size."""
    kwargs: dict[str, Any] = dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.topk,
        moe_token_dispatcher_type="allgather",
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=moe.aux_loss_coeff,
        moe_z_loss_coeff=moe.z_loss_coeff,
    )
    kwargs.update(overrides)
    return make_config(spec, **kwargs)


def moe_layer_spec(config: TransformerConfig):
    """Megatron's local MoE layer spec (``SequentialMLP`` experts); sequence-parallel norms under SP."""
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    if config.sequence_parallel:
        spec = copy.deepcopy(spec)
        spec.submodules.input_layernorm = SequenceParallelLayerNorm
        spec.submodules.pre_mlp_layernorm = SequenceParallelLayerNorm
    return spec


_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")


def build_moe_model(spec: GPTSpec, config: TransformerConfig) -> list:
    """This rank's chunks of the MoE model, every weight its slice of the single-process model's."""
    allow_router_without_te()
    chunks = build_gpt_model(spec, config=config, layer_spec_fn=moe_layer_spec)
    local_experts = config.num_moe_experts // parallel_state.get_expert_model_parallel_world_size()
    first = parallel_state.get_expert_model_parallel_rank() * local_experts
    etp_size = parallel_state.get_expert_tensor_parallel_world_size()
    etp_rank = parallel_state.get_expert_tensor_parallel_rank()
    with torch.no_grad():
        for chunk in chunks:
            names = canonical_names(chunk)
            module = get_attr_wrapped_model(chunk, "decoder", return_model_obj=True)
            for name, param in module.named_parameters():
                canonical = names[name]
                found = _LOCAL_EXPERT.search(canonical)
                if found is None:
                    continue  # loaded by build_gpt_model (routers included: replicated)
                canonical = _LOCAL_EXPERT.sub(f".mlp.experts.local_experts.{first + int(found.group(1))}.",
                                              canonical)
                shape = list(param.shape)
                if etp_size > 1 and getattr(param, "tensor_model_parallel", False):
                    shape[param.partition_dim] *= etp_size
                param.copy_(tp_shard(full_parameter(spec, canonical, shape), param, etp_size, etp_rank))
    return chunks
