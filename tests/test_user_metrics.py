"""Metrics written Twinkle's way (their own accumulate / calculate / reset, ``gather_results``) beside ours.

In a ``MetricCollection``, ``instrument()`` and ``MetricsTracker``: the built-in
metrics' states still travel in the one sync (two all-reduces), then every user
metric's ``calculate()`` runs on every rank, and the keys merge into one dict
that is the same on every rank.
"""

from __future__ import annotations

import pytest
import torch
from cuda_shim import cpu_cuda_shim
from distributed import Layout, run_distributed
from guards import count_collectives
from megatron.core import parallel_state
from megatron_gpt import GPTSpec, build_gpt_model, gpt_forward_step, make_batch, run_forward_backward, sum_loss_reports

from twinkle_megatron import Accuracy, LossMetric, Metric, MetricCollection, MetricsTracker
from twinkle_megatron.megatron import instrument


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


def _collection_with_a_user_metric() -> tuple[dict, dict]:
    collection = MetricCollection([LossMetric(), LabelTokens(), Accuracy()])
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        labels = torch.tensor([[1, 2, -100], [3, -100, -100]])
        logits = torch.nn.functional.one_hot(torch.tensor([[1, 2, 0], [3, 0, 0]]), 8).float()
        width = 8 // parallel_state.get_tensor_model_parallel_world_size()
        rank = parallel_state.get_tensor_model_parallel_rank()
        collection.accumulate([{"labels": labels}], {"loss": [2.0], "logits": [logits[..., rank * width:(rank + 1) *
                                                                                       width]]}, lr=[1e-4], step=1)
    with count_collectives() as counts:
        results = collection.calculate()
    return results, dict(counts)


def test_user_metric_joins_a_collection_under_dp2_and_tp2_pp2():
    for layout in (Layout(dp=2), Layout(tp=2, pp=2)):
        per_rank = run_distributed(_collection_with_a_user_metric, layout=layout)
        results = [result for result, _ in per_rank]
        assert all(r == results[0] for r in results), "the same dict on every rank"
        data_ranks = layout.dp  # one TP rank of the last stage per DP rank holds data
        assert results[0]["user/tokens"] == 3 * data_ranks and results[0]["user/ranks"] == data_ranks
        assert results[0]["loss"] == 2.0 and results[0]["accuracy"] == 1.0
        # Built-ins: the two all-reduces; the user metric: its own all_gather_object (sizes, then bytes).
        assert all(counts == {"all_reduce": 2, "all_gather": 2} for _, counts in per_rank), per_rank


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
            tracker = MetricsTracker(log_interval=1, metrics=metrics.metrics, backends=())
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
