"""The CPU Megatron harness is trustworthy: the shim, the tiny GPTModel and the schedule helper.

For each TP×PP×VPP×CP×DP layout, one real training step through megatron-core's schedule
must give the single-process reference: the ``lm loss`` reports ``[sum, count]`` summed over
microbatches and DP×CP, the parameter gradients (summed over DP×CP, compared shard by shard),
and the vocab-parallel logits a ``logits_hook`` sees. The reference is the world-1 model of
the same spec with plain torch cross-entropy on full-vocabulary logits.
"""

from __future__ import annotations

import functools
import math
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from kit.megatron_gpt import (
    GPTSpec,
    build_gpt_model,
    canonical_names,
    gpt_forward_step,
    make_batch,
    reference_forward,
    run_forward_backward,
    sum_loss_reports,
    tp_shard,
)
from megatron.core import parallel_state

from twinkle_megatron.testing.cuda_shim import PATCHED_CUDA_FUNCTIONS, cpu_cuda_shim
from twinkle_megatron.testing.distributed import Layout, run_distributed

GLOBAL_BATCH = 8
TIMEOUT = 120
SPEC = GPTSpec(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=64, max_sequence_length=16)
# Grouped-query attention (2 groups of 2 heads) and a gated fc1: the shards that are not a plain split.
GQA_SPEC = GPTSpec(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                   gated_linear_unit=True, vocab_size=64, max_sequence_length=16, seed=7)
RTOL = 1e-5


def _batch(spec: GPTSpec, attention_mask: bool) -> dict:
    batch = make_batch(spec, GLOBAL_BATCH, seed=3, attention_mask=attention_mask)
    # The global sequence index rides along through the DP/CP slicing, for checking logits.
    batch["sample"] = torch.arange(GLOBAL_BATCH)[:, None].expand(-1, spec.max_sequence_length).contiguous()
    return batch


def _reference_worker(spec: GPTSpec, attention_mask: bool) -> bytes:
    batch = _batch(spec, attention_mask)
    with cpu_cuda_shim():
        (model,) = build_gpt_model(spec)
        logits = reference_forward(model, batch)
    per_token = F.cross_entropy(logits.double().reshape(-1, spec.vocab_size), batch["labels"].reshape(-1),
                                reduction="none")
    loss = (per_token * batch["loss_mask"].reshape(-1).double()).sum()
    loss.backward()
    names = canonical_names(model)
    result = {
        "loss": [loss.item(), batch["loss_mask"].sum().item()],
        "logits": logits.detach(),
        "grads": {names[name]: param.grad.detach() for name, param in model.named_parameters()},
    }
    return result


@functools.cache
def _reference(spec: GPTSpec, attention_mask: bool) -> dict:
    (data,) = run_distributed(_reference_worker, layout=Layout(), args=(spec, attention_mask),
                              timeout=TIMEOUT)
    return data


def _logits_error(ref_logits: torch.Tensor, errors: list, logits: torch.Tensor, microbatch: dict) -> None:
    """logits_hook: this rank's logits must be the TP vocab shard of the reference at its (DP, CP) tokens."""
    shard = logits.size(-1)
    rank = parallel_state.get_tensor_model_parallel_rank()
    expected = ref_logits[microbatch["sample"], microbatch["position_ids"]]
    expected = expected[..., rank * shard:(rank + 1) * shard]
    assert logits.shape == expected.shape, (logits.shape, expected.shape)
    errors.append(((logits - expected).abs().max() / ref_logits.abs().max()).item())


def _grad_error(chunks: list, ref_grads: dict) -> float:
    """Largest gradient error relative to the largest entry of that parameter's reference gradient,
    after summing gradients over DP×CP (the reduction Megatron's DDP does, before any scaling)."""
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    worst = 0.0
    for chunk in chunks:
        names = canonical_names(chunk)
        for name, param in chunk.named_parameters():
            grad = param.grad.detach().clone()
            dist.all_reduce(grad, group=group)
            full = ref_grads[names[name]]
            expected = tp_shard(full, param)
            worst = max(worst, ((grad - expected).abs().max() / full.abs().max()).item())
    return worst


def _layout_worker(spec: GPTSpec, attention_mask: bool, micro_batch_size: int, ref: dict) -> dict:
    batch = _batch(spec, attention_mask)
    with cpu_cuda_shim():
        chunks = build_gpt_model(spec)
        reports = run_forward_backward(chunks, batch, micro_batch_size=micro_batch_size)
        loss = sum_loss_reports(reports)
        grad_err = _grad_error(chunks, ref["grads"])
        # The same step, forward only, with the loss computed outside the model after a logits hook.
        errors: list = []
        hook = partial(_logits_error, ref["logits"], errors)
        hook_reports = run_forward_backward(chunks, batch, micro_batch_size=micro_batch_size,
                                            forward_only=True,
                                            forward_step_func=partial(gpt_forward_step, logits_hook=hook))
        hook_loss = sum_loss_reports(hook_reports)
    return {
        "last_stage": parallel_state.is_pipeline_last_stage(),
        "reports": len(reports),
        "loss": None if loss is None else loss.tolist(),
        "hook_loss": None if hook_loss is None else hook_loss.tolist(),
        "grad_err": grad_err,
        "logits_err": max(errors, default=None),
    }


