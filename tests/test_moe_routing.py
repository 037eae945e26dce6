"""MoE routing health: a real megatron-core GPTModel with MoE layers, through Megatron's schedules.

A tiny GPTModel (4 layers, each with 4 experts, top-2, megatron-core's TopKRouter,
aux and z losses on) is trained through the pipeline schedules on CPU gloo ranks
under PP2×DP2 (1F1B, with the MoE layers' activations recomputed), PP2×VPP2×DP2
(the interleaved schedule, one layer per chunk), PP2×DP2×EP2 (the all-gather token
dispatcher; the all-to-all one cannot run on gloo, see tests/kit/megatron_moe.py), TP2
with sequence parallelism, and evaluated under TP2 without it. After every
step, ``instrument()``'s ``calculate()`` must equal a single-process reference
counted from the routers' own routing maps (captured there by a plain forward
hook): tokens per expert per layer exactly, padding tokens excluded (where
GPTModel takes megatron-core's MoE ``padding_mask``: 0.16 on), routing
entropy from the router logits in float64, Megatron's aux and z losses as
Megatron-LM's own ``track_moe_metrics`` reduces them. Layer 1 has a planted
collapsed router (every token to the same two experts) and must be reported so.
Every rank gets the same results, the router hooks make no host sync
(``forbid_host_sync`` around them) and the collection's sync stays 2 collectives.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import inspect
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from kit.cuda_shim import cpu_cuda_shim
from kit.distributed import Layout, run_distributed
from kit.guards import count_collectives, forbid_host_sync, host_sync_free
from kit.megatron_gpt import GPTSpec, lm_loss_func, make_batch, run_forward_backward
from kit.megatron_moe import MoESpec, build_moe_model, init_parallel, moe_config, recompute_rng_on_cpu
from kit.readme import key_table
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.moe.moe_utils import save_to_aux_losses_tracker

from twinkle_megatron import keys
from twinkle_megatron.megatron import MetricHookError, instrument, moe_routing
from twinkle_megatron.megatron.moe_routing import MoERoutingHooks, MoERoutingMetric

ROOT = Path(__file__).resolve().parents[1]
SPEC = GPTSpec(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=64, max_sequence_length=16,
               add_bias_linear=False)
MOE = MoESpec(num_experts=4, topk=2)
E, K, LAYERS = MOE.num_experts, MOE.topk, SPEC.num_layers
GLOBAL_BATCH, MICRO_BATCH, LR = 8, 2, 0.05
COLLAPSED = 1  # 0-based index of the layer whose router sends every token to experts 0 and 1
COLLAPSED_LOGITS = (4.0, 3.0, -3.0, -4.0)
TIMEOUT = 120
# megatron-core 0.16 added GPTModel's MoE ``padding_mask``; before it every token is routed, and the runs
# go without padding.
PADDING = "padding_mask" in inspect.signature(GPTModel.forward).parameters
MEGATRON_AVERAGES_OVER_DP = "reduce_group_has_dp" in inspect.signature(save_to_aux_losses_tracker).parameters


def _batch() -> dict:
    batch = make_batch(SPEC, GLOBAL_BATCH, seed=11)
    padding = torch.zeros(GLOBAL_BATCH, SPEC.max_sequence_length, dtype=torch.bool)
    padding[::2, -5:] = True  # the last 5 positions of every other sequence are padding
    padding[1, :3] = True
    batch["padding_mask"] = padding  # megatron-core's convention: True = padding
    return batch


def _forward_step(data_iterator, model, *, padding: bool):
    """Megatron-LM's forward_step, with megatron-core's MoE ``padding_mask`` ([b, s], True = padding)."""
    batch = next(data_iterator)
    padding_mask = {"padding_mask": batch["padding_mask"]} if padding else {}
    output = model(input_ids=batch["tokens"], position_ids=batch["position_ids"], attention_mask=None,
                   labels=batch["labels"], **padding_mask)
    return output, functools.partial(lm_loss_func, batch["loss_mask"])


def _plant_collapse(chunks) -> None:
    """Layer COLLAPSED: its pre-MLP norm outputs the constant e_0 and its router maps e_0 to COLLAPSED_LOGITS,
    so every token's logits are COLLAPSED_LOGITS: all tokens go to experts 0 and 1, experts 2 and 3 are dead."""
    with torch.no_grad():
        for chunk in chunks:
            for layer in chunk.decoder.layers:
                if layer.layer_number - 1 == COLLAPSED:
                    layer.pre_mlp_layernorm.weight.zero_()
                    layer.pre_mlp_layernorm.bias.zero_()
                    layer.pre_mlp_layernorm.bias[0] = 1.0
                    layer.mlp.router.weight[:, 0] = torch.tensor(COLLAPSED_LOGITS)


