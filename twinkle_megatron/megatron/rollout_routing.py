r"""MoE routing agreement between the RL rollout (the inference engine) and the trainer.

An MoE policy samples with an inference engine whose router may send a token to
other experts than the trainer's router does (kernels, precision, batch
composition): a main source of the train–inference mismatch of MoE RL. When
the rollout's routed experts are known (per token and layer, ``k`` each: what
vLLM / SGLang can return for routing replay), this compares them with the
trainer's own routing, through the router hooks of :mod:`.router_hooks`:

    rollout_routing_mismatch (layer i) = Σ_t (k − |R_t ∩ R'_t|) / (k · T_i)

over the ``T_i`` non-padding tokens ``t`` the layer routes, ``R_t`` the trainer's
experts of ``t`` (its routing map, after any token dropping), ``R'_t`` the
rollout's; the total over the layers is ``Σ_i Σ_t (k − |R_t ∩ R'_t|) / Σ_i k·T_i``.
A rollout routed exactly like the trainer gives 0.0.

**Which tokens.** ``record_rollout_experts(experts)`` in ``forward_step``, once per
microbatch before the model runs: ``experts`` is ``[b, s, layers, k]`` integer
expert ids of the microbatch's tokens as this rank holds them (its CP chunks,
like ``tokens``; the layers of the whole model, numbered globally as Megatron's
``layer_number − 1``). The router sees ``[s, b]`` tokens (and with sequence
parallelism its TP rank's slice of ``s``); the hook takes the same tokens of the
layer's column. Counted where the routing metric counts (TP duplicates once,
activation recomputations not again), as device sums in the collection's one
sync.

**Keys** (``calculate()``; Python numbers, the same on every rank):
``moe/rollout_routing_mismatch`` and ``moe/layer_{i}/rollout_routing_mismatch``
for every layer that routed a token with rollout experts.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from ..metric import Metric, Number, SyncedStates
from .router_hooks import MoERoutingHooks

TOTAL_KEY = "moe/rollout_routing_mismatch"


class RolloutRoutingMetric(Metric):
    """Differing routing decisions per layer (``[layers]`` sums), fed by :class:`RolloutRouting`'s hook."""

    every_rank_counts = True  # only counting ranks record (see the module docstring)

    def __init__(self, num_layers: int, num_experts: int, topk: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.num_layers, self.num_experts, self.topk = num_layers, num_experts, topk
        self.add_state("differing", "sum", (num_layers,))
        self.add_state("decisions", "sum", (num_layers,))

    def accumulate(self, inputs: Any, outputs: Any, **kwargs: Any) -> None:
        """Nothing: the routing comes from the router hooks."""

    def record(self, layer_number: int, routing_map: torch.Tensor, rollout: torch.Tensor,
               padding_mask: Optional[torch.Tensor] = None) -> None:
        """Add one router call: the trainer's ``routing_map [T, E]`` against the rollout's ``[T, k]`` expert ids
        of the same tokens (ids outside ``[0, E)`` never agree); padding tokens (True) left out."""
        routed = routing_map.reshape(-1, self.num_experts).bool()
        if tuple(rollout.shape) != (routed.shape[0], self.topk):
            raise ValueError(f"rollout experts of layer {layer_number} have shape {tuple(rollout.shape)} for the "
                             f"router's {routed.shape[0]} tokens: expected [{routed.shape[0]}, {self.topk}]")
        rollout = rollout.to(routed.device, torch.int64)
        inside = (rollout >= 0) & (rollout < self.num_experts)
        chosen = torch.zeros_like(routed).scatter_(1, rollout.clamp(0, self.num_experts - 1), inside)
        agreeing = (routed & chosen).sum(-1)
        counted = torch.ones_like(agreeing, dtype=torch.bool) if padding_mask is None else \
            ~padding_mask.reshape(-1).to(routed.device, torch.bool)
        differing = torch.zeros(self.num_layers, dtype=torch.float64, device=routed.device)
        decisions = torch.zeros_like(differing)
        differing[layer_number - 1] = torch.where(counted, self.topk - agreeing, 0).sum()  # device writes
        decisions[layer_number - 1] = counted.sum() * self.topk
        self._add("differing", differing)
        self._add("decisions", decisions)

    def compute(self, states: SyncedStates) -> dict[str, Number]:
        decisions, differing = states["decisions"], states["differing"]
        total = float(decisions.sum())
        if total == 0:
            return {}
        results: dict[str, Number] = {TOTAL_KEY: float(differing.sum()) / total}
        for row in range(self.num_layers):
            if decisions[row] > 0:
                results[f"moe/layer_{row}/rollout_routing_mismatch"] = float(differing[row] / decisions[row])
        return results


class RolloutRouting:
    """The rollout's routed experts of the current microbatch, compared in the router hooks."""

    def __init__(self, hooks: MoERoutingHooks) -> None:
        routing = hooks.metric
        self.metric = RolloutRoutingMetric(routing.num_layers, routing.num_experts, routing.topk)
        self._experts: Optional[torch.Tensor] = None
        hooks.listeners.append(self._compare)

    def record_rollout_experts(self, experts: Optional[torch.Tensor]) -> None:
        """The current microbatch's rollout experts, ``[b, s, layers, k]`` (None: no comparison)."""
        if experts is not None and (experts.dim() != 4 or experts.dtype.is_floating_point):
            raise ValueError(f"rollout experts must be integer ids shaped [b, s, layers, k], got "
                             f"{tuple(experts.shape)} {experts.dtype}")
        self._experts = experts

    def _compare(self, router: torch.nn.Module, layer_number: int, routing_map: torch.Tensor,
                 padding_mask: Optional[torch.Tensor]) -> None:
        if self._experts is None:
            return
        tokens = self._experts[:, :, layer_number - 1].transpose(0, 1)  # [s, b, k]: the router's token order
        if getattr(getattr(router, "config", None), "sequence_parallel", False):
            tp_size, tp_rank = _tp_size_and_rank(router)
            width = tokens.shape[0] // tp_size
            tokens = tokens[tp_rank * width:(tp_rank + 1) * width]
        self.metric.record(layer_number, routing_map, tokens.reshape(-1, tokens.shape[-1]), padding_mask)


def _tp_size_and_rank(router: torch.nn.Module) -> tuple[int, int]:
    group = getattr(router, "tp_group", None)
    if group is not None:
        return dist.get_world_size(group), dist.get_rank(group)
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()


def attach_rollout_routing(instrumentation: Any) -> RolloutRouting:
    """Compare the rollout's routed experts with the trainer's in ``instrument()``'s router hooks; the metric
    joins the instrumentation's collection (its one sync). Call on every rank, before building a tracker."""
    hooks = getattr(instrumentation, "moe", None)
    if hooks is None:
        raise ValueError("attach_rollout_routing needs instrument() of a model with MoE layers (moe_routing=True)")
    routing = RolloutRouting(hooks)
    instrumentation.metrics.metrics.insert(-1, routing.metric)  # before the hook-failure count, on every rank
    return routing
