"""Per-layer gradient and parameter norms (tracker.record_grad_norms) on a real megatron-core GPT, DDP and optimizer.

Every layout runs the same global batch through the same layout-independent
model (kit.megatron_gpt), Megatron's DDP and ``finalize_model_grads``, and
Megatron's optimizer. Checked on every rank:

* each part's gradient and parameter norm equals a float64 reference from the
  single-process model's gradients (world 1) — fp32 rel 1e-5;
* the parts' squares sum to Megatron's own global gradient norm
  (``optimizer.get_grad_norm()``) — fp32 rel 1e-5;
* with and without the distributed optimizer, under TP, PP, VPP and DP;
* the log step's collectives are exactly those of a step without the feature.
"""

from __future__ import annotations

import math
from typing import Optional

import pytest
import torch
from kit.megatron_gpt import GPTSpec, make_batch
from kit.megatron_moe import MoESpec, init_parallel
from kit.megatron_training import build_trained_gpt, train_forward_backward
from kit.part_norms import part_norms

from twinkle_megatron import MetricsTracker, TrackerConfig, keys
from twinkle_megatron.testing.cuda_shim import cpu_cuda_shim
from twinkle_megatron.testing.distributed import Layout, run_distributed
from twinkle_megatron.testing.guards import count_collectives, forbid_host_sync
from twinkle_megatron.tracker.layer_parameters import LayerParameters

SPEC = GPTSpec(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=64, max_sequence_length=8)
MICRO_BATCH = 2
RTOL = 1e-5
MOE_SPEC = GPTSpec(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, max_sequence_length=8,
                   add_bias_linear=False)  # megatron-core 0.16's expert MLP cannot add a bias (kit.megatron_moe)


def _batch():
    return make_batch(SPEC, global_batch_size=8, seq_length=8, seed=3)


def _reference_worker(moe: Optional[MoESpec] = None) -> dict[str, tuple[float, float]]:
    """World 1: each part's (grad norm, param norm) in float64 from the model's reduced gradients."""
    with cpu_cuda_shim():
        chunks, _ = build_trained_gpt(MOE_SPEC if moe else SPEC, moe=moe)
        train_forward_backward(chunks, _batch(), micro_batch_size=MICRO_BATCH)
    return part_norms(chunks)


_REFERENCE: dict = {}


def reference(moe: Optional[MoESpec] = None) -> dict[str, tuple[float, float]]:
    if moe not in _REFERENCE:
        _REFERENCE[moe] = run_distributed(_reference_worker, layout=Layout(), args=(moe,))[0]
    return _REFERENCE[moe]


def _layout_worker(distributed_optimizer: bool, moe: Optional[MoESpec] = None, ep: int = 1) -> dict:
    if ep > 1:
        init_parallel(ep=ep)
    with cpu_cuda_shim():
        chunks, optimizer = build_trained_gpt(MOE_SPEC if moe else SPEC, distributed_optimizer=distributed_optimizer,
                                              moe=moe)
        tracker = MetricsTracker(config=TrackerConfig(log_interval=1, backends=()))
        train_forward_backward(chunks, _batch(), micro_batch_size=MICRO_BATCH)
        with forbid_host_sync():
            tracker.record_grad_norms(chunks, optimizer)
        optimizer.prepare_grads()  # what optimizer.step() does first: main grads -> the optimizer's .grad
        megatron_norm = optimizer.get_grad_norm()  # what step() clips by (clip_grad_norm computes the same)
        record = tracker.end_step(1, grad_norm=megatron_norm)
        # The same step without the feature: the log step's collectives must be the same.
        plain = MetricsTracker(config=TrackerConfig(log_interval=1, backends=()))
        with count_collectives() as plain_collectives:
            plain.end_step(1, grad_norm=megatron_norm)
        train_forward_backward(chunks, _batch(), micro_batch_size=MICRO_BATCH)
        tracker.record_grad_norms(chunks, optimizer)
        with count_collectives() as with_collectives:
            tracker.end_step(2, grad_norm=megatron_norm)
    return {"record": record, "megatron_norm": float(megatron_norm),
            "collectives": (dict(plain_collectives), dict(with_collectives))}


LAYOUTS = [
    (Layout(tp=2, pp=2, dp=2), False),
    (Layout(tp=2, pp=2, dp=2), True),
    (Layout(pp=2, dp=2, vpp=2), True),
    (Layout(pp=2, dp=2, vpp=2), False),
    (Layout(tp=2, dp=2), True),
]