def _sgd_step(chunks) -> None:
    """Plain SGD on gradients summed over the data-parallel ranks of each parameter (experts: expert DP)."""
    dense = parallel_state.get_data_parallel_group(with_context_parallel=True)
    experts = parallel_state.get_expert_data_parallel_group()
    with torch.no_grad():
        for chunk in chunks:
            for name, param in chunk.named_parameters():
                if param.grad is None:
                    continue
                if getattr(param, "sequence_parallel", False):
                    dist.all_reduce(param.grad, group=parallel_state.get_tensor_model_parallel_group())
                group = experts if ".mlp.experts." in name else dense
                if dist.get_world_size(group) > 1:
                    dist.all_reduce(param.grad, group=group)
                param -= LR * param.grad
                param.grad = None


def _megatron_reduction(num_microbatches: int, step: int) -> dict:
    """Megatron-LM's own reduction of megatron-core's aux-loss tracker (training_log → track_moe_metrics)."""
    from megatron.core.transformer.moe.moe_utils import track_moe_metrics

    class DiscardingWriter:  # megatron-core before 0.16 fills total_loss_dict only when given a writer
        def add_scalar(self, *args, **kwargs) -> None:
            pass

    total: dict = {}
    track_moe_metrics(loss_scale=1.0 / num_microbatches, iteration=step, writer=DiscardingWriter(),
                      total_loss_dict=total, num_layers=SPEC.num_layers)
    return {name: float(value) for name, value in total.items()}


# ------------------------------------------------------------------ the single-process reference


def _reference_worker(steps: int, padding: bool) -> list[dict]:
    batch = _batch()
    calls: list = []
    results = []
    with cpu_cuda_shim():
        (model,) = build_moe_model(SPEC, moe_config(SPEC, MOE))
        _plant_collapse([model])

        def capture(router, args, kwargs, output):
            """The router's own routing map, input, weights and padding mask of every call."""
            padding_mask = args[1] if len(args) > 1 else kwargs.get("padding_mask")
            calls.append((router.layer_number - 1, output[1].detach().clone(),
                          args[0].detach().double().reshape(-1, SPEC.hidden_size),
                          router.weight.detach().double().clone(), padding_mask))

        for layer in model.decoder.layers:
            layer.mlp.router.register_forward_hook(capture, with_kwargs=True)
        microbatches = GLOBAL_BATCH // MICRO_BATCH
        for step in range(1, steps + 1):
            calls.clear()
            run_forward_backward(model, batch, micro_batch_size=MICRO_BATCH,
                                 forward_step_func=functools.partial(_forward_step, padding=padding))
            load = torch.zeros(LAYERS, E, dtype=torch.float64)
            tokens = torch.zeros(LAYERS, dtype=torch.float64)
            entropy = torch.zeros(LAYERS, dtype=torch.float64)
            z_loss = torch.zeros(LAYERS, dtype=torch.float64)
            for row, routing_map, hidden, weight, padding_mask in calls:
                valid = torch.ones(routing_map.shape[0], dtype=torch.bool) if padding_mask is None \
                    else ~padding_mask.reshape(-1)
                load[row] += routing_map[valid].sum(0)
                tokens[row] += valid.sum()
                logits = hidden @ weight.T
                logprobs = logits.log_softmax(-1)
                entropy[row] += -(logprobs.exp() * logprobs).sum(-1)[valid].sum()
                z_loss[row] += (logits.logsumexp(-1) ** 2)[valid].sum()
            from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

            per_layer_losses = {name: (entry["values"].double() / microbatches).tolist()
                                for name, entry in get_moe_layer_wise_logging_tracker().items()}
            results.append({"load": load, "tokens": tokens, "entropy": entropy, "z_loss": z_loss / tokens,
                            "per_layer_losses": per_layer_losses,
                            "megatron": _megatron_reduction(microbatches, step)})
            _sgd_step([model])
    return results