def _rel(value: float, ref: float) -> float:
    return abs(value - ref) / abs(ref)


LAYOUTS = [
    # (layout, micro batch size, spec, explicit attention mask)
    pytest.param(Layout(), 2, SPEC, False, id="tp1_pp1-no_pipelining"),
    pytest.param(Layout(tp=2, pp=2, dp=2), 1, SPEC, False, id="tp2_pp2_dp2-1f1b"),
    pytest.param(Layout(pp=2, dp=2, vpp=2), 1, SPEC, False, id="pp2_vpp2_dp2-interleaved"),
    pytest.param(Layout(tp=2, cp=2), 2, SPEC, False, id="tp2_cp2"),
    pytest.param(Layout(tp=2, pp=2, cp=2), 2, SPEC, True, id="tp2_pp2_cp2-explicit_mask"),
    pytest.param(Layout(tp=2, pp=2, vpp=2), 1, GQA_SPEC, False, id="tp2_pp2_vpp2-gqa_gated_mlp"),
]


@pytest.mark.parametrize("layout,micro_batch_size,spec,attention_mask", LAYOUTS)
def test_layout_matches_single_process(layout, micro_batch_size, spec, attention_mask):
    ref = _reference(spec, attention_mask)
    results = run_distributed(_layout_worker, layout=layout,
                              args=(spec, attention_mask, micro_batch_size, ref), timeout=TIMEOUT)
    num_microbatches = GLOBAL_BATCH // (layout.dp * micro_batch_size)
    last = [r for r in results if r["last_stage"]]
    assert len(last) == layout.world_size // layout.pp
    ref_sum, ref_count = ref["loss"]
    for r in results:
        assert r["reports"] == (num_microbatches if r["last_stage"] else 0)
        assert (r["loss"] is None) == (not r["last_stage"])
        assert r["grad_err"] < RTOL, r["grad_err"]
        if r["last_stage"]:
            for loss in (r["loss"], r["hook_loss"]):
                assert loss[1] == ref_count
                assert _rel(loss[0], ref_sum) < RTOL, (loss, ref["loss"])
            assert r["logits_err"] < RTOL, r["logits_err"]


def test_reference_is_not_trivial():
    """Guard against a degenerate model (e.g. all-zero weights) making every layout agree."""
    ref = _reference(SPEC, False)
    mean = ref["loss"][0] / ref["loss"][1]
    assert 0 < ref["loss"][1] < GLOBAL_BATCH * SPEC.max_sequence_length  # the loss mask has holes
    assert abs(mean - math.log(SPEC.vocab_size)) > 0.05  # not a uniform prediction
    assert ref["logits"].std() > 0.1
    assert all(g.abs().max() > 0 for g in ref["grads"].values())
    assert _reference(GQA_SPEC, False)["loss"] != ref["loss"]


def test_shim_routes_cuda_to_cpu_and_restores_torch():
    originals = {name: getattr(torch.cuda, name) for name in PATCHED_CUDA_FUNCTIONS}
    modes = len(torch.overrides._get_current_function_mode_stack())
    with cpu_cuda_shim():
        assert torch.cuda.current_device() == "cpu"
        assert torch.zeros(2, device="cuda").device.type == "cpu"
        assert torch.empty(2, device=torch.device("cuda", 0)).device.type == "cpu"
        assert torch.ones(2, device=0).device.type == "cpu"
        assert torch.ones(2).to(device="cuda:1").device.type == "cpu"
        assert torch.ones(2).cuda().device.type == "cpu"
        assert torch.arange(3, device="meta").device.type == "meta"  # other devices untouched
        torch.cuda.synchronize()
        with torch.cuda.stream(torch.cuda.Stream(device=torch.cuda.current_device())):
            torch.cuda.current_stream().wait_stream(torch.cuda.Stream())
        assert all(getattr(torch.cuda, name) is not originals[name] for name in PATCHED_CUDA_FUNCTIONS)
    assert {name: getattr(torch.cuda, name) for name in PATCHED_CUDA_FUNCTIONS} == originals
    assert len(torch.overrides._get_current_function_mode_stack()) == modes  # the device rewrite is off
    with pytest.raises(KeyError):  # undone when the body raises, too
        with cpu_cuda_shim():
            raise KeyError("boom")
    assert {name: getattr(torch.cuda, name) for name in PATCHED_CUDA_FUNCTIONS} == originals
    assert len(torch.overrides._get_current_function_mode_stack()) == modes
    if not torch.cuda.is_available():  # and CUDA calls fail again on a CPU-only build
        with pytest.raises((AssertionError, RuntimeError)):
            torch.zeros(1, device="cuda")
        with pytest.raises((AssertionError, RuntimeError)):
            torch.cuda.current_device()


def _broadcast_worker() -> list:
    from megatron.core import tensor_parallel

    rank = parallel_state.get_tensor_model_parallel_rank()
    with cpu_cuda_shim():
        data = tensor_parallel.broadcast_data(["x"], {"x": torch.arange(4) + 10 * rank}, torch.int64)
    return data["x"].tolist()


def test_shim_runs_megatron_broadcast_data():
    """tensor_parallel.broadcast_data (Megatron-LM's get_batch under TP) calls .cuda() on its input."""
    assert run_distributed(_broadcast_worker, layout=Layout(tp=2), timeout=TIMEOUT) == [[0, 1, 2, 3]] * 2
