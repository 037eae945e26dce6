"""instrument(fused_loss=True) through megatron-core's schedules: the same training, the same metrics.

On each layout, every rank trains the tiny GPTModel twice from the same weights on the same batches:
once with ``instrument(model)`` (Megatron's own ``vocab_parallel_cross_entropy`` computes the loss) and
once with ``instrument(model, fused_loss=True)``. Step for step, Megatron's loss reports, every
parameter's gradient (relative to its norm) and the metrics ``calculate()`` reports must agree (token
counts exactly; the rest to 1e-6 relative at the first step, from the same weights, and 1e-5 after it,
which also carries the rounding of the earlier SGD updates), with ``calculate_per_token_loss`` on and
off, under TP, PP, VPP, CP and DP. The vocabulary is padded (60 tokens in 64 columns): the loss covers
the padding like Megatron's, the statistics do not. The refusals are tested on real configs.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from kit.megatron_gpt import (
    GPTSpec,
    build_gpt_model,
    gpt_forward_step,
    make_batch,
    make_config,
    run_forward_backward,
    sum_loss_reports,
)
from megatron.core import parallel_state

from twinkle_megatron.megatron import instrument
from twinkle_megatron.megatron.fused_loss import FusedLoss
from twinkle_megatron.testing.cuda_shim import cpu_cuda_shim
from twinkle_megatron.testing.distributed import Layout, run_distributed
from twinkle_megatron.testing.guards import host_sync_free

SPEC = GPTSpec(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=64, max_sequence_length=16)
TRUE_VOCAB = 60
GLOBAL_BATCH, MICRO_BATCH, STEPS, LR = 8, 2, 3, 0.05
TIMEOUT = 180


def _batch(step: int) -> dict:
    batch = make_batch(SPEC, GLOBAL_BATCH, seed=11 + step)
    batch["labels"] = batch["labels"] % TRUE_VOCAB
    batch["tokens"] = batch["tokens"] % TRUE_VOCAB
    return batch


def _reduce_and_step(chunks) -> list[torch.Tensor]:
    """Gradients summed over DP×CP (what Megatron's DDP does), then plain SGD; returns the gradients."""
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    grads = []
    with torch.no_grad():
        for chunk in chunks:
            for param in chunk.parameters():
                if dist.get_world_size(group) > 1:
                    dist.all_reduce(param.grad, group=group)
                grads.append(param.grad.clone())
                param -= LR * param.grad
                param.grad = None
    return grads


class _GuardedFusedLoss(FusedLoss):
    """The patched loss with every host sync made to raise."""

    def _loss_of(self, model, on_stats, default_group):
        return host_sync_free(super()._loss_of(model, on_stats, default_group))


def _train(fused: bool, per_token: bool) -> list[dict]:
    steps = []
    with cpu_cuda_shim():
        chunks = build_gpt_model(SPEC, config=make_config(SPEC, calculate_per_token_loss=per_token))
        with instrument(chunks, vocab_size=TRUE_VOCAB, fused_loss=fused) as metrics:
            if fused:  # the same object, with the host-sync guard around each call
                metrics.fused_loss.detach()
                gpts = [m for m in chunks if getattr(m, "post_process", False)]
                metrics.fused_loss = _GuardedFusedLoss(metrics._capture_stats, lambda: metrics.context.tp_group,
                                                       TRUE_VOCAB)
                for gpt in gpts:
                    metrics.fused_loss.attach(gpt)
            for step in range(STEPS):
                reports = run_forward_backward(chunks, _batch(step), micro_batch_size=MICRO_BATCH,
                                               forward_step_func=metrics.wrap(gpt_forward_step))
                report = sum_loss_reports(reports)
                steps.append({"metrics": metrics.calculate(), "report": None if report is None else report.tolist(),
                              "grads": _reduce_and_step(chunks)})
        patched = any("compute_language_model_loss" in vars(chunk) for chunk in chunks)
    return {"steps": steps, "patched_after_detach": patched}


def _both(per_token: bool) -> dict:
    return {"plain": _train(False, per_token), "fused": _train(True, per_token)}


LAYOUTS = [(Layout(), True), (Layout(tp=2), True), (Layout(tp=2), False), (Layout(pp=2, dp=2, vpp=2), True),
           (Layout(tp=2, cp=2), True), (Layout(cp=2, dp=2), False), (Layout(tp=2, pp=2, dp=2), False)]


@pytest.mark.parametrize("layout, per_token", LAYOUTS,
                         ids=[f"{layout}{'_per_token' if per_token else '_mean'}" for layout, per_token in LAYOUTS])
def test_fused_loss_trains_like_megatrons_and_reports_the_same_metrics(layout, per_token):
    per_rank = run_distributed(_both, layout=layout, args=(per_token,), timeout=TIMEOUT)
    for rank, runs in enumerate(per_rank):
        plain, fused = runs["plain"]["steps"], runs["fused"]["steps"]
        assert not runs["fused"]["patched_after_detach"], "detach gives the model its own method back"
        for step, (a, b) in enumerate(zip(plain, fused)):
            # Step 0 starts from the same weights: the op's own agreement. Later steps also carry the fp32
            # rounding of the earlier updates (the trajectories drift apart by a few 1e-7 per step).
            rel = 1e-6 if step == 0 else 1e-5
            if a["report"] is not None:
                assert b["report"] == pytest.approx(a["report"], rel=rel), (rank, step)
            for index, (grad_a, grad_b) in enumerate(zip(a["grads"], b["grads"])):
                scale = max(float(grad_a.norm()), 1e-30)
                assert float((grad_a - grad_b).norm()) <= rel * scale, (rank, step, index)
            assert set(a["metrics"]) == set(b["metrics"]) == {"accuracy", "correct_tokens", "total_tokens",
                                                              "logprob", "entropy", "loss"}
            for key, value in a["metrics"].items():
                assert b["metrics"][key] == pytest.approx(value, rel=rel), (rank, step, key)
            assert b["metrics"]["correct_tokens"] == a["metrics"]["correct_tokens"]
    assert all(r["fused"]["steps"][-1]["metrics"] == per_rank[0]["fused"]["steps"][-1]["metrics"] for r in per_rank)


def _refusal(overrides: dict) -> str:
    with cpu_cuda_shim():
        chunks = build_gpt_model(SPEC, config=make_config(SPEC, **overrides))
        hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in chunks[0].modules())
        try:
            instrument(chunks, fused_loss=True)
        except ValueError as error:
            after = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in chunks[0].modules())
            assert after == hooks, "a refusal attaches nothing"
            return str(error)
    return "accepted"


@pytest.mark.parametrize("overrides, reason", [
    ({"cross_entropy_loss_fusion": True, "cross_entropy_fusion_impl": "native"}, "cross_entropy_loss_fusion=True"),
    ({"cross_entropy_loss_fusion": True, "cross_entropy_fusion_impl": "te"}, "'te'"),
], ids=["native", "te"])
def test_losses_it_cannot_reproduce_are_refused_at_instrument_time(overrides, reason):
    assert all(reason in message for message in run_distributed(_refusal, layout=Layout(), args=(overrides,)))


def test_a_model_with_its_own_loss_or_mtp_is_refused():
    def worker():
        with cpu_cuda_shim():
            (model,) = build_gpt_model(SPEC)
            subclass = type("MyGPT", (type(model),), {"compute_language_model_loss": lambda self, labels, logits: 0})
            model.__class__ = subclass
            with pytest.raises(ValueError, match="MyGPT overrides compute_language_model_loss"):
                instrument(model, fused_loss=True)
            model.__class__ = subclass.__mro__[1]
            model.config.mtp_num_layers = 1
            with pytest.raises(ValueError, match="multi-token prediction"):
                instrument(model, fused_loss=True)
        return True

    assert run_distributed(worker, layout=Layout()) == [True]
