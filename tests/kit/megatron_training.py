"""A tiny megatron-core GPT wrapped in Megatron's DDP, with Megatron's optimizer: one real training step.

Test support for code that reads gradients after Megatron's reduction (per-layer
norms) or follows training steps (incidents). Inside a worker of
``twinkle_megatron.testing.distributed`` and ``twinkle_megatron.testing.cuda_shim.cpu_cuda_shim()``::

    chunks, optimizer = build_trained_gpt(spec, distributed_optimizer=True)
    reports = train_forward_backward(chunks, batch, micro_batch_size=2)   # grads reduced (finalize_model_grads)
    norm = optimizer.get_grad_norm()                                      # Megatron's global gradient norm
    optimizer.step()

Gradients are reduced by Megatron's own ``finalize_model_grads`` (the schedule
calls it at the end of the step, as Megatron-LM's ``train_step``); the
distributed optimizer reduce-scatters them and each DP rank owns a shard.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

from kit.megatron_gpt import GPTSpec, build_gpt_model, make_config, run_forward_backward

__all__ = ["build_trained_gpt", "train_forward_backward"]


def _with_gloo_groups() -> None:
    """Megatron's optimizer reads parallel_state's gloo groups, which the kit's workers do not create (their
    default backend is gloo already): initialise parallel_state again, with the same sizes, with them."""
    from megatron.core import parallel_state as ps

    try:
        ps.get_data_parallel_group_gloo(with_context_parallel=True)
        return
    except AssertionError:
        pass
    sizes = dict(tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
                 pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
                 virtual_pipeline_model_parallel_size=ps.get_virtual_pipeline_model_parallel_world_size(),
                 context_parallel_size=ps.get_context_parallel_world_size(),
                 expert_model_parallel_size=ps.get_expert_model_parallel_world_size())
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(**sizes)


_TYPE = torch.Tensor.type


def _cuda_type_name(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """``Tensor.type()`` naming a CPU tensor as its CUDA twin (``torch.cuda.FloatTensor``): Megatron's optimizers
    pick their code path by these names and refuse others. A conversion (``type(dtype)``) is left alone."""
    name = _TYPE(self, *args, **kwargs)
    if args or kwargs or not isinstance(name, str) or ".cuda." in name:
        return name
    return name.replace("torch.", "torch.cuda.", 1)


def build_trained_gpt(spec: GPTSpec, *, distributed_optimizer: bool = False, lr: float = 1e-3,
                      config_overrides: Optional[dict] = None, moe: Any = None) -> tuple[list, Any]:
    """This rank's DDP-wrapped chunks of the ``spec`` model and Megatron's Adam over them (no clipping: CPU).

    ``moe``: a ``kit.megatron_moe.MoESpec`` for MoE layers (experts sharded over parallel_state's EP size)."""
    _with_gloo_groups()
    torch.Tensor.type = _cuda_type_name  # for the rest of this (forked worker) process
    if moe is not None:
        from kit.megatron_moe import build_moe_model, moe_config

        config = moe_config(spec, moe, **(config_overrides or {}))
        config.finalize_model_grads_func = finalize_model_grads
        chunks = build_moe_model(spec, config)
    else:
        config = make_config(spec, **(config_overrides or {}))
        config.finalize_model_grads_func = finalize_model_grads
        chunks = build_gpt_model(spec, config=config)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=distributed_optimizer)
    wrapped = [DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=index > 0)
               for index, chunk in enumerate(chunks)]
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=lr, clip_grad=0.0, use_distributed_optimizer=distributed_optimizer),
        wrapped)
    return wrapped, optimizer


def train_forward_backward(chunks: Sequence[torch.nn.Module], batch: Mapping[str, torch.Tensor], *,
                           micro_batch_size: int, forward_step_func: Optional[Callable] = None) -> list:
    """Zero the gradient buffers, then one forward-backward of ``batch`` (gradients reduced at its end)."""
    for chunk in chunks:
        chunk.zero_grad_buffer()
    return run_forward_backward(list(chunks) if len(chunks) > 1 else chunks[0], batch,
                                micro_batch_size=micro_batch_size, forward_step_func=forward_step_func)
