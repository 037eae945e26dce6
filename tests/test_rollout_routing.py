"""MoE routing agreement between the rollout and the trainer, through instrument()'s router hooks.

The reference comes from the routing maps: a single-process run of the tiny real megatron-core MoE model
captures every router's routing map, which gives the trainer's ``k`` experts of every token and layer; the
"rollout" is that routing with a known share of decisions changed. The instrumented model under TP (with and
without sequence parallelism) and PP×EP×DP, each microbatch's rollout experts recorded in ``forward_step``,
must report exactly the share of differing decisions per layer and in total (0.0 for the trainer's own
routing), in the same two collectives of the collection's sync, without host syncs in the hooks.
"""

from __future__ import annotations

import functools
import inspect

import pytest
import torch
from kit.megatron_gpt import GPTSpec, lm_loss_func, make_batch, run_forward_backward
from kit.megatron_moe import MoESpec, build_moe_model, init_parallel, moe_config
from megatron.core.models.gpt import GPTModel

from twinkle_megatron.megatron import MetricHookError, RolloutRoutingMetric, attach_rollout_routing, instrument
from twinkle_megatron.megatron.router_hooks import MoERoutingHooks
from twinkle_megatron.testing.cuda_shim import cpu_cuda_shim
from twinkle_megatron.testing.distributed import Layout, run_distributed
from twinkle_megatron.testing.guards import count_collectives, host_sync_free

SPEC = GPTSpec(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=64, max_sequence_length=16,
               add_bias_linear=False)
MOE = MoESpec(num_experts=4, topk=2)
E, K, LAYERS, GLOBAL_BATCH, MICRO_BATCH = MOE.num_experts, MOE.topk, SPEC.num_layers, 8, 2
PADDING = "padding_mask" in inspect.signature(GPTModel.forward).parameters
TIMEOUT = 120


def _batch() -> dict:
    batch = make_batch(SPEC, GLOBAL_BATCH, seed=13)
    padding = torch.zeros(GLOBAL_BATCH, SPEC.max_sequence_length, dtype=torch.bool)
    padding[::2, -4:] = True  # True = padding (megatron-core's MoE convention)
    batch["padding_mask"] = padding
    return batch


def _forward_step(data_iterator, model, *, routing=None):
    batch = next(data_iterator)
    if routing is not None:
        routing.record_rollout_experts(batch["rollout_experts"])
    padding = {"padding_mask": batch["padding_mask"]} if PADDING else {}
    output = model(input_ids=batch["tokens"], position_ids=batch["position_ids"], attention_mask=None,
                   labels=batch["labels"], **padding)
    return output, functools.partial(lm_loss_func, batch["loss_mask"])


def _trainer_experts_worker() -> torch.Tensor:
    """[B, S, layers, k]: the experts each token is routed to (sorted), from the routers' own routing maps."""
    batch = _batch()
    experts = torch.zeros(GLOBAL_BATCH, SPEC.max_sequence_length, LAYERS, K, dtype=torch.long)
    calls: list = []
    with cpu_cuda_shim():
        (model,) = build_moe_model(SPEC, moe_config(SPEC, MOE))
        model.eval()  # as the RL trainer's log-prob pass (and TP without SP needs it)
        for layer in model.decoder.layers:
            layer.mlp.router.register_forward_hook(
                lambda router, args, output: calls.append((router.layer_number - 1, output[1].detach().clone())))
        run_forward_backward(model, batch, micro_batch_size=MICRO_BATCH, forward_only=True,
                             forward_step_func=_forward_step)
    per_layer: dict = {}
    for row, routing_map in calls:  # microbatches in order (one process: rows m·mbs …)
        per_layer.setdefault(row, []).append(routing_map.reshape(SPEC.max_sequence_length, MICRO_BATCH, E))
    for row, maps in per_layer.items():
        full = torch.cat([m.transpose(0, 1) for m in maps])  # [B, S, E]
        experts[:, :, row] = full.int().topk(K, dim=-1, sorted=False).indices.sort(-1).values
    return experts


@functools.cache
def trainer_experts() -> torch.Tensor:
    return run_distributed(_trainer_experts_worker, layout=Layout(), timeout=TIMEOUT)[0]


def rollout_experts() -> torch.Tensor:
    """The trainer's routing with one decision changed wherever (b + s + layer) % 3 == 0."""
    experts = trainer_experts().clone()
    b, s, layer = torch.meshgrid(*(torch.arange(n) for n in experts.shape[:3]), indexing="ij")
    change = (b + s + layer) % 3 == 0
    taken = torch.nn.functional.one_hot(experts, E).sum(-2).bool()  # [B, S, L, E]
    unused = (~taken).int().argmax(-1)  # the lowest expert the token does not use
    experts[..., 1] = torch.where(change, unused, experts[..., 1])
    return experts