@pytest.mark.parametrize("layout,distributed_optimizer", LAYOUTS,
                         ids=[f"{layout}-{'distopt' if d else 'ddp'}" for layout, d in LAYOUTS])
def test_layer_norms_equal_the_reference_and_sum_to_megatrons_norm(layout, distributed_optimizer):
    expected = reference()
    results = run_distributed(_layout_worker, layout=layout, args=(distributed_optimizer,), timeout=120)
    _check(expected, results)
    first = results[0]["record"]
    layers = [expected[f"layer_{i:02d}"][0] for i in range(SPEC.num_layers)]
    largest = max(range(len(layers)), key=lambda i: layers[i])
    assert first[keys.GRAD_NORM_LAYER_MAX_INDEX] == largest
    assert first[keys.GRAD_NORM_LAYER_MAX] == pytest.approx(layers[largest], rel=RTOL)
    median = sorted(layers)[1:3]
    assert first[keys.GRAD_NORM_LAYER_MAX_OVER_MEDIAN] == pytest.approx(layers[largest] / (sum(median) / 2),
                                                                        rel=RTOL)
    assert "grad_norm/other" not in first


# MoE without router losses: the aux and z losses are computed per DP rank's tokens, so their gradients
# (and no others) depend on the layout; the experts' and router's gradients from the LM loss do not.
MOE = MoESpec(num_experts=4, topk=2, aux_loss_coeff=0.0, z_loss_coeff=None)


@pytest.mark.parametrize("distributed_optimizer", [False, True], ids=["ddp", "distopt"])
def test_expert_parameters_are_summed_over_expert_parallel_ranks(distributed_optimizer):
    """EP2 over 4 ranks (DP4, expert-DP2): each expert counts once, on the EP rank that holds it."""
    expected = reference(MOE)
    results = run_distributed(_layout_worker, layout=Layout(dp=4), args=(distributed_optimizer, MOE, 2),
                              timeout=180)
    _check(expected, results)


def _check(expected: dict, results: list) -> None:
    first = results[0]["record"]
    for rank, result in enumerate(results):
        record = result["record"]
        assert record == first, f"rank {rank} got another record"
        squares = 0.0
        for part, (grad_norm, param_norm) in expected.items():
            assert record[keys.layer_grad_norm_key(part)] == pytest.approx(grad_norm, rel=RTOL), part
            assert record[keys.layer_param_norm_key(part)] == pytest.approx(param_norm, rel=RTOL), part
            squares += record[keys.layer_grad_norm_key(part)] ** 2
        assert math.sqrt(squares) == pytest.approx(result["megatron_norm"], rel=RTOL)
        assert record[keys.GRAD_NORM_TOTAL] == pytest.approx(result["megatron_norm"], rel=RTOL)
        plain, with_norms = result["collectives"]
        assert with_norms == plain, "the per-layer norms must travel in the tracker's own collectives"


def _slots_worker() -> list[tuple[str, int]]:
    with cpu_cuda_shim():
        chunks, optimizer = build_trained_gpt(SPEC)
        parameters = LayerParameters(chunks, optimizer)
        return sorted({(parameters.slot_names[c.slot], c.slot) for c in parameters.counted})


def test_global_layer_numbers_under_virtual_pipeline_stages():
    """PP2 × VPP2 over 4 layers: stage 0 holds layers 0 and 2, stage 1 layers 1 and 3 (Megatron's interleaving)."""
    per_rank = run_distributed(_slots_worker, layout=Layout(pp=2, vpp=2), timeout=120)
    assert {name for name, _ in per_rank[0]} == {"embedding", "layer_00", "layer_02"}
    assert {name for name, _ in per_rank[1]} == {"layer_01", "layer_03", "final_norm", "output_layer"}


def test_record_grad_norms_is_opt_in():
    tracker = MetricsTracker(config=TrackerConfig(log_interval=1, backends=()))
    record = tracker.end_step(1, loss=torch.tensor([4.0, 2.0]))
    assert not any(key.startswith((keys.GRAD_NORM_PREFIX, keys.PARAM_NORM_PREFIX)) for key in record)


def _without_optimizer_worker() -> str:
    with cpu_cuda_shim():
        chunks, _ = build_trained_gpt(SPEC, distributed_optimizer=True)
        try:
            MetricsTracker(config=TrackerConfig(log_interval=1, backends=())).record_grad_norms(chunks)
        except ValueError as error:
            return str(error)
    return "no error"


def test_the_distributed_optimizer_needs_the_optimizer():
    messages = run_distributed(_without_optimizer_worker, layout=Layout(dp=2), timeout=120)
    assert all("pass the optimizer" in message for message in messages)
