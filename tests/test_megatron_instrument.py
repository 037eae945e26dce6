"""instrument(): a real megatron-core training loop reports the single-process metrics on every layout.

A tiny GPTModel is trained for a few SGD steps through Megatron's own schedules
(no pipelining, 1F1B, interleaved) with the user's ``forward_step`` only wrapped.
After each step, ``calculate()`` on every rank must equal the world-1 reference
computed from the full-vocabulary logits of the same model on the same batch.
"""

from __future__ import annotations

import functools
import gc
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from kit.megatron_gpt import (
    GPTSpec,
    build_gpt_model,
    gpt_forward_step,
    make_batch,
    make_config,
    reference_forward,
    run_forward_backward,
    sum_loss_reports,
)
from kit.references import accuracy_reference, token_stats_reference
from megatron.core import parallel_state

from twinkle_megatron.megatron import MegatronInstrumentation, MetricHookError, instrument
from twinkle_megatron.testing.cuda_shim import cpu_cuda_shim
from twinkle_megatron.testing.distributed import Layout, run_distributed
from twinkle_megatron.testing.guards import host_sync_free
from twinkle_megatron.testing.invariance import calculate_or_error

SPEC = GPTSpec(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=64, max_sequence_length=16)
TRUE_VOCAB = 60  # Megatron pads the vocabulary: columns 60..63 exist in the model but are not tokens
GLOBAL_BATCH, MICRO_BATCH, STEPS, LR = 8, 2, 3, 0.05
TIMEOUT = 120


def _batch() -> dict:
    batch = make_batch(SPEC, GLOBAL_BATCH, seed=5)
    batch["labels"] = batch["labels"] % TRUE_VOCAB
    batch["tokens"] = batch["tokens"] % TRUE_VOCAB
    return batch


def _sgd_step(chunks) -> None:
    """Plain SGD on gradients summed over DP×CP: every layout follows the single-process trajectory."""
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    with torch.no_grad():
        for chunk in chunks:
            for param in chunk.parameters():
                if param.grad is None:
                    continue
                if getattr(param, "sequence_parallel", False):  # each TP rank saw a slice of the sequence
                    dist.all_reduce(param.grad, group=parallel_state.get_tensor_model_parallel_group())
                if dist.get_world_size(group) > 1:
                    dist.all_reduce(param.grad, group=group)
                param -= LR * param.grad
                param.grad = None


def _reference_worker() -> list[dict]:
    """World 1: the metrics from full-vocabulary logits, plain torch, float64."""
    batch = _batch()
    mask = batch["loss_mask"].bool()
    results = []
    with cpu_cuda_shim():
        (model,) = build_gpt_model(SPEC)
        for _ in range(STEPS):
            logits = reference_forward(model, batch)
            full = logits.detach()
            results.append({**accuracy_reference(full, batch["labels"], mask, TRUE_VOCAB),
                            **token_stats_reference(full, batch["labels"], mask, TRUE_VOCAB)})
            # The model's own loss over its padded vocabulary, as Megatron trains it.
            per_token = F.cross_entropy(logits.reshape(-1, SPEC.vocab_size), batch["labels"].reshape(-1),
                                        reduction="none")
            results[-1]["loss"] = float((per_token.double() * batch["loss_mask"].reshape(-1)).sum() / mask.sum())
            (per_token * batch["loss_mask"].reshape(-1)).sum().backward()
            _sgd_step([model])
    return results


@functools.cache
def reference() -> list[dict]:
    return run_distributed(_reference_worker, layout=Layout(), timeout=TIMEOUT)[0]


def _train_with_instrument(sequence_parallel: bool = False) -> list[tuple[dict, list]]:
    batch = _batch()
    steps = []
    with cpu_cuda_shim():
        config = make_config(SPEC, sequence_parallel=True) if sequence_parallel else None
        chunks = build_gpt_model(SPEC, config=config)
        with instrument(chunks, vocab_size=TRUE_VOCAB) as metrics:
            for _ in range(STEPS):
                reports = run_forward_backward(chunks, batch, micro_batch_size=MICRO_BATCH,
                                               forward_step_func=metrics.wrap(gpt_forward_step))
                megatron_loss = sum_loss_reports(reports)
                steps.append((metrics.calculate(), None if megatron_loss is None else megatron_loss.tolist()))
                _sgd_step(chunks)
    return steps


