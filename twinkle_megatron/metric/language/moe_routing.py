"""MoE routing health: the metric's states, what each router call adds to them, and the formulas of its results.

**States** (on the device; fed per router call by the router hooks of
:mod:`twinkle_megatron.megatron.router_hooks`, which ``instrument()`` attaches).
Per layer ``i`` (row ``i = layer_number − 1``, Megatron's global 1-based layer
number; MTP layers follow the decoder's):

- ``load[i, e]``: tokens routed to expert ``e`` (``Σ_t routing_map[t, e]``,
  ``routing_map`` the router's ``[tokens, experts]`` boolean map of the experts
  each token is dispatched to: top-k, after token dropping);
- ``tokens[i]``: tokens seen by the router;
- ``entropy[i]``: ``Σ_t H(softmax(z_t))``, ``z_t`` the router logits of token ``t``
  (``H(p) = −Σ_e p_e log p_e``);

padding tokens (``padding_mask`` True, megatron-core's convention) excluded from
all three. Tokens with any non-finite logit are left out of the entropy and
counted (``entropy_tokens``, ``nonfinite``).

**Megatron's router losses** (``load_balancing_loss``, ``seq_load_balancing_loss``,
``global_load_balancing_loss``, ``z_loss``): what a router call added to
megatron-core's layer-wise tracker goes to a ``[layers]`` sum state, with a
weight in a second one:

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

**Which ranks count.** The states are ``[layers, experts]`` sums in the
collection's one SUM all-reduce over the world: each pipeline stage fills the
rows of its own layers (the others are zeros), DP, CP and EP ranks route
different tokens and all count; TP ranks route the same tokens unless sequence
parallelism splits the sequence over them: without it only TP rank 0 records,
with it every TP rank records its part; an activation recomputation is not
recorded again (the hooks decide; see :mod:`twinkle_megatron.megatron.router_hooks`).
So the totals equal a single process's on the same global batch.

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

import math
from typing import Any, Iterable, Optional, Union

import torch

from ... import keys
from ..state.base import Metric, Number, SyncedStates

# Megatron's names of the router losses it adds to its layer-wise tracker (megatron-core 0.13-0.16).
ROUTER_LOSSES = ("load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss", "z_loss")


class MoERoutingMetric(Metric):
    """Routing health of the MoE layers of a model: loads, utilisation, dead experts, entropy, router losses.

    Fed by the router hooks (``instrument()`` attaches them; :mod:`twinkle_megatron.megatron.router_hooks`) through
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
        selected: Optional[torch.Tensor] = None
        if padding_mask is not None:
            if padding_mask.numel() != num_tokens:
                raise ValueError(f"MoERoutingMetric: layer {layer_number}: padding_mask has shape "
                                 f"{tuple(padding_mask.shape)} ({padding_mask.numel()} elements) but routing_map "
                                 f"has {num_tokens} tokens")
            selected = ~padding_mask.reshape(-1).to(device=routed.device, dtype=torch.bool)
            routed = routed & selected[:, None]
        self._add_row("load", row, routed.sum(0))
        self._add_row("tokens", row, num_tokens if selected is None else selected.sum())
        if logits is not None:
            if tuple(logits.shape[-1:]) != (self.num_experts,) or logits.numel() != routing_map.numel():
                raise ValueError(f"MoERoutingMetric: layer {layer_number}: logits have shape "
                                 f"{tuple(logits.shape)}, routing_map {tuple(routing_map.shape)}")
            logits = logits.detach().reshape(-1, self.num_experts)
            logits = logits if logits.dtype == torch.float64 else logits.float()
            logprobs = logits.log_softmax(-1)
            entropy = -(logprobs.exp() * logprobs).sum(-1)  # NaN for a token with any non-finite logit
            finite = torch.isfinite(entropy)
            counted = finite if selected is None else finite & selected
            self._add_row("entropy", row, torch.where(counted, entropy, 0.0).sum(dtype=torch.float64))
            self._add_row("entropy_tokens", row, counted.sum())
            self._add_row("nonfinite", row, (~finite if selected is None else ~finite & selected).sum())

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

    def compute(self, states: SyncedStates) -> dict[str, Number]:
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

    def _layer_stats(self, row: int, states: SyncedStates) -> dict[str, Number]:
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
