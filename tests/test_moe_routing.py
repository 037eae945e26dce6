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

import functools
import inspect
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from kit.megatron_gpt import GPTSpec, lm_loss_func, make_batch, run_forward_backward
from kit.megatron_moe import MoESpec, build_moe_model, init_parallel, moe_config, recompute_rng_on_cpu
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.moe.moe_utils import save_to_aux_losses_tracker

from twinkle_megatron import keys
from twinkle_megatron.megatron import MetricHookError, instrument, router_hooks
from twinkle_megatron.megatron.router_hooks import MoERoutingHooks
from twinkle_megatron.metric.language.moe_routing import MoERoutingMetric
from twinkle_megatron.testing.cuda_shim import cpu_cuda_shim
from twinkle_megatron.testing.distributed import Layout, run_distributed
from twinkle_megatron.testing.guards import count_collectives, host_sync_free

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
        routers = router_hooks.find_routers(chunks)
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
                           sum(len(r._forward_hooks) for r in router_hooks.find_routers(chunks)))
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