LAYOUTS = [(Layout(), False), (Layout(tp=2, pp=2, dp=2), False), (Layout(pp=2, dp=2, vpp=2), False),
           (Layout(tp=2, cp=2), False), (Layout(tp=2, pp=2), True)]


@pytest.mark.parametrize("layout, sequence_parallel", LAYOUTS,
                         ids=[f"{layout}{'_sp' if sp else ''}" for layout, sp in LAYOUTS])
def test_training_loop_reports_the_single_process_metrics(layout, sequence_parallel):
    expected = reference()
    per_rank = run_distributed(_train_with_instrument, layout=layout, args=(sequence_parallel,), timeout=TIMEOUT)
    for step in range(STEPS):
        results = [steps[step][0] for steps in per_rank]
        assert all(r == results[0] for r in results), f"step {step}: ranks disagree"
        result, want = results[0], expected[step]
        assert set(result) == {"accuracy", "correct_tokens", "total_tokens", "logprob", "entropy", "loss"}
        assert result["total_tokens"] == want["total_tokens"]
        assert result["correct_tokens"] == want["correct_tokens"]
        for key in ("accuracy", "logprob", "entropy", "loss"):
            assert result[key] == pytest.approx(want[key], rel=1e-5), (step, key)
        # The loss is the one Megatron's own loss_func reports, pooled over microbatches and DP×CP.
        megatron = [steps[step][1] for steps in per_rank if steps[step][1] is not None]
        assert megatron and all(result["loss"] == pytest.approx(s / n, rel=1e-12) for s, n in megatron)
    assert expected[-1]["loss"] < expected[0]["loss"], "the reference trajectory trains"


def _hooks_are_clean() -> dict:
    batch = _batch()
    with cpu_cuda_shim():
        chunks = build_gpt_model(SPEC)
        gpt = chunks[-1]
        head = getattr(gpt, "output_layer", torch.nn.Identity())  # only the last stage has one
        before = (len(gpt._forward_pre_hooks), len(head._forward_hooks))
        seen_logits: list = []
        watcher = head.register_forward_hook(lambda m, a, out: seen_logits.append(weakref.ref(out[0])))
        metrics = _GuardedInstrumentation(chunks, vocab_size=TRUE_VOCAB)
        run_forward_backward(chunks, batch, micro_batch_size=MICRO_BATCH,
                             forward_step_func=metrics.wrap(gpt_forward_step))
        gc.collect()
        alive = sum(ref() is not None for ref in seen_logits)
        result = metrics.calculate()  # raises if one of our hooks synced with the host
        metrics.detach()
        watcher.remove()
        after = (len(gpt._forward_pre_hooks), len(head._forward_hooks))
    return {"before": before, "after": after, "alive": alive, "seen": len(seen_logits), "result": result,
            "last": parallel_state.is_pipeline_last_stage()}


class _GuardedInstrumentation(MegatronInstrumentation):
    """Our hooks with every host sync made to raise (a raise is recorded and re-raised by calculate)."""

    _before_model = host_sync_free(MegatronInstrumentation._before_model)
    _after_output_layer = host_sync_free(MegatronInstrumentation._after_output_layer)
    _accumulate = host_sync_free(MegatronInstrumentation._accumulate)


def test_no_host_sync_no_logits_kept_no_hooks_left():
    results = run_distributed(_hooks_are_clean, layout=Layout(tp=2, pp=2), timeout=TIMEOUT)
    for r in results:
        assert r["after"] == r["before"], "detach removes every hook of ours"
        assert r["alive"] == 0, "no logits tensor outlives its microbatch"
        if r["last"]:
            assert r["seen"] == GLOBAL_BATCH // MICRO_BATCH and r["result"]["total_tokens"] > 0
    assert all(r["result"] == results[0]["result"] for r in results)


