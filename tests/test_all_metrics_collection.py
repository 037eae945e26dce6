"""All metrics in one MetricCollection: the collective budget of calculate(), no host sync, same results."""

from __future__ import annotations

from typing import Callable

import pytest
import torch
from batches import dp_cp_shard, megatron_rank_shard, split_microbatches
from distributed import Layout, run_distributed
from guards import count_collectives, forbid_host_sync

from twinkle_megatron import Accuracy, LossMetric, MetricCollection
from twinkle_megatron.metric.completion_reward import CompletionRewardMetric
from twinkle_megatron.metric.dpo import DPOMetric
from twinkle_megatron.metric.embedding import EmbeddingMetric
from twinkle_megatron.metric.grpo import GRPOMetric

BATCH, SEQ, VOCAB, PADDED_VOCAB, DIM, MICROBATCHES = 8, 8, 30, 32, 5, 2
VARIANTS = [(0, False), (3, False), (0, True), (3, True)]  # (top_k_kl, with EmbeddingMetric)


def global_batch(seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(BATCH, SEQ, PADDED_VOCAB, generator=generator)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    labels[torch.rand(BATCH, SEQ, generator=generator) < 0.3] = -100
    labels[2] = -100  # an all-masked sequence
    full = logits[..., :VOCAB].log_softmax(-1)
    logps = torch.where(labels != -100, full.gather(-1, labels.clamp(min=0)[..., None])[..., 0], 0.0)
    anchors = torch.zeros(BATCH, dtype=torch.long)
    anchors[0::2] = 1
    return {"logits": logits, "labels": labels, "logps": logps,
            "old": logps + 0.3 * torch.randn(BATCH, SEQ, generator=generator),
            "ref": logps + 0.3 * torch.randn(BATCH, SEQ, generator=generator),
            "advantages": torch.randn(BATCH, generator=generator),
            "embeddings": torch.randn(BATCH, DIM, generator=generator), "anchors": anchors,
            "rewards": torch.rand(BATCH, generator=generator, dtype=torch.float64)}


def make_metrics(top_k: int, with_embedding: bool) -> dict:
    metrics = {"accuracy": Accuracy(vocab_size=VOCAB), "loss": LossMetric(loss_reduction="sum"),
               "grpo": GRPOMetric(top_k_kl=top_k, vocab_size=VOCAB), "dpo": DPOMetric(),
               "reward": CompletionRewardMetric()}
    if with_embedding:
        metrics["embedding"] = EmbeddingMetric()
    return metrics


def feed(metrics: dict, batch: dict, shard: Callable, block: Callable, vocab_shard: Callable) -> dict:
    """Accumulate this rank's part of ``batch`` into every metric; returns the collectives issued."""
    local = {k: shard(batch[k]) for k in ("labels", "logps", "old", "ref", "logits")}
    inputs = [{"labels": labels} for labels in split_microbatches(local["labels"], MICROBATCHES)]
    split = {k: split_microbatches(v, MICROBATCHES) for k, v in local.items()}
    losses = [-(logps * (labels != -100)).sum() for logps, labels in zip(split["logps"], split["labels"])]
    advantages, rewards = block(batch["advantages"]).tolist(), block(batch["rewards"])
    with forbid_host_sync(), count_collectives() as counts:
        # Accuracy, the loss and GRPO read one microbatch's logits together: one shared vocab-parallel pass.
        MetricCollection([metrics["accuracy"], metrics["loss"], metrics["grpo"]]).accumulate(
            inputs, {"logits": [vocab_shard(x) for x in split["logits"]], "logps": split["logps"], "loss": losses},
            old_logps=split["old"], advantages=advantages)
        metrics["dpo"].accumulate(inputs, {"logps": split["logps"]}, ref_outputs={"logps": split["ref"]})
        if "embedding" in metrics:
            metrics["embedding"].accumulate({"labels": block(batch["anchors"])},
                                            {"embeddings": block(batch["embeddings"])})
        metrics["reward"].accumulate(rewards={"score": rewards}, completion_lengths=[SEQ] * len(rewards),
                                     generate_time=3.0)
    return dict(counts)


def _collection_on_rank() -> list[tuple[dict, dict, dict]]:
    from megatron.core import parallel_state as ps

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    width = PADDED_VOCAB // tp
    runs = []
    for top_k, with_embedding in VARIANTS:
        metrics = make_metrics(top_k, with_embedding)
        accumulate_counts: dict = {}
        if ps.is_pipeline_last_stage(ignore_virtual=True):
            accumulate_counts = feed(metrics, global_batch(), megatron_rank_shard,
                                     lambda t: dp_cp_shard(t, dp_rank, dp_size),
                                     lambda x: x[..., tp_rank * width:(tp_rank + 1) * width])
        with count_collectives() as counts:
            results = MetricCollection(metrics).calculate()
        runs.append((results, accumulate_counts, dict(counts)))
    return runs


def single_process_results(top_k: int, with_embedding: bool) -> dict:
    metrics = make_metrics(top_k, with_embedding)
    feed(metrics, global_batch(), lambda t: t, lambda t: t, lambda x: x)
    return MetricCollection(metrics).calculate()


@pytest.mark.parametrize("layout", [Layout(tp=2, pp=2, dp=2), Layout(cp=2, dp=2)], ids=str)
def test_all_metrics_cost_two_collectives_plus_one_optional_gather(layout):
    per_rank = run_distributed(_collection_on_rank, layout=layout)
    for variant, (top_k, with_embedding) in enumerate(VARIANTS):
        results = [runs[variant][0] for runs in per_rank]
        assert all(r == results[0] for r in results), "every rank returns the same dict"
        # calculate(): one SUM and one MAX all-reduce for the states of all metrics; object records
        # (GRPO's top-K tokens, the embeddings' per-call sums) share one all-gather, only when present.
        gather = {"all_gather": 2} if top_k or with_embedding else {}
        assert all(runs[variant][2] == {"all_reduce": 2, **gather} for runs in per_rank), (top_k, with_embedding)
        # accumulate(): two TP collectives per microbatch for Accuracy + GRPO entropy together;
        # one CP all-reduce per microbatch for DPO's pair sums; nothing else.
        expected = MICROBATCHES * (2 * (layout.tp > 1) + (layout.cp > 1))
        assert per_rank[-1][variant][1] == ({"all_reduce": expected} if expected else {})

        result, reference = dict(results[0]), single_process_results(top_k, with_embedding)
        records, reference_records = result.pop("_high_kl_records", []), reference.pop("_high_kl_records", [])
        assert [(r["gsi"], r["pos"]) for r in records] == [(r["gsi"], r["pos"]) for r in reference_records]
        assert result.keys() == reference.keys()
        assert result == pytest.approx(reference, rel=1e-5)
        assert ("pos_sim" in result) == with_embedding and "rewards/accuracies" in result


def test_single_process_collection_issues_no_collective():
    metrics = make_metrics(3, True)
    feed(metrics, global_batch(), lambda t: t, lambda t: t, lambda x: x)
    with count_collectives() as counts:
        result = MetricCollection(metrics).calculate()
    assert not counts
    assert {"accuracy", "loss", "train/entropy", "train/clip_ratio", "_high_kl_records", "logps/chosen",
            "rewards/accuracies", "pos_sim", "neg_sim", "train/score_reward", "train/score_reward_std",
            "train/completion_length", "profiling/Time taken: generate"} <= set(result)
    assert all(isinstance(v, (int, float)) for k, v in result.items() if k != "_high_kl_records")
