"""The run's configuration, logged once to every backend (W&B config, MLflow params, TensorBoard hparams...).

A nested mapping of plain values (numbers, strings, bools):

* ``parallel``: ``tp``, ``pp``, ``vpp``, ``cp``, ``dp``, ``ep`` and ``world_size``;
* ``model``: the shape fields of the megatron-core ``TransformerConfig`` that
  determine the FLOPs (layers, hidden and FFN sizes, heads, query groups, MoE
  experts and top-k, MTP layers...), ``padded_vocab_size``, and the precision flags;
* ``training``: ``seq_length``, ``global_batch_size``, ``flops_per_step``,
  ``log_interval``, the peak TFLOP/s and device MFU is computed against;
* ``versions``: twinkle-megatron, megatron-core, torch and Python;

then the user's ``config=`` (its keys win).
"""

from __future__ import annotations

import platform
from typing import Any, Mapping, Optional

import torch

from ..parallel import ParallelContext
from ..version import __version__

_MODEL_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                 "kv_channels", "gated_linear_unit", "num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size",
                 "moe_shared_expert_intermediate_size", "mtp_num_layers", "multi_latent_attention", "bf16", "fp16",
                 "fp8", "sequence_parallel")
_PARALLEL_FIELDS = (("vpp", "virtual_pipeline_model_parallel_size"), ("ep", "expert_model_parallel_size"))


def build_run_config(context: ParallelContext, *, model_config: Any = None, padded_vocab_size: Optional[int] = None,
                     seq_length: Optional[int] = None, global_batch_size: Optional[int] = None,
                     flops_per_step: Optional[float] = None, log_interval: Optional[int] = None,
                     peak_tflops: Optional[float] = None, device_name: Optional[str] = None,
                     user_config: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """The configuration described in the module docstring; fields without a value are left out."""
    world_size = torch.distributed.get_world_size() if context.distributed else 1
    parallel: dict[str, Any] = {"tp": context.tp_size, "pp": context.pp_size, "cp": context.cp_size,
                                "dp": context.dp_size, "world_size": world_size}
    for name, field in _PARALLEL_FIELDS:
        parallel[name] = getattr(model_config, field, None)
    model = {name: _plain(getattr(model_config, name, None)) for name in _MODEL_FIELDS}
    model["padded_vocab_size"] = padded_vocab_size
    training = {"seq_length": seq_length, "global_batch_size": global_batch_size, "flops_per_step": flops_per_step,
                "log_interval": log_interval, "peak_tflops_per_gpu": peak_tflops, "device": device_name}
    config: dict[str, Any] = {"parallel": _present(parallel), "model": _present(model),
                              "training": _present(training), "versions": _versions()}
    for key, value in (user_config or {}).items():
        config[key] = value
    return {key: value for key, value in config.items() if value != {}}


def _versions() -> dict[str, str]:
    versions = {"twinkle_megatron": __version__, "torch": torch.__version__, "python": platform.python_version()}
    try:
        from importlib.metadata import version

        versions["megatron_core"] = version("megatron-core")
    except Exception:  # noqa: BLE001 - not installed (plain PyTorch use): no version to report
        pass
    return versions


def _plain(value: Any) -> Any:
    """Numbers, strings and bools as they are; enums and other objects as their text."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _present(values: Mapping[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in values.items() if value is not None}