def _failing_hook() -> dict | str:
    batch = _batch()
    with cpu_cuda_shim():
        chunks = build_gpt_model(SPEC)
        metrics = instrument(chunks, vocab_size=TRUE_VOCAB)
        # One DP replica's last stage (both of its TP ranks, as a bad input would: shapes are the
        # same on every TP rank) fails on its first microbatch, before any collective.
        if parallel_state.is_pipeline_last_stage() and parallel_state.get_data_parallel_rank() == 1:
            import twinkle_megatron.megatron.instrumentation as module

            original = module.logits_token_stats
            calls = []

            def broken(*args, **kwargs):
                calls.append(1)
                if len(calls) == 1:
                    raise ValueError("labels has shape (2, 15) but logits has shape (16, 2, 32)")
                return original(*args, **kwargs)

            module.logits_token_stats = broken
        run_forward_backward(chunks, batch, micro_batch_size=MICRO_BATCH, forward_step_func=metrics.wrap(
            gpt_forward_step))
        return calculate_or_error(metrics, MetricHookError)


def test_a_failing_hook_raises_on_every_rank_instead_of_hanging():
    messages = run_distributed(_failing_hook, layout=Layout(tp=2, pp=2, dp=2), timeout=60)
    assert all("2 metric hook failure(s)" in m for m in messages), messages
    failing = [rank for rank in range(8) if rank >= 4 and rank % 4 >= 2]  # order tp-cp-dp-pp
    for rank, message in enumerate(messages):
        if rank in failing:
            assert "labels has shape (2, 15)" in message
        else:
            assert "see the log of the failing rank" in message


def _legacy_loss_func(loss_mask, output_tensor):
    """The older two-value loss_func: a per-microbatch mean."""
    losses = output_tensor.float()
    loss = (losses * loss_mask).sum() / loss_mask.sum()
    return loss, {"lm loss": loss.detach().clone()}  # the schedule rescales the loss in place


def _legacy_loop() -> tuple[dict, list]:
    batch = _batch()
    with cpu_cuda_shim():
        chunks = build_gpt_model(SPEC)
        metrics = instrument(chunks, vocab_size=TRUE_VOCAB)
        reports = run_forward_backward(
            chunks, batch, micro_batch_size=MICRO_BATCH, forward_only=True,
            forward_step_func=metrics.wrap(functools.partial(gpt_forward_step, loss_func=_legacy_loss_func)))
        return metrics.calculate(), [float(r["lm loss"]) for r in reports]


def test_two_value_loss_func_averages_microbatch_means():
    results = run_distributed(_legacy_loop, layout=Layout(pp=2, dp=2), timeout=TIMEOUT)
    means = [m for _, reports in results for m in reports]
    assert len(means) == GLOBAL_BATCH // MICRO_BATCH
    for result, _ in results:
        assert result["loss"] == pytest.approx(sum(means) / len(means), rel=1e-6)
        assert result["total_tokens"] == reference()[0]["total_tokens"]


def test_metrics_asking_for_different_vocabulary_sizes_are_refused():
    from twinkle_megatron import Accuracy, TokenStatsMetric

    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"different vocabulary sizes \[50, 60\]"):
        instrument(model, [Accuracy(vocab_size=60), TokenStatsMetric(vocab_size=50)])
    assert instrument(model, [Accuracy(vocab_size=60), TokenStatsMetric()]).vocab_size == 60


def _stray_model_call_then_step() -> dict:
    batch = _batch()
    with cpu_cuda_shim():
        chunks = build_gpt_model(SPEC)
        metrics = instrument(chunks, vocab_size=TRUE_VOCAB)
        # A model call outside the schedule (an eval probe) with other labels: captured, never paired.
        other = make_batch(SPEC, 2, seed=99)
        with torch.no_grad():
            chunks[0](other["tokens"], other["position_ids"], None, labels=other["labels"] % TRUE_VOCAB)
        run_forward_backward(chunks, batch, micro_batch_size=MICRO_BATCH, forward_only=True,
                             forward_step_func=metrics.wrap(gpt_forward_step))
        return metrics.calculate()


def test_a_model_call_outside_the_schedule_is_not_paired_with_a_microbatch():
    results = run_distributed(_stray_model_call_then_step, layout=Layout(tp=2), timeout=TIMEOUT)
    want = reference()[0]
    for result in results:
        assert result["correct_tokens"] == want["correct_tokens"] and result["total_tokens"] == want["total_tokens"]
        assert result["entropy"] == pytest.approx(want["entropy"], rel=1e-5)