@functools.cache
def reference(steps: int = 2, padding: bool = PADDING) -> list[dict]:
    return run_distributed(_reference_worker, layout=Layout(), args=(steps, padding), timeout=TIMEOUT)[0]


# ------------------------------------------------------------------ the instrumented distributed runs


def _train_worker(tp: int, pp: int, ep: int, sequence_parallel: bool, recompute: bool, steps: int, padding: bool,
                  evaluate: bool, vpp: int | None) -> list[dict]:
    # Every host sync inside our router hooks raises; the failure is recorded and raised by calculate().
    MoERoutingHooks._before_router = host_sync_free(MoERoutingHooks._before_router)
    MoERoutingHooks._after_router = host_sync_free(MoERoutingHooks._after_router)
    init_parallel(tp, pp, ep, vpp)
    batch = _batch()
    overrides = dict(sequence_parallel=sequence_parallel)
    if recompute:
        overrides.update(recompute_granularity="selective", recompute_modules=["moe"])
    results = []
    with cpu_cuda_shim(), recompute_rng_on_cpu():
        chunks = build_moe_model(SPEC, moe_config(SPEC, MOE, **overrides))
        _plant_collapse(chunks)
        if evaluate:
            for chunk in chunks:
                chunk.eval()
        routers = moe_routing.find_routers(chunks)
        in_backward: list = []  # router calls inside the autograd engine: activation recomputation
        for router in routers:
            router.register_forward_hook(lambda *_: in_backward.append(torch._C._current_graph_task_id() != -1))
        hooks_before = [(len(r._forward_pre_hooks), len(r._forward_hooks)) for r in routers]
        metrics = instrument(chunks, vocab_size=SPEC.vocab_size, moe_per_layer=True)
        microbatches = GLOBAL_BATCH // MICRO_BATCH // parallel_state.get_data_parallel_world_size()
        for step in range(1, steps + 1):
            run_forward_backward(chunks, batch, micro_batch_size=MICRO_BATCH, forward_only=evaluate,
                                 forward_step_func=metrics.wrap(functools.partial(_forward_step, padding=padding)))
            states = metrics.moe.metric.state_dict()["states"]  # the reduced states (collective, no reset)
            with count_collectives() as collectives:
                result = metrics.calculate()
            results.append({"result": result, "collectives": sum(collectives.values()),
                            "load": states["load"], "tokens": states["tokens"],
                            "megatron": _megatron_reduction(microbatches, step)})
            if not evaluate:
                _sgd_step(chunks)
        metrics.detach()
        hooks_after = [(len(r._forward_pre_hooks), len(r._forward_hooks)) for r in routers]
        results.append({"hooks_left": hooks_after == hooks_before, "routers": len(routers),
                        "recomputed_calls": sum(in_backward)})
    return results


# (tp, pp, ep, sequence_parallel, recompute, steps, padding, evaluate, vpp)
RUNS = {
    "pp2_dp2_recompute": (1, 2, 1, False, True, 2, PADDING, False, None),
    "pp2_vpp2_dp2": (1, 2, 1, False, False, 1, PADDING, False, 2),
    "pp2_dp2_ep2": (1, 2, 2, False, False, 2, PADDING, False, None),
    "tp2_sp": (2, 1, 1, True, False, 1, PADDING, False, None),
    "tp2_eval": (2, 1, 1, False, False, 1, PADDING, True, None),
}


@functools.cache
def run(name: str) -> list[list[dict]]:
    tp, pp = RUNS[name][:2]
    world = 4 if pp == 2 else tp
    return run_distributed(_train_worker, world_size=world, args=RUNS[name], timeout=TIMEOUT)


def _per_layer(result: dict, layer: int, stat: str) -> float:
    return result[keys.moe_layer_key(layer, stat)]


