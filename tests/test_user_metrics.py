"""Metrics written Twinkle's way (their own accumulate / calculate / reset, ``gather_results``) beside ours.

In a ``MetricCollection``, ``instrument()`` and ``MetricsTracker``: the built-in
metrics' states still travel in the one sync (two all-reduces), then every user
metric's ``calculate()`` runs on every rank, and the keys merge into one dict
that is the same on every rank.
"""

from __future__ import annotations

import pytest
import torch
from kit.megatron_gpt import (
    GPTSpec,
    build_gpt_model,
    gpt_forward_step,
    make_batch,
    run_forward_backward,
    sum_loss_reports,
)

from twinkle_megatron import Accuracy, LossMetric, Metric, MetricCollection, MetricsTracker, TrackerConfig
from twinkle_megatron.megatron import instrument
from twinkle_megatron.testing.batches import RankView
from twinkle_megatron.testing.cuda_shim import cpu_cuda_shim
from twinkle_megatron.testing.distributed import Layout, run_distributed
from twinkle_megatron.testing.invariance import Call, assert_layout_invariant


class LabelTokens(Metric):
    """Twinkle's "Building Metrics" pattern: host-side counts, ``gather_results`` in ``calculate``."""

    def __init__(self, device_mesh=None, process_group=None, **kwargs):
        super().__init__(device_mesh, process_group, **kwargs)
        self.reset()

    def accumulate(self, inputs, outputs):  # the documented signature: no keywords
        batches = inputs if isinstance(inputs, list) else [inputs]
        for batch in batches:
            if batch.get("labels") is not None:
                mask = batch["labels"] != -100
                if batch.get("completion_mask") is not None:
                    mask &= batch["completion_mask"].bool()
                self.tokens += int(mask.sum())  # a host sync: the user's choice, not ours

    def calculate(self):
        results = self.gather_results([{"tokens": self.tokens, "calls": 1}])
        self.reset()
        return {"user/tokens": sum(r["tokens"] for r in results), "user/ranks": len(results)}

    def reset(self):
        self.tokens = 0


def feed_last_stage(collection: MetricCollection, _, view: RankView, __) -> list[Call]:
    if not view.last_stage:
        return []
    labels = torch.tensor([[1, 2, -100], [3, -100, -100]])
    logits = torch.nn.functional.one_hot(torch.tensor([[1, 2, 0], [3, 0, 0]]), 8).float()
    return [Call([{"labels": labels}], {"loss": [2.0], "logits": [view.vocab(logits)]}, {"lr": [1e-4], "step": 1})]


def test_user_metric_joins_a_collection_under_dp2_and_tp2_pp2():
    # One TP rank of the last stage per DP rank holds data. Built-ins: the two all-reduces; the user
    # metric: its own all_gather_object (sizes, then bytes). The user metric syncs with the host on purpose.
    assert_layout_invariant(
        lambda _: MetricCollection([LossMetric(), LabelTokens(), Accuracy()]), None, [Layout(dp=2), Layout(tp=2, pp=2)],
        feed=feed_last_stage, allow_host_syncs=True, rel=0,
        expected=lambda layout, _: {"loss": 2.0, "accuracy": 1.0, "correct_tokens": 3 * layout.dp,
                                    "total_tokens": 3 * layout.dp, "user/tokens": 3 * layout.dp,
                                    "user/ranks": layout.dp},
        calculate_collectives={"all_reduce": 2, "all_gather": 2})


SPEC = GPTSpec(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, max_sequence_length=8)


def _instrumented_step_with_user_metrics() -> tuple[dict, list]:
    batch = make_batch(SPEC, 8, seed=2)
    with cpu_cuda_shim():
        chunks = build_gpt_model(SPEC)
        # The natural call: a LossMetric with its defaults ('mean'); instrument() passes Megatron's
        # [sum, count] reports with loss_reduction='sum', so the loss is token-weighted anyway.
        with instrument(chunks, [Accuracy(), LossMetric(), LabelTokens()]) as metrics:
            reports = run_forward_backward(chunks, batch, micro_batch_size=2, forward_only=True,
                                           forward_step_func=metrics.wrap(gpt_forward_step))
            megatron = sum_loss_reports(reports)
            tracker = MetricsTracker(config=TrackerConfig(log_interval=1, backends=()), metrics=metrics.metrics)
            tracker.end_step(1)
    return tracker.last_record, None if megatron is None else megatron.tolist()


def test_instrument_and_tracker_take_user_metrics_and_pool_the_loss_by_tokens():
    per_rank = run_distributed(_instrumented_step_with_user_metrics, layout=Layout(tp=2, pp=2), timeout=120)
    records = [record for record, _ in per_rank]
    loss_sum, tokens = next(megatron for _, megatron in per_rank if megatron is not None)
    batch = make_batch(SPEC, 8, seed=2)
    for record in records:
        assert {k: v for k, v in record.items() if "time" not in k and "per_second" not in k} == \
            {k: v for k, v in records[0].items() if "time" not in k and "per_second" not in k}
        assert record["loss"] == pytest.approx(loss_sum / tokens, rel=1e-12), "Megatron's own per-token loss"
        assert record["user/tokens"] == int(batch["loss_mask"].sum()) == record["total_tokens"]