def expected(rollout: torch.Tensor) -> dict:
    """Σ (k − |R ∩ R'|) / Σ k over non-padding tokens, per layer and in total, from the two expert lists."""
    trainer = torch.nn.functional.one_hot(trainer_experts(), E).sum(-2).bool()
    other = torch.nn.functional.one_hot(rollout, E).sum(-2).bool()
    differing = K - (trainer & other).sum(-1)  # [B, S, L]
    counted = ~_batch()["padding_mask"] if PADDING else torch.ones(GLOBAL_BATCH, SPEC.max_sequence_length, dtype=bool)
    per_layer = differing[counted].double().sum(0)  # [L]
    decisions = float(counted.sum()) * K
    results = {"moe/rollout_routing_mismatch": float(per_layer.sum()) / (decisions * LAYERS)}
    results.update({f"moe/layer_{i}/rollout_routing_mismatch": float(per_layer[i]) / decisions
                    for i in range(LAYERS)})
    return results


def _instrumented_worker(tp: int, pp: int, ep: int, sequence_parallel: bool, rollout: torch.Tensor) -> dict:
    MoERoutingHooks._after_router = host_sync_free(MoERoutingHooks._after_router)
    init_parallel(tp, pp, ep)
    batch = {**_batch(), "rollout_experts": rollout}
    with cpu_cuda_shim():
        chunks = build_moe_model(SPEC, moe_config(SPEC, MOE, sequence_parallel=sequence_parallel))
        for chunk in chunks:
            chunk.eval()
        metrics = instrument(chunks, vocab_size=SPEC.vocab_size)
        routing = attach_rollout_routing(metrics)
        run_forward_backward(chunks, batch, micro_batch_size=MICRO_BATCH, forward_only=True,
                             forward_step_func=metrics.wrap(functools.partial(_forward_step, routing=routing)))
        with count_collectives() as collectives:
            result = metrics.calculate()
    return {"result": {k: v for k, v in result.items() if "rollout_routing" in k},
            "collectives": sum(collectives.values())}


RUNS = {"tp2_sp": (2, 1, 1, True), "tp2": (2, 1, 1, False), "pp2_dp2_ep2": (1, 2, 2, False)}


@pytest.mark.parametrize("name", list(RUNS))
def test_routing_mismatch_equals_the_reference_from_the_routing_maps(name):
    tp, pp, ep, sp = RUNS[name]
    world = 4 if pp == 2 else tp
    for rollout, want in ((rollout_experts(), expected(rollout_experts())),
                          (trainer_experts(), expected(trainer_experts()))):
        per_rank = run_distributed(_instrumented_worker, world_size=world, args=(tp, pp, ep, sp, rollout),
                                   timeout=TIMEOUT)
        assert all(run == per_rank[0] for run in per_rank)
        assert per_rank[0]["collectives"] == 2  # the collection's one sync, the rollout's states in it
        got = per_rank[0]["result"]
        assert set(got) == set(want)
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-12, abs=0), key
    assert all(value == 0.0 for value in expected(trainer_experts()).values())
    assert 0.1 < expected(rollout_experts())["moe/rollout_routing_mismatch"] < 0.25


def test_hand_made_maps_and_bad_rollout_shapes():
    metric = RolloutRoutingMetric(num_layers=2, num_experts=4, topk=2)
    routing_map = torch.tensor([[1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]], dtype=torch.bool)
    rollout = torch.tensor([[1, 0], [3, 2], [7, -1]])  # agrees 2, 1, 0 (ids outside the experts never agree)
    metric.record(2, routing_map, rollout, padding_mask=torch.tensor([False, False, True]))
    assert metric.calculate() == {"moe/rollout_routing_mismatch": 0.25, "moe/layer_1/rollout_routing_mismatch": 0.25}
    with pytest.raises(ValueError, match="expected \\[3, 2\\]"):
        metric.record(1, routing_map, torch.zeros(3, 1, dtype=torch.long))


def _dense_worker() -> str:
    from kit.megatron_gpt import build_gpt_model

    with cpu_cuda_shim():
        chunks = build_gpt_model(SPEC)
        try:
            attach_rollout_routing(instrument(chunks, vocab_size=SPEC.vocab_size))
        except ValueError as error:
            return str(error)
    return ""


def _bad_record_worker() -> str:
    init_parallel(2, 1, 1)
    batch = {**_batch(), "rollout_experts": trainer_experts_placeholder()}
    with cpu_cuda_shim():
        chunks = build_moe_model(SPEC, moe_config(SPEC, MOE, sequence_parallel=True))
        metrics = instrument(chunks, vocab_size=SPEC.vocab_size)
        routing = attach_rollout_routing(metrics)
        run_forward_backward(chunks, batch, micro_batch_size=MICRO_BATCH, forward_only=True,
                             forward_step_func=metrics.wrap(functools.partial(_forward_step, routing=routing)))
        try:
            metrics.calculate()
        except MetricHookError as error:
            return str(error)
    return ""


def trainer_experts_placeholder() -> torch.Tensor:
    """Rollout experts with one expert per token where the model routes two: every comparison fails."""
    return torch.zeros(GLOBAL_BATCH, SPEC.max_sequence_length, LAYERS, 1, dtype=torch.long)


def test_a_dense_model_is_refused_and_a_bad_record_is_a_hook_failure_on_every_rank():
    assert "MoE layers" in run_distributed(_dense_worker, layout=Layout(), timeout=TIMEOUT)[0]
    messages = run_distributed(_bad_record_worker, world_size=2, timeout=TIMEOUT)
    assert all("expected [" in message for message in messages), messages