@pytest.mark.parametrize("name", list(RUNS))
def test_routing_statistics_equal_the_single_process_reference(name):
    _, _, _, _, _, steps, padding, evaluate, _ = RUNS[name]
    expected = reference(padding=padding)
    per_rank = run(name)
    for step in range(steps):
        results = [rank_steps[step]["result"] for rank_steps in per_rank]
        assert all(r == results[0] for r in results), f"step {step}: ranks disagree"
        result, want = results[0], expected[step]
        got = per_rank[0][step]
        # Tokens per expert per layer: exactly the routers' routing maps, padding excluded, each token once.
        assert torch.equal(got["load"], want["load"]), (step, got["load"], want["load"])
        assert torch.equal(got["tokens"], want["tokens"])
        if padding:
            assert int(want["tokens"][0]) < GLOBAL_BATCH * SPEC.max_sequence_length, "padding is excluded"
        assert result[keys.MOE_LAYERS] == LAYERS and result[keys.MOE_TOKENS] == float(want["tokens"].mean())
        balanced = want["tokens"][:, None] * K / E
        utilization = want["load"] / balanced
        for layer in range(LAYERS):
            for expert in range(E):
                assert _per_layer(result, layer, f"expert_{expert}_utilization") == \
                    pytest.approx(float(utilization[layer, expert]), rel=1e-12)
            entropy_norm = math.exp(float(want["entropy"][layer] / want["tokens"][layer])) / E
            assert _per_layer(result, layer, "routing_entropy_norm") == pytest.approx(entropy_norm, rel=1e-5)
        imbalance = utilization.max(1).values
        assert result[keys.MOE_IMBALANCE_MAX] == pytest.approx(float(imbalance.max()), rel=1e-12)
        assert result[keys.MOE_IMBALANCE_MEAN] == pytest.approx(float(imbalance.mean()), rel=1e-12)
        assert result[keys.MOE_IMBALANCE_P90] == pytest.approx(float(torch.quantile(imbalance, 0.9)), rel=1e-12)
        assert {"accuracy", "loss"} <= set(result), "the token metrics are still there"
        # The collection's one sync: still 2 collectives with the MoE states in it.
        assert all(rank_steps[step]["collectives"] == 2 for rank_steps in per_rank)
        if evaluate:
            assert not any(key in result for key in ("moe/load_balancing_loss", "moe/z_loss")), \
                "Megatron computes no router loss in evaluation: none reported"
            continue
        # Megatron's aux loss: what Megatron-LM's own reduction of its tracker reports, in this run (after our
        # calculate(): the tracker is left as it was) and in the reference.
        # megatron-core 0.16 averages it over DP, so every rank reports the same; before 0.16 each DP rank
        # reports its own (Megatron-LM logs the last rank's): ours is their mean in every release.
        megatron = [rank_steps[step]["megatron"]["load_balancing_loss"] for rank_steps in per_rank]
        assert result["moe/load_balancing_loss"] == pytest.approx(sum(megatron) / len(megatron), rel=1e-6), megatron
        if MEGATRON_AVERAGES_OVER_DP:
            assert all(value == pytest.approx(megatron[0], rel=1e-6) for value in megatron), megatron
        assert result["moe/load_balancing_loss"] == pytest.approx(want["megatron"]["load_balancing_loss"], rel=1e-5)
        for layer in range(LAYERS):
            assert _per_layer(result, layer, "load_balancing_loss") == \
                pytest.approx(want["per_layer_losses"]["load_balancing_loss"][layer], rel=1e-5), layer
        # Megatron's z-loss, pooled by tokens: the mean of logsumexp(logits)² over all tokens (float64 reference).
        for layer in range(LAYERS):
            assert _per_layer(result, layer, "z_loss") == pytest.approx(float(want["z_loss"][layer]), rel=1e-5)
        assert result["moe/z_loss"] == pytest.approx(float(want["z_loss"].mean()), rel=1e-5)
    finish = [rank_steps[-1] for rank_steps in per_rank]
    assert all(f["hooks_left"] for f in finish), "detach() removes every router hook"
    recomputing = RUNS[name][4]
    assert all((f["recomputed_calls"] > 0) == recomputing for f in finish), \
        "with recomputation the routers run again in backward (and are not counted twice)"
    assert sum(f["routers"] for f in finish) == LAYERS * len(finish) // (2 if RUNS[name][1] == 2 else 1)


