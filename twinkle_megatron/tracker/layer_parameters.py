"""Which part of a Megatron model each parameter belongs to, and the part of its gradient this rank counts.

Per-layer gradient norms must add up, over every rank, to the global gradient
norm Megatron's optimizer computes (``get_grad_norm_fp32`` over
``get_main_grads_for_grad_norm``). So each element of each gradient is counted
on exactly one rank, by the optimizer's own rules:

* **TP**: a parameter marked ``tensor_model_parallel`` is a shard, counted on
  every TP rank (the shards sum to the whole); any other parameter (layer
  norms, row-parallel biases, the router) is a duplicate, counted on TP rank 0
  only (Megatron's ``param_is_not_tensor_parallel_duplicate``; expert
  parameters use the expert-TP rank). Shared parameters (``param.shared``:
  the output layer's copy of a tied embedding) are not counted
  (``param_is_not_shared``).
* **DP** (with CP): with Megatron's distributed optimizer every DP rank counts
  the sub-range of the parameter it owns in the gradient buffer (the
  optimizer's ``gbuf_ranges[...]["param_map"][param]["param"]``: the shard the
  reduce-scatter left reduced on that rank); without it every DP rank holds the
  whole reduced gradient, so DP rank 0 counts it (the expert-DP rank for
  expert parameters).
* **PP / VPP / EP**: every stage and expert rank holds different parameters;
  all count.

Gradients are read from Megatron's gradient buffers (``param.main_grad``, else
``param.grad``) after ``finalize_model_grads`` and before ``optimizer.step()``
(which clips them in place). Parts: one slot per transformer layer, numbered
globally (``TransformerLayer.layer_number − 1``: the same across PP stages and
virtual stages), then ``embedding``, ``output_layer``, ``final_norm`` and
``other`` (anything else, e.g. multi-token-prediction layers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import torch

from ..keys import layer_part

PARTS = ("embedding", "output_layer", "final_norm", "other")


@dataclass(frozen=True)
class CountedParameter:
    """One parameter of this rank: its part (slot), and the flat range of it this rank counts."""

    slot: int
    param: torch.nn.Parameter
    start: int
    end: int


class LayerParameters:
    """The parameters of a Megatron model's chunks, by part, as this rank counts them (see the module docstring).

    Built once (a walk over the modules); :meth:`gradients` and :meth:`values`
    then give, per step, the counted flat views and their slots, without any
    host sync or collective.

    Args:
        model_chunks: the model, or its chunks (one per virtual pipeline stage),
            wrapped or not in Megatron's DDP.
        optimizer: Megatron's optimizer (``get_megatron_optimizer``), needed to
            count the shards of the distributed optimizer once; without one the
            gradients are taken as all-reduced over DP.
        num_layers: transformer layers of the whole model (default: the
            chunks' ``config.num_layers``).
    """

    def __init__(self, model_chunks: Union[torch.nn.Module, Sequence[torch.nn.Module]], optimizer: Any = None,
                 num_layers: Optional[int] = None) -> None:
        chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
        self.num_layers = num_layers if num_layers is not None else _num_layers(chunks)
        self.slot_names: tuple[str, ...] = (*(layer_part(i, self.num_layers) for i in range(self.num_layers)), *PARTS)
        owned = _owned_ranges(optimizer)
        if owned is None and any(getattr(getattr(c, "ddp_config", None), "use_distributed_optimizer", False)
                                 for c in chunks):
            # After a reduce-scatter each DP rank holds only its shard reduced: the rest of the buffer is stale.
            raise ValueError("LayerParameters: the model uses Megatron's distributed optimizer; pass the optimizer "
                             "(record_grad_norms(model_chunks, optimizer)) so that each gradient shard counts once")
        self.counted: list[CountedParameter] = []
        for chunk in chunks:
            layers = _layer_prefixes(chunk)
            for name, param in chunk.named_parameters():
                if not param.requires_grad or not _counts_here(param, owned is not None):
                    continue
                if owned is not None:
                    part = owned.get(param)
                    if part is None:  # another DP rank owns all of it
                        continue
                    start, end = part
                else:
                    start, end = 0, param.numel()
                self.counted.append(CountedParameter(self._slot(name, layers), param, start, end))
        self._slots: Optional[torch.Tensor] = None

    def _slot(self, name: str, layers: dict[str, int]) -> int:
        for prefix, layer in layers.items():
            if name.startswith(prefix):
                if not 0 <= layer < self.num_layers:
                    raise ValueError(f"{name}: layer number {layer + 1} outside the model's {self.num_layers} layers")
                return layer
        path = name.split(".")
        for part, markers in (("embedding", ("embedding",)), ("output_layer", ("output_layer",)),
                              ("final_norm", ("final_layernorm", "final_norm"))):
            if any(marker in path for marker in markers):
                return self.num_layers + PARTS.index(part)
        return self.num_layers + PARTS.index("other")

    def slots(self, device: torch.device) -> torch.Tensor:
        """The slot of each counted parameter, in order (built once per device)."""
        if self._slots is None or self._slots.device != device:
            self._slots = torch.tensor([c.slot for c in self.counted], dtype=torch.long, device=device)
        return self._slots

    def gradients(self) -> list[Optional[torch.Tensor]]:
        """The counted flat part of each parameter's gradient (``main_grad``, else ``grad``; None when unset)."""
        views = []
        for counted in self.counted:
            grad = getattr(counted.param, "main_grad", None)
            grad = counted.param.grad if grad is None else grad
            views.append(None if grad is None else grad.detach().reshape(-1)[counted.start:counted.end])
        return views

    def values(self) -> list[torch.Tensor]:
        """The counted flat part of each parameter's value."""
        return [c.param.detach().reshape(-1)[c.start:c.end] for c in self.counted]


def loss_scale(optimizer: Any) -> Optional[torch.Tensor]:
    """The optimizer's loss scale (fp16: gradients in the buffers are scaled by it), or None."""
    get = getattr(optimizer, "get_loss_scale", None)
    if get is None:
        return None
    try:
        scale = get()
    except (AttributeError, AssertionError, NotImplementedError):
        return None
    return scale if isinstance(scale, torch.Tensor) else torch.tensor(float(scale))


# ------------------------------------------------------------------ helpers


def _num_layers(chunks: Sequence[torch.nn.Module]) -> int:
    for chunk in chunks:
        for module in chunk.modules():
            config = getattr(module, "config", None)
            if getattr(config, "num_layers", None):
                return int(config.num_layers)
    raise ValueError("LayerParameters: the model has no config.num_layers; pass num_layers=")


def _layer_prefixes(chunk: torch.nn.Module) -> dict[str, int]:
    """``'…decoder.layers.<local>.'`` -> global 0-based layer index, for the chunk's decoder layers."""
    prefixes = {}
    for name, module in chunk.named_modules():
        path = name.split(".")
        if len(path) >= 3 and path[-3:-1] == ["decoder", "layers"] and isinstance(
                getattr(module, "layer_number", None), int):
            prefixes[name + "."] = module.layer_number - 1
    return prefixes


def _is_expert(param: torch.nn.Parameter) -> bool:
    return not getattr(param, "allreduce", True)


def _counts_here(param: torch.nn.Parameter, distributed_optimizer: bool) -> bool:
    """Megatron's filters (not shared, not a TP duplicate), and DP rank 0 without the distributed optimizer."""
    from megatron.core import parallel_state as ps

    if getattr(param, "shared", False):
        return False
    expert = _is_expert(param)
    if not getattr(param, "tensor_model_parallel", False):
        tp_rank = ps.get_expert_tensor_parallel_rank() if expert and hasattr(
            ps, "get_expert_tensor_parallel_rank") else ps.get_tensor_model_parallel_rank()
        if tp_rank != 0:
            return False
    if distributed_optimizer:
        return True
    if expert and hasattr(ps, "get_expert_data_parallel_rank"):
        return ps.get_expert_data_parallel_rank() == 0
    return ps.get_data_parallel_rank(with_context_parallel=True) == 0


def _owned_ranges(optimizer: Any) -> Optional[dict[torch.nn.Parameter, tuple[int, int]]]:
    """With Megatron's distributed optimizer: each parameter's flat range this rank owns; else None."""
    optimizers = list(getattr(optimizer, "chained_optimizers", None) or ([optimizer] if optimizer else []))
    distributed = [o for o in optimizers if hasattr(o, "gbuf_ranges") and hasattr(o, "model_param_gbuf_map")]
    if not distributed:
        return None
    if len(distributed) != len(optimizers):
        raise ValueError("LayerParameters: a chained optimizer mixing distributed and non-distributed optimizers "
                         "is not supported")
    owned: dict[torch.nn.Parameter, tuple[int, int]] = {}
    for opt in distributed:
        for per_dtype in opt.gbuf_ranges:
            for buckets in per_dtype.values():
                for bucket in buckets:
                    for param, ranges in bucket["param_map"].items():
                        owned[param] = (ranges["param"].start, ranges["param"].end)
    return owned
