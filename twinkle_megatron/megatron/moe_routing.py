"""MoE routing health: forward hooks on megatron-core's routers, and the metric they feed.

**What is recorded.** A megatron-core MoE layer routes its tokens with a
``Router`` (``TopKRouter`` by default): ``router(hidden, padding_mask)`` returns
``(probs, routing_map)``, ``routing_map`` a ``[tokens, experts]`` boolean map of
the experts each token is dispatched to (top-k, after token dropping). The router
runs *before* the token dispatcher (``MoELayer.route`` precedes ``dispatch``), so
under expert parallelism it sees exactly its own rank's tokens. A forward hook on
every router adds, per layer ``i`` (row ``i = router.layer_number - 1``, the
global 0-based layer index; MTP layers follow the decoder's), on the device:

- ``load[i, e]``: tokens routed to expert ``e`` (``Σ_t routing_map[t, e]``);
- ``tokens[i]``: tokens seen by the router;
- ``entropy[i]``: ``Σ_t H(softmax(z_t))``, ``z_t`` the router logits of token ``t``
  (``H(p) = −Σ_e p_e log p_e``);

padding tokens (``padding_mask`` True, megatron-core's convention) excluded from
all three. The logits are recomputed in the hook from the router's input by
what the router's ``gating`` calls (megatron-core's ``router_gating_linear``:
the same function, weights, dtype and kernel as the router's call, so the same
logits; see :func:`router_logits`) — one ``[tokens, hidden] × [hidden, experts]``
product, as cheap as the router's own.
The probabilities the router returns cannot give the entropy: with the default
score function they are a softmax over the top-k logits only. (Differences:
with ``moe_input_jitter_eps`` the entropy is that of the un-jittered logits; with
``moe_router_force_load_balancing`` that of the real, not the random, logits.)
Tokens with any non-finite logit are left out of the entropy and counted.

**Megatron's router losses.** Routers that compute an auxiliary loss
(``load_balancing_loss``, ``seq_load_balancing_loss``,
``global_load_balancing_loss``) or the z-loss add each microbatch's value to
megatron-core's layer-wise tracker (``get_moe_layer_wise_logging_tracker()``).
A pre-hook keeps the layer's tracker value, the hook adds the difference (in
float64: exact) to a ``[layers]`` sum state, with a weight in a second one:

- an auxiliary loss has a reduce group ``G`` (the TP×CP ranks, for the global
  one TP×DP×CP, each holding a part of one microbatch's loss): weight ``1/|G|``,
  so a layer reports ``Σ value / Σ 1/|G|`` over ranks and microbatches: summed
  over ``G``, averaged over microbatches and the other (data-parallel) ranks —
  exactly Megatron-LM's ``track_moe_metrics`` reduction in megatron-core 0.16
  (before it, that reduction leaves out the DP average, so Megatron-LM logs its
  last rank's own value; the DP mean here does not depend on which rank logs);
- the z-loss has none: each rank's value is the mean of ``logsumexp(z_t)²``
  over its own (non-padding) tokens ``T_r``; it is added as ``value·T_r`` with
  weight ``T_r``, so a layer reports the mean over *all* tokens of all ranks.
  (Megatron-LM logs each rank's own value unreduced; a plain mean over ranks
  would change with the layout whenever ranks hold different numbers of tokens:
  sequence-parallel halves with padding.)

The tracker is only read, never changed: Megatron-LM's own reduction and
clearing of it are untouched, and whoever clears it, whenever, the differences
stay exact. (Read rather than recomputed: the auxiliary loss of a microbatch is
a product of two sums over the microbatch's tokens, reduced over ``G`` inside
the router; it cannot be rebuilt from per-token sums without a collective per
microbatch.)

**Which ranks count.** The states are ``[layers, experts]`` sums in the
collection's one SUM all-reduce over the world: each pipeline stage fills the
rows of its own layers (the others are zeros), DP, CP and EP ranks route
different tokens and all count; TP ranks route the same tokens unless sequence
parallelism splits the sequence over them: without it only TP rank 0 counts,
with it every TP rank counts its part. A pass inside the autograd engine is an
activation recomputation of a forward already counted: its routing is not
counted again (Megatron's losses are read in whichever pass computes them: with
recomputation, the recomputing one). So the totals equal a single process's on
the same global batch.

**Results** (``calculate()``; Python numbers, the same on every rank, ``{}`` when
no MoE layer saw a token). ``T`` tokens of layer ``i``, ``k`` experts per token,
``E`` experts, ``n_e`` the load of expert ``e``, balanced load ``b = T·k/E``:

- utilisation ``u_e = n_e / b`` (1 = balanced share; the mean over experts is 1
  unless tokens were dropped); per layer ``utilization_min = min_e u_e``,
  ``utilization_max = max_e u_e``, ``utilization_cv = std_e(n) / mean_e(n)``
  (population std);
- ``dead_expert_fraction``: experts with ``n_e = 0`` in the interval, / ``E``;
- ``routing_entropy_norm = exp(Σ_t H / T) / E``: the effective number of experts
  per token over ``E``, in ``[1/E, 1]`` (1: uniform routing distributions, 1/E:
  one-hot);
- **imbalance** of a layer = its **overload factor** = ``utilization_max`` =
  ``max_e n_e / b``. Per expert, not per EP rank: it is layout-free (the same for
  every EP size, like every result here), it is the capacity factor
  (``moe_expert_capacity_factor`` is per expert) at which no token of the
  interval would have been dropped, and it bounds the overload of every EP rank
  (a rank's load is the mean of its experts' loads, at most their maximum), so a
  buffer sized by it fits any EP layout. Over an interval it is a lower bound of
  the per-microbatch peaks.

Aggregates over the MoE layers (always reported): the mean, p50, p90 (linear
interpolation) and max of the imbalance, the index of the worst layer (the
lowest on ties), the lowest utilisation, the mean CV, dead fraction and
normalised entropy, the tokens per layer, and each of Megatron's router losses
that was computed, averaged over the layers that computed it (Megatron-LM's
``Σ_layers / num_moe_layers``). Per-layer keys (``moe/layer_{i}/...``,
including the utilisation of every expert) only with ``per_layer=True``: a model
with hundreds of layers × experts must not flood a dashboard.
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import torch
import torch.distributed as dist

from .. import keys
from ..metric.base import Metric, Number, StateValues

# Megatron's names of the router losses it adds to its layer-wise tracker (megatron-core 0.13-0.16).
ROUTER_LOSSES = ("load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss", "z_loss")


class MoERoutingMetric(Metric):
    """Routing health of the MoE layers of a model: loads, utilisation, dead experts, entropy, router losses.

    Fed by :class:`MoERoutingHooks` (``instrument()`` attaches them) through
    :meth:`record_routing` and :meth:`record_router_loss`; ``accumulate`` takes
    nothing (the microbatch's inputs and outputs hold no routing). Formulas,
    reductions and the keys: see the module docstring.

    Args:
        num_layers: rows of the states: the model's layers (+ MTP layers); layer
            number ``n`` (1-based, Megatron's) is row ``n − 1``.
        num_experts: ``E``, experts per MoE layer.
        topk: ``k``, experts per token.
        per_layer: also report ``moe/layer_{i}/...`` keys.
    """

    every_rank_counts = True  # every rank holds its own stage's rows; duplicates (TP) are never recorded

    def __init__(self, num_layers: int, num_experts: int, topk: int, *, per_layer: bool = False,
                 device_mesh: Any = None, process_group: Any = None, **kwargs: Any) -> None:
        super().__init__(device_mesh, process_group, **kwargs)
        if num_layers < 1 or num_experts < 1 or not 1 <= topk <= num_experts:
            raise ValueError(f"MoERoutingMetric: need num_layers >= 1, num_experts >= 1 and 1 <= topk <= "
                             f"num_experts; got {num_layers}, {num_experts}, {topk}")
        self.num_layers, self.num_experts, self.topk, self.per_layer = num_layers, num_experts, topk, per_layer
        self.add_state("load", "sum", (num_layers, num_experts))
        self.add_state("tokens", "sum", (num_layers,))
        self.add_state("entropy", "sum", (num_layers,))
        self.add_state("entropy_tokens", "sum", (num_layers,))  # tokens with finite logits
        self.add_state("nonfinite", "sum", (num_layers,))
        for name in ROUTER_LOSSES:
            self.add_state(name, "sum", (num_layers,))
            self.add_state(f"{name}_weight", "sum", (num_layers,))

    # ------------------------------------------------------------- recording

    def accumulate(self, inputs: Any, outputs: Any, **kwargs: Any) -> None:
        """Nothing: the routing comes from the router hooks (:meth:`record_routing`)."""

    def record_routing(self, layer_number: int, routing_map: torch.Tensor, logits: Optional[torch.Tensor] = None,
                       padding_mask: Optional[torch.Tensor] = None) -> None:
        """Add one router call: ``routing_map [tokens, E]`` (bool), its ``logits [tokens, E]`` for the entropy,
        ``padding_mask`` (``tokens`` elements, True = padding, left out). Device ops only."""
        row = self._row(layer_number)
        routing_map = routing_map.reshape(-1, routing_map.shape[-1]) if routing_map.dim() else routing_map
        if routing_map.dim() != 2 or routing_map.shape[1] != self.num_experts:
            raise ValueError(f"MoERoutingMetric: layer {layer_number}: routing_map has shape "
                             f"{tuple(routing_map.shape)}, expected [tokens, {self.num_experts}]")
        num_tokens = routing_map.shape[0]
        routed = routing_map.bool()
        valid: Optional[torch.Tensor] = None
        if padding_mask is not None:
            if padding_mask.numel() != num_tokens:
                raise ValueError(f"MoERoutingMetric: layer {layer_number}: padding_mask has shape "
                                 f"{tuple(padding_mask.shape)} ({padding_mask.numel()} elements) but routing_map "
                                 f"has {num_tokens} tokens")
            valid = ~padding_mask.reshape(-1).to(device=routed.device, dtype=torch.bool)
            routed = routed & valid[:, None]
        self._add_row("load", row, routed.sum(0))
        self._add_row("tokens", row, num_tokens if valid is None else valid.sum())
        if logits is not None:
            if tuple(logits.shape[-1:]) != (self.num_experts,) or logits.numel() != routing_map.numel():
                raise ValueError(f"MoERoutingMetric: layer {layer_number}: logits have shape "
                                 f"{tuple(logits.shape)}, routing_map {tuple(routing_map.shape)}")
            logits = logits.detach().reshape(-1, self.num_experts)
            logits = logits if logits.dtype == torch.float64 else logits.float()
            logprobs = logits.log_softmax(-1)
            entropy = -(logprobs.exp() * logprobs).sum(-1)  # NaN for a token with any non-finite logit
            finite = torch.isfinite(entropy)
            counted = finite if valid is None else finite & valid
            self._add_row("entropy", row, torch.where(counted, entropy, 0.0).sum(dtype=torch.float64))
            self._add_row("entropy_tokens", row, counted.sum())
            self._add_row("nonfinite", row, (~finite if valid is None else ~finite & valid).sum())

    def record_router_loss(self, name: str, layer_number: int, value: Union[torch.Tensor, float],
                           weight: Union[torch.Tensor, float]) -> None:
        """Add ``value`` to Megatron's router loss ``name`` (one of :data:`ROUTER_LOSSES`) of a layer and
        ``weight`` to its weight; the layer reports Σ value / Σ weight (weights: see the module docstring)."""
        if name not in ROUTER_LOSSES:
            raise ValueError(f"MoERoutingMetric: unknown router loss {name!r}; known: {ROUTER_LOSSES}")
        row = self._row(layer_number)
        self._add_row(name, row, value)
        self._add_row(f"{name}_weight", row, weight)

    def _row(self, layer_number: int) -> int:
        if not isinstance(layer_number, int) or not 1 <= layer_number <= self.num_layers:
            raise ValueError(f"MoERoutingMetric: layer number {layer_number!r} outside 1..{self.num_layers}")
        return layer_number - 1

    def _add_row(self, name: str, row: int, value: Union[torch.Tensor, Number]) -> None:
        value = self._as_state(name, value)  # may move the states to the data's device first
        # In place, O(experts): the states are this metric's own tensors (reset() and loading make new ones).
        self._states[name].select(0, row).add_(value)

    # --------------------------------------------------------------- syncing

    def load_state_dict(self, state_dict: Any) -> None:
        super().load_state_dict(state_dict)
        self._states = {name: state.clone() for name, state in self._states.items()}  # updated in place

    # --------------------------------------------------------------- results

    def compute(self, states: StateValues) -> dict[str, Number]:
        tokens = torch.as_tensor(states["tokens"], dtype=torch.float64)
        layers = [row for row in range(self.num_layers) if tokens[row] > 0]
        if not layers:
            return {}
        stats = {row: self._layer_stats(row, states) for row in layers}
        imbalance = torch.tensor([stats[row]["utilization_max"] for row in layers], dtype=torch.float64)
        results: dict[str, Number] = {
            keys.MOE_LAYERS: len(layers),
            keys.MOE_TOKENS: float(tokens[layers].mean()),
            keys.MOE_UTILIZATION_MIN: min(stats[row]["utilization_min"] for row in layers),
            keys.MOE_UTILIZATION_CV: _mean(stats[row]["utilization_cv"] for row in layers),
            keys.MOE_DEAD_EXPERT_FRACTION: _mean(stats[row]["dead_expert_fraction"] for row in layers),
            keys.MOE_IMBALANCE_MEAN: float(imbalance.mean()),
            keys.MOE_IMBALANCE_P50: float(torch.quantile(imbalance, 0.5)),
            keys.MOE_IMBALANCE_P90: float(torch.quantile(imbalance, 0.9)),
            keys.MOE_IMBALANCE_MAX: float(imbalance.max()),
            keys.MOE_IMBALANCE_WORST_LAYER: layers[int(torch.argmax(imbalance))],  # the first maximum
        }
        with_entropy = [row for row in layers if "routing_entropy_norm" in stats[row]]
        if with_entropy:
            results[keys.MOE_ROUTING_ENTROPY_NORM] = _mean(stats[row]["routing_entropy_norm"] for row in with_entropy)
        for name in ROUTER_LOSSES:
            computed = [row for row in layers if name in stats[row]]
            if computed:
                results[keys.MOE_PREFIX + name] = _mean(stats[row][name] for row in computed)
        nonfinite = float(torch.as_tensor(states["nonfinite"]).sum())
        if nonfinite:
            results[keys.MOE_NONFINITE_ROUTER_TOKENS] = int(nonfinite)
        if self.per_layer:
            for row in layers:
                for stat, value in stats[row].items():
                    results[keys.moe_layer_key(row, stat)] = value
        return results

    def _layer_stats(self, row: int, states: StateValues) -> dict[str, Number]:
        load = torch.as_tensor(states["load"], dtype=torch.float64)[row]
        tokens = float(torch.as_tensor(states["tokens"])[row])
        utilization = load / (tokens * self.topk / self.num_experts)
        mean_load = float(load.mean())
        stats: dict[str, Number] = {
            "utilization_min": float(utilization.min()),
            "utilization_max": float(utilization.max()),
            "utilization_cv": float(load.std(unbiased=False)) / mean_load if mean_load > 0 else 0.0,
            "dead_expert_fraction": float((load == 0).sum()) / self.num_experts,
        }
        entropy_tokens = float(torch.as_tensor(states["entropy_tokens"])[row])
        if entropy_tokens > 0:
            mean_entropy = float(torch.as_tensor(states["entropy"])[row]) / entropy_tokens
            stats["routing_entropy_norm"] = math.exp(mean_entropy) / self.num_experts
        for name in ROUTER_LOSSES:
            weight = float(torch.as_tensor(states[f"{name}_weight"])[row])
            if weight > 0:
                stats[name] = float(torch.as_tensor(states[name])[row]) / weight
        if self.per_layer:
            for expert in range(self.num_experts):
                stats[f"expert_{expert}_utilization"] = float(utilization[expert])
        return stats


def _mean(values: Iterable[float]) -> float:
    values = list(values)
    return sum(values) / len(values)


# ------------------------------------------------------------------ hooks


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
                 on_error: Callable[[str, BaseException], None]) -> None:
        self.metric = metric
        self.on_error = on_error
        # More readers of each counted router call: (router, layer_number, routing_map, padding_mask).
        self.listeners: list[Callable[[torch.nn.Module, int, torch.Tensor, Any], None]] = []
        self._handles: list = []
        self._group_sizes: dict[int, int] = {}
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

    def _before_router(self, site: _RouterSite, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
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
                       on_error: Callable[[str, BaseException], None]) -> Optional[MoERoutingHooks]:
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
    return MoERoutingHooks(find_routers(chunks), metric, on_error)


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