def test_a_collapsed_router_is_reported_as_collapsed():
    for name in ("pp2_dp2_ep2", "tp2_sp"):
        result = run(name)[0][0]["result"]
        assert _per_layer(result, COLLAPSED, "dead_expert_fraction") == 0.5
        assert _per_layer(result, COLLAPSED, "utilization_min") == 0.0
        assert _per_layer(result, COLLAPSED, "utilization_max") == E / K  # every token: the largest possible
        assert _per_layer(result, COLLAPSED, "utilization_cv") == pytest.approx(1.0)
        assert _per_layer(result, COLLAPSED, "expert_0_utilization") == E / K
        assert _per_layer(result, COLLAPSED, "expert_1_utilization") == E / K
        probs = torch.tensor(COLLAPSED_LOGITS, dtype=torch.float64).softmax(-1)
        entropy_norm = float(torch.special.entr(probs).sum().exp()) / E
        assert _per_layer(result, COLLAPSED, "routing_entropy_norm") == pytest.approx(entropy_norm, rel=1e-5)
        assert result[keys.MOE_IMBALANCE_WORST_LAYER] == COLLAPSED
        assert result[keys.MOE_IMBALANCE_MAX] == E / K
        assert result[keys.MOE_UTILIZATION_MIN] == 0.0
        healthy = [layer for layer in range(LAYERS) if layer != COLLAPSED]
        assert all(_per_layer(result, layer, "dead_expert_fraction") == 0 for layer in healthy)
        assert result[keys.MOE_DEAD_EXPERT_FRACTION] == pytest.approx(0.5 / LAYERS)


# ------------------------------------------------------------------ one process: hooks, guard, switches


def _single_process_checks() -> dict:
    batch = _batch()
    out: dict = {}
    with cpu_cuda_shim():
        chunks = build_moe_model(SPEC, moe_config(SPEC, MOE))
        step = functools.partial(_forward_step, padding=PADDING)
        # Per-layer keys are off by default; the aggregates are there.
        metrics = instrument(chunks, vocab_size=SPEC.vocab_size)
        run_forward_backward(chunks, batch, micro_batch_size=MICRO_BATCH, forward_step_func=metrics.wrap(step))
        out["default_keys"] = sorted(k for k in metrics.calculate() if k.startswith(keys.MOE_PREFIX))
        out["nothing_seen"] = {k: v for k, v in metrics.calculate().items() if k.startswith(keys.MOE_PREFIX)}
        metrics.detach()
        # moe_routing=False: no MoE metric, no router hooks.
        plain = instrument(chunks, vocab_size=SPEC.vocab_size, moe_routing=False)
        out["disabled"] = (plain.moe, len(plain.metrics),
                           sum(len(r._forward_hooks) for r in moe_routing.find_routers(chunks)))
        plain.detach()
        # A dense GPTModel (no MoE layers): no MoE metric.
        from kit.megatron_gpt import build_gpt_model

        dense = instrument(build_gpt_model(SPEC), vocab_size=SPEC.vocab_size)
        out["dense"] = (dense.moe, [type(m).__name__ for m in dense.metrics.metrics])
        dense.detach()
        # The guard of the distributed tests catches a host sync in a router hook: calculate() raises it.
        original = MoERoutingMetric.record_routing

        def syncing(self, layer_number, routing_map, *args, **kwargs):
            routing_map.sum().item()
            return original(self, layer_number, routing_map, *args, **kwargs)

        MoERoutingMetric.record_routing = syncing
        MoERoutingHooks._after_router = host_sync_free(MoERoutingHooks._after_router)
        guarded = instrument(chunks, vocab_size=SPEC.vocab_size)
        run_forward_backward(chunks, batch, micro_batch_size=MICRO_BATCH, forward_step_func=guarded.wrap(step),
                             forward_only=True)
        try:
            guarded.calculate()
            out["guard"] = "no error"
        except MetricHookError as error:
            out["guard"] = str(error)
    return out


