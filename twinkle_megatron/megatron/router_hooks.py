"""Forward hooks on megatron-core's MoE routers: they feed the routing-health metric and any other listener.

**What the hooks see.** A megatron-core MoE layer routes its tokens with a
``Router`` (``TopKRouter`` by default): ``router(hidden, padding_mask)`` returns
``(probs, routing_map)``, ``routing_map`` a ``[tokens, experts]`` boolean map of
the experts each token is dispatched to (top-k, after token dropping). The router
runs *before* the token dispatcher (``MoELayer.route`` precedes ``dispatch``), so
under expert parallelism it sees exactly its own rank's tokens. A forward hook on
every router hands each counted call to
:class:`~twinkle_megatron.metric.language.moe_routing.MoERoutingMetric` (the states and
formulas are there) and to :attr:`MoERoutingHooks.listeners` (e.g.
:mod:`.rollout_routing`).

**The router logits** for the entropy are recomputed in the hook from the
router's input by what the router's ``gating`` calls (megatron-core's
``router_gating_linear``: the same function, weights, dtype and kernel as the
router's call, so the same logits; see :func:`router_logits`) — one
``[tokens, hidden] × [hidden, experts]`` product, as cheap as the router's own.
The probabilities the router returns cannot give the entropy: with the default
score function they are a softmax over the top-k logits only. (Differences:
with ``moe_input_jitter_eps`` the entropy is that of the un-jittered logits; with
``moe_router_force_load_balancing`` that of the real, not the random, logits.)

**Megatron's router losses.** Routers that compute an auxiliary loss or the
z-loss add each microbatch's value to megatron-core's layer-wise tracker
(``get_moe_layer_wise_logging_tracker()``). A pre-hook keeps the layer's tracker
value, the hook hands the difference (in float64: exact) to the metric with the
weight its reduce group gives (the metric's module docstring says which). The
tracker is only read, never changed: Megatron-LM's own reduction and clearing
of it are untouched, and whoever clears it, whenever, the differences stay
exact. (Read rather than recomputed: the auxiliary loss of a microbatch is a
product of two sums over the microbatch's tokens, reduced over ``G`` inside the
router; it cannot be rebuilt from per-token sums without a collective per
microbatch.)

**Which calls count.** TP ranks route the same tokens unless sequence
parallelism splits the sequence over them: without it only TP rank 0's hook
records, with it every TP rank's. A pass inside the autograd engine is an
activation recomputation of a forward already counted: its routing is not
recorded again (Megatron's losses are read in whichever pass computes them:
with recomputation, the recomputing one).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist

from ..metric import ROUTER_LOSSES, MoERoutingMetric


@dataclass
class _RouterSite:
    """One hooked router: where its rows go, whether its routing counts here, its tracker snapshot."""

    layer_number: int
    counts: bool  # False on TP ranks other than 0 without sequence parallelism (duplicated tokens)
    signature: inspect.Signature
    before: dict = field(default_factory=dict)  # loss name -> (tracker values tensor, its version, row value)


class MoERoutingHooks:
    """A forward pre-hook and a forward hook on every megatron-core router of ``routers``, feeding ``metric``.

    ``on_error(where, error)`` receives any failure inside a hook (it must not
    escape mid-schedule: the other pipeline stages would wait forever);
    ``instrument()`` passes its failure counter, which raises it from
    ``calculate()`` on every rank. :meth:`detach` removes the hooks.
    """

    def __init__(self, routers: Sequence[torch.nn.Module], metric: MoERoutingMetric,
                 on_error: Callable[[str, BaseException], None], skip_evaluation: bool = False) -> None:
        self.metric = metric
        self.on_error = on_error
        # Inside Megatron's own loop its evaluate() runs the same routers: their calls there (the router in eval
        # mode, autograd off: validation.is_evaluation's rule) are not the training step's routing.
        self.skip_evaluation = skip_evaluation
        # More readers of each counted router call: (router, layer_number, routing_map, padding_mask).
        self.listeners: list[Callable[[torch.nn.Module, int, torch.Tensor, Any], None]] = []
        self._handles: list = []
        self._group_sizes: dict[int, int] = {}
        self.hook(routers)

    def hook(self, routers: Sequence[torch.nn.Module]) -> None:
        """Hooks on ``routers`` too (the chunks of virtual pipeline stages reach the wrapped step one by one)."""
        metric = self.metric
        for router in routers:
            layer_number = getattr(router, "layer_number", None)
            if not isinstance(layer_number, int) or not 1 <= layer_number <= metric.num_layers:
                raise ValueError(f"instrument(): MoE router {type(router).__name__} has layer_number "
                                 f"{layer_number!r}, expected 1..{metric.num_layers} (routers get it from their "
                                 "TransformerLayer)")
            if getattr(router, "num_experts", metric.num_experts) != metric.num_experts:
                raise ValueError(f"instrument(): the router of layer {layer_number} has {router.num_experts} "
                                 f"experts, the model config {metric.num_experts}")
            site = _RouterSite(layer_number, _routing_counts_here(router), inspect.signature(router.forward))
            self._handles.append(router.register_forward_pre_hook(
                functools.partial(self._before_router, site), with_kwargs=True))
            self._handles.append(router.register_forward_hook(
                functools.partial(self._after_router, site), with_kwargs=True))

    def _evaluating(self, module: torch.nn.Module) -> bool:
        return self.skip_evaluation and not module.training and not torch.is_grad_enabled()

    def _before_router(self, site: _RouterSite, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if self._evaluating(module):
            return
        try:
            site.before = {}
            row = site.layer_number - 1
            for name, entry in _megatron_loss_tracker().items():
                values = entry.get("values") if isinstance(entry, dict) else None
                if name in ROUTER_LOSSES and isinstance(values, torch.Tensor) and values.numel() > row:
                    site.before[name] = (values, values._version, values[row].clone())
        except Exception as error:  # noqa: BLE001 - see the class docstring
            self.on_error("MoE router pre-hook", error)

    def _after_router(self, site: _RouterSite, module: torch.nn.Module, args: tuple, kwargs: dict,
                      output: Any) -> None:
        if self._evaluating(module):
            return
        try:
            bound = site.signature.bind(*args, **kwargs).arguments
            hidden = bound[next(iter(site.signature.parameters))]
            padding_mask = bound.get("padding_mask")
            routing_map = output[1]
            tokens = routing_map.shape[0] if padding_mask is None else (~padding_mask.bool()).sum()
            self._record_router_losses(site, tokens)
            if not site.counts or _inside_backward():
                return  # a TP duplicate, or an activation recomputation of a forward already counted
            with torch.no_grad():
                logits = router_logits(module, hidden.detach())
            self.metric.record_routing(site.layer_number, routing_map, logits, padding_mask)
            for listener in self.listeners:  # e.g. the rollout's routing (rollout_routing.py)
                listener(module, site.layer_number, routing_map, padding_mask)
        except Exception as error:  # noqa: BLE001
            self.on_error("MoE router hook", error)
        finally:
            site.before = {}

    def _record_router_losses(self, site: _RouterSite, tokens: Union[int, torch.Tensor]) -> None:
        """What this router call added to Megatron's tracker, per loss (the difference, in float64), weighted
        as the module docstring says (``tokens``: the call's non-padding tokens on this rank)."""
        row = site.layer_number - 1
        for name, entry in _megatron_loss_tracker().items():
            values = entry.get("values") if isinstance(entry, dict) else None
            if name not in ROUTER_LOSSES or not isinstance(values, torch.Tensor) or values.numel() <= row:
                continue
            before = site.before.get(name)
            if before is not None and before[0] is values:
                if values._version == before[1]:
                    continue  # not written by this call (e.g. no aux loss in evaluation)
                increment = values[row].double() - before[2].double()
            else:  # the tracker entry was created by this call
                increment = values[row].double()
            group = entry.get("reduce_group")
            if group is None:  # a mean over this rank's own tokens (the z-loss): pooled by tokens
                self.metric.record_router_loss(name, site.layer_number, increment * tokens, tokens)
            else:  # a part of the microbatch's loss, summed over the group
                self.metric.record_router_loss(name, site.layer_number, increment, 1.0 / self._group_size(group))

    def _group_size(self, group: Any) -> int:
        if group is None:
            return 1
        size = self._group_sizes.get(id(group))
        if size is None:
            size = group.size() if hasattr(group, "size") else dist.get_world_size(group)
            self._group_sizes[id(group)] = size
        return size

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def attach_moe_routing(model: Union[torch.nn.Module, Sequence[torch.nn.Module]], *, per_layer: bool = False,
                       on_error: Callable[[str, BaseException], None], skip_evaluation: bool = False
                       ) -> Optional[MoERoutingHooks]:
    """Hooks on every MoE router of the model chunks and their metric; None for a model without MoE layers.

    MoE-ness is read from the model's ``TransformerConfig`` (``num_moe_experts``),
    which every pipeline stage shares, so every rank builds the metric, also a
    stage without MoE layers: the ranks' collections must be the same.
    """
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    config = _moe_config(chunks)
    if config is None:
        return None
    metric = MoERoutingMetric(num_layers=config.num_layers + int(getattr(config, "mtp_num_layers", None) or 0),
                              num_experts=int(config.num_moe_experts), topk=int(config.moe_router_topk),
                              per_layer=per_layer)
    return MoERoutingHooks(find_routers(chunks), metric, on_error, skip_evaluation)


def find_routers(chunks: Sequence[torch.nn.Module]) -> list[torch.nn.Module]:
    """Every megatron-core ``Router`` (``TopKRouter`` or any subclass) in the chunks, through any wrapper."""
    try:
        from megatron.core.transformer.moe.router import Router
    except ImportError:
        return []
    return [module for chunk in chunks for module in chunk.modules() if isinstance(module, Router)]


def _moe_config(chunks: Sequence[torch.nn.Module]) -> Any:
    """The first module config with MoE experts (GPTModel's, DDP's, a router's), or None."""
    for chunk in chunks:
        for module in chunk.modules():
            config = getattr(module, "config", None)
            if getattr(config, "num_moe_experts", None):
                return config
    return None


def _routing_counts_here(router: torch.nn.Module) -> bool:
    """Whether this rank's copy of ``router`` counts: its tokens are its own, not a TP duplicate."""
    if getattr(getattr(router, "config", None), "sequence_parallel", False):
        return True  # each TP rank routes its own slice of the sequence
    group = getattr(router, "tp_group", None)
    if group is not None:
        return (group.rank() if hasattr(group, "rank") else dist.get_rank(group)) == 0
    if dist.is_available() and dist.is_initialized():
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            return parallel_state.get_tensor_model_parallel_rank() == 0
    return True


def router_logits(router: torch.nn.Module, hidden: torch.Tensor) -> Optional[torch.Tensor]:
    """The router's logits for ``hidden``, as its forward computes them (before jitter / forced balancing).

    ``Router.gating`` is megatron-core's ``router_gating_linear(input, weight, bias,
    router_dtype)`` (``(input, weight, router_dtype)`` before routers had a bias,
    megatron-core 0.13 and 0.14) with ``router_dtype`` from ``moe_router_dtype``, after a
    one-time move of CPU-initialised weights to the GPU (done by the forward already).
    That function is called here directly, so a hook never touches the weights; a
    router class that overrides ``gating`` has its own ``gating`` called. None for a
    router without one.
    """
    try:
        from megatron.core.transformer.moe import moe_utils
        from megatron.core.transformer.moe.router import Router
    except ImportError:
        Router = moe_utils = None  # noqa: N806
    gating_linear = getattr(moe_utils, "router_gating_linear", None)
    if Router is not None and gating_linear is not None and type(router).gating is Router.gating:
        dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(getattr(router.config, "moe_router_dtype", None),
                                                                   hidden.dtype)
        if hasattr(router, "bias"):  # releases whose routers have a bias (None when off) pass it
            return gating_linear(hidden, router.weight, router.bias, dtype)
        return gating_linear(hidden, router.weight, dtype)
    gating = getattr(router, "gating", None)
    return gating(hidden) if gating is not None else None


def _megatron_loss_tracker() -> dict:
    from megatron.core.transformer.moe import moe_utils

    getter = getattr(moe_utils, "get_moe_layer_wise_logging_tracker", None)
    return getter() if getter is not None else {}


def _inside_backward() -> bool:
    """True while the autograd engine runs (activation recomputation runs forwards there)."""
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and task_id() != -1