def test_keys_switches_dense_models_and_the_host_sync_guard():
    out = run_distributed(_single_process_checks, layout=Layout(), timeout=TIMEOUT)[0]
    aggregates = {key for key, _ in keys.MOE_KEYS}
    assert set(out["default_keys"]) <= aggregates, set(out["default_keys"]) - aggregates
    assert {keys.MOE_IMBALANCE_MAX, keys.MOE_DEAD_EXPERT_FRACTION, keys.MOE_ROUTING_ENTROPY_NORM,
            "moe/load_balancing_loss", "moe/z_loss"} <= set(out["default_keys"])
    assert out["nothing_seen"] == {}, "an interval without routing reports no moe/ key"
    assert out["disabled"][0] is None and out["disabled"][2] == 0
    assert out["dense"][0] is None and "MoERoutingMetric" not in out["dense"][1]
    assert "host sync: aten::_local_scalar_dense" in out["guard"], out["guard"]


# ------------------------------------------------------------------ the metric alone: formulas, edge cases


def _metric(**kwargs) -> MoERoutingMetric:
    return MoERoutingMetric(num_layers=3, num_experts=4, topk=2, **kwargs)


def _routing_map(pairs) -> torch.Tensor:
    routing_map = torch.zeros(len(pairs), 4, dtype=torch.bool)
    for token, experts in enumerate(pairs):
        routing_map[token, list(experts)] = True
    return routing_map


def test_formulas_on_a_hand_made_interval():
    metric = _metric(per_layer=True)
    # Layer 1 (row 0): 4 tokens, loads [3, 2, 2, 1]; layer 3 (row 2): loads [4, 4, 0, 0]; layer 2 unseen.
    metric.record_routing(1, _routing_map([(0, 1), (0, 2), (0, 3), (1, 2)]))
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0]] * 2 + [[10.0, 10.0, -30.0, -30.0]] * 2)
    metric.record_routing(3, _routing_map([(0, 1)] * 4), logits=logits)
    result = metric.calculate()
    assert result[keys.MOE_LAYERS] == 2 and result[keys.MOE_TOKENS] == 4.0
    b = 4 * 2 / 4
    assert result["moe/layer_0/utilization_min"] == 1 / b and result["moe/layer_0/utilization_max"] == 3 / b
    loads = torch.tensor([3.0, 2.0, 2.0, 1.0])
    assert result["moe/layer_0/utilization_cv"] == pytest.approx(float(loads.std(unbiased=False) / loads.mean()))
    assert result["moe/layer_0/dead_expert_fraction"] == 0 and result["moe/layer_2/dead_expert_fraction"] == 0.5
    assert "moe/layer_1/utilization_min" not in result, "a layer without tokens reports nothing"
    assert "moe/layer_0/routing_entropy_norm" not in result, "no logits, no entropy"
    # Two uniform tokens (H = log 4) and two split evenly over two experts (H = log 2).
    assert result["moe/layer_2/routing_entropy_norm"] == pytest.approx(math.exp((math.log(4) + math.log(2)) / 2) / 4)
    assert result[keys.MOE_ROUTING_ENTROPY_NORM] == result["moe/layer_2/routing_entropy_norm"]
    assert result[keys.MOE_IMBALANCE_MAX] == 2.0 and result[keys.MOE_IMBALANCE_WORST_LAYER] == 2
    assert result[keys.MOE_IMBALANCE_MEAN] == pytest.approx((1.5 + 2.0) / 2)
    assert result[keys.MOE_IMBALANCE_P50] == pytest.approx(1.75) and result[keys.MOE_IMBALANCE_P90] == \
        pytest.approx(1.95)
    assert result[keys.MOE_DEAD_EXPERT_FRACTION] == 0.25 and result[keys.MOE_UTILIZATION_MIN] == 0.0
    assert result["moe/layer_2/expert_0_utilization"] == 2.0
    assert all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in result.values())
    assert metric.calculate() == {}, "calculate() resets"


def test_padding_and_nonfinite_logits_are_left_out_and_counted():
    metric = _metric()
    padding = torch.tensor([False, True, False, True])
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [5.0, 1.0, 0.0, 0.0], [float("nan"), 0.0, 0.0, 0.0],
                           [float("inf"), 0.0, 0.0, 0.0]])
    metric.record_routing(2, _routing_map([(0, 1), (2, 3), (0, 2), (2, 3)]), logits=logits, padding_mask=padding)
    result = metric.calculate()
    assert result[keys.MOE_TOKENS] == 2.0, "padding tokens are not counted"
    assert result[keys.MOE_UTILIZATION_MIN] == 0.0  # loads [2, 1, 1, 0]: expert 3 only had padding
    assert result[keys.MOE_IMBALANCE_MAX] == 2.0
    assert result[keys.MOE_NONFINITE_ROUTER_TOKENS] == 1, "the NaN token counts, the padded inf one does not"
    assert result[keys.MOE_ROUTING_ENTROPY_NORM] == pytest.approx(1.0), "only the uniform token is averaged"


def test_ties_percentiles_and_worst_layer():
    metric = _metric()
    for layer in (1, 2, 3):
        metric.record_routing(layer, _routing_map([(0, 1), (0, 1)]))  # every layer: loads [2, 2, 0, 0]
    result = metric.calculate()
    assert result[keys.MOE_IMBALANCE_WORST_LAYER] == 0, "ties go to the lowest layer"
    assert result[keys.MOE_IMBALANCE_P50] == result[keys.MOE_IMBALANCE_P90] == 2.0


def test_router_losses_are_weighted_by_their_reduce_group():
    metric = _metric()
    metric.record_routing(1, _routing_map([(0, 1)]))
    # Two ranks of one TP×CP group each hold half of a microbatch's loss 1.2; another microbatch: 0.8.
    metric.record_router_loss("load_balancing_loss", 1, torch.tensor(0.5, dtype=torch.float64), 0.5)
    metric.record_router_loss("load_balancing_loss", 1, 0.7, 0.5)
    metric.record_router_loss("load_balancing_loss", 1, 0.8, 1.0)
    result = metric.calculate()
    assert result["moe/load_balancing_loss"] == pytest.approx(1.0)
    assert "moe/z_loss" not in result, "a loss Megatron did not compute is not reported"
    with pytest.raises(ValueError, match="unknown router loss"):
        metric.record_router_loss("aux", 1, 0.1, 1.0)


def test_bad_input_raises_with_both_shapes():
    metric = _metric()
    with pytest.raises(ValueError, match=r"routing_map has shape \(3, 5\), expected \[tokens, 4\]"):
        metric.record_routing(1, torch.zeros(3, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="padding_mask has shape"):
        metric.record_routing(1, torch.zeros(3, 4, dtype=torch.bool), padding_mask=torch.zeros(4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"layer number 4 outside 1\.\.3"):
        metric.record_routing(4, torch.zeros(3, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="topk"):
        MoERoutingMetric(num_layers=2, num_experts=4, topk=5)


def test_resume_continues_the_interval():
    metric = _metric()
    metric.record_routing(1, _routing_map([(0, 1), (0, 2)]))
    saved = metric.state_dict()
    resumed = _metric()
    resumed.load_state_dict(saved)
    resumed.record_routing(1, _routing_map([(2, 3), (1, 3)]))
    assert torch.equal(saved["states"]["load"][0], torch.tensor([2.0, 1.0, 1.0, 0.0], dtype=torch.float64)), \
        "the checkpoint is not changed by the resumed run"
    assert resumed.calculate()[keys.MOE_IMBALANCE_MAX] == 1.0  # loads [2, 2, 2, 2]


def _guarded_record(metric: MoERoutingMetric) -> None:
    with forbid_host_sync():
        metric.record_routing(2, _routing_map([(0, 1), (1, 2)]), logits=torch.randn(2, 4),
                              padding_mask=torch.tensor([False, True]))
        metric.record_router_loss("z_loss", 2, torch.tensor(3.0), 1.0)


def test_recording_makes_no_host_sync():
    metric = _metric()
    _guarded_record(metric)
    assert metric.calculate()[keys.MOE_TOKENS] == 1.0


# ------------------------------------------------------------------ the key table, the plot


def test_the_docs_list_exactly_the_moe_key_table():
    assert key_table("moe") == [key for key, _ in keys.MOE_KEYS]
    assert all(key.startswith(keys.MOE_PREFIX) for key, _ in keys.MOE_KEYS)


def test_plot_draws_the_routing_panel_and_the_expert_load_heat_map(tmp_path):
    pytest.importorskip("matplotlib")
    from twinkle_megatron.cli import main

    metric = _metric(per_layer=True)
    log = tmp_path / "metrics.jsonl"
    with log.open("w") as file:
        for step in (1, 2):
            metric.record_routing(1, _routing_map([(0, 1), (0, 2), (0, 3), (1, 2)]))
            metric.record_routing(3, _routing_map([(0, 1)] * 4))
            file.write(json.dumps({"step": step, "loss": 1.0 / step, **metric.calculate()}) + "\n")
    assert main(["plot", str(log), "-o", str(tmp_path / "plots")]) == 0
    written = {path.name for path in (tmp_path / "plots").iterdir()}
    assert {"moe_routing.png", "moe_load.png", "overview.png"} <= written
    from twinkle_megatron.cli import load_run
    from twinkle_megatron.plots import expert_load_grid

    layers, grid = expert_load_grid(load_run(str(log)))
    assert layers == [0, 2] and grid == [[1.5, 1.0, 1.0, 0.5], [2.0, 2.0, 0.0, 0.0]]


# ------------------------------------------------------------------ the demo's MoE variant


def test_the_moe_demo_logs_and_charts_routing_health(tmp_path):
    """examples/train_gpt.py --moe-experts 4 --moe-topk 2 on PP2 × DP2 × EP2 CPU ranks (Megatron's DDP,
    optimizer and 1F1B schedule): every record has the moe/ aggregates and the per-layer loads; plot charts them."""
    command = [sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--tp", "1", "--pp", "2", "--dp", "2",
               "--ep", "2", "--moe-experts", "4", "--moe-topk", "2", "--steps", "2", "--log-interval", "1",
               "--log-dir", str(tmp_path), "--run-name", "run", "--backends", "jsonl", "stdout"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    log = tmp_path / "run" / "metrics.jsonl"
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    aggregates = {key for key, _ in keys.MOE_KEYS} - {keys.MOE_NONFINITE_ROUTER_TOKENS,
                                                       "moe/seq_load_balancing_loss", "moe/global_load_balancing_loss"}
    for record in records:
        assert aggregates <= set(record), aggregates - set(record)
        assert record[keys.MOE_TOKENS] == 4 * 4 * 32 * 2  # microbatches × micro batch × sequence × DP, per layer
        assert all(f"moe/layer_{i}/expert_{e}_utilization" in record for i in range(4) for e in range(4))
        assert 1.0 <= record[keys.MOE_IMBALANCE_MAX] <= 4 / 2
    line = next(line for line in done.stdout.splitlines() if line.startswith("step 2 |"))
    assert "moe/imbalance_max" in line and "moe/layer_" not in line, "per-layer keys stay off the console line"
    pytest.importorskip("matplotlib")
    from twinkle_megatron.cli import main

    assert main(["plot", str(log), "-o", str(tmp_path / "plots")]) == 0
    assert {"moe_routing.png", "moe_load.png"} <= {path.name for path in (tmp_path / "plots").iterdir()}


def _demo_script():
    spec = importlib.util.spec_from_file_location("train_gpt_moe", ROOT / "examples" / "train_gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("flags, message", [
    (dict(moe_experts=4, moe_topk=5), "--moe-topk 5 is more than --moe-experts 4"),
    (dict(moe_experts=6, ep=4, dp=4), "--moe-experts 6 is not divisible by --ep 4"),
    (dict(moe_experts=4, ep=4, dp=2), "--ep 4 does not divide --dp 2"),
    (dict(moe_experts=4, tp=2), "use --tp 1 on CPU"),
    (dict(ep=2), "--ep 2 needs MoE layers"),
])
def test_impossible_moe_flags_are_refused(flags, message):
    script = _demo_script()
    args = script.parse_args(["--tp", "1", "--dp", "2", "--device", "cpu"])
    problems = script.flag_problems(argparse.Namespace(**{**vars(args), **flags}))
    assert any(message in problem for problem in problems), problems
