"""All metrics in one MetricCollection: the collective budget of calculate(), no host sync, same results."""

from __future__ import annotations

import pytest
import torch
from kit.batches import RankView, split_microbatches
from kit.distributed import Layout
from kit.guards import count_collectives
from kit.invariance import Call, assert_layout_invariant, run_calls
from kit.references import full_vocab_stats

from twinkle_megatron import Accuracy, LossMetric, MetricCollection
from twinkle_megatron.metric.language.embedding import EmbeddingMetric
from twinkle_megatron.metric.rl.completion_reward import CompletionRewardMetric
from twinkle_megatron.metric.rl.dpo import DPOMetric
from twinkle_megatron.metric.rl.grpo import GRPOMetric

BATCH, SEQ, VOCAB, PADDED_VOCAB, DIM, MICROBATCHES = 8, 8, 30, 32, 5, 2
VARIANTS = [(0, False), (3, False), (0, True), (3, True)]  # (top_k_kl, with EmbeddingMetric)


def global_batch(seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(BATCH, SEQ, PADDED_VOCAB, generator=generator)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    labels[torch.rand(BATCH, SEQ, generator=generator) < 0.3] = -100
    labels[2] = -100  # an all-masked sequence
    logps = full_vocab_stats(logits, labels, VOCAB).logprobs.float()
    anchors = torch.zeros(BATCH, dtype=torch.long)
    anchors[0::2] = 1
    return {"logits": logits, "labels": labels, "logps": logps,
            "old": logps + 0.3 * torch.randn(BATCH, SEQ, generator=generator),
            "ref": logps + 0.3 * torch.randn(BATCH, SEQ, generator=generator),
            "advantages": torch.randn(BATCH, generator=generator),
            "embeddings": torch.randn(BATCH, DIM, generator=generator), "anchors": anchors,
            "rewards": torch.rand(BATCH, generator=generator, dtype=torch.float64)}


def make_metrics(variant: tuple) -> MetricCollection:
    top_k, with_embedding = variant
    metrics = [Accuracy(vocab_size=VOCAB), LossMetric(loss_reduction="sum"),
               GRPOMetric(top_k_kl=top_k, vocab_size=VOCAB), DPOMetric(), CompletionRewardMetric()]
    return MetricCollection(metrics + ([EmbeddingMetric()] if with_embedding else []))


def feed(metrics: MetricCollection, batch: dict, view: RankView, _=None) -> list[Call]:
    """This rank's part of ``batch`` for every metric (the last stage holds it all)."""
    if not view.last_stage:
        return []
    accuracy, loss, grpo, dpo, reward, *embedding = metrics.metrics
    local = {k: view.tokens(batch[k]) for k in ("labels", "logps", "old", "ref", "logits")}
    inputs = [{"labels": labels} for labels in split_microbatches(local["labels"], MICROBATCHES)]
    split = {k: split_microbatches(v, MICROBATCHES) for k, v in local.items()}
    losses = [-(logps * (labels != -100)).sum() for logps, labels in zip(split["logps"], split["labels"])]
    rewards = view.rows(batch["rewards"])
    # Accuracy, the loss and GRPO read one microbatch's logits together: one shared vocab-parallel pass.
    calls = [Call(inputs, {"logits": [view.vocab(x) for x in split["logits"]], "logps": split["logps"],
                           "loss": losses},
                  {"old_logps": split["old"], "advantages": view.rows(batch["advantages"]).tolist()},
                  MetricCollection([accuracy, loss, grpo])),
             Call(inputs, {"logps": split["logps"]}, {"ref_outputs": {"logps": split["ref"]}}, dpo),
             Call(None, None, {"rewards": {"score": rewards}, "completion_lengths": [SEQ] * len(rewards),
                               "generate_time": 3.0}, reward)]
    return calls + [Call({"labels": view.rows(batch["anchors"])}, {"embeddings": view.rows(batch["embeddings"])},
                         {}, metric) for metric in embedding]


def accumulate_collectives(layout: Layout, _) -> dict:
    """Two TP collectives per microbatch for Accuracy + GRPO entropy together; one CP all-reduce per
    microbatch for DPO's pair sums; nothing else."""
    expected = MICROBATCHES * (2 * (layout.tp > 1) + (layout.cp > 1))
    return {"all_reduce": expected} if expected else {}


def calculate_collectives(_, variant: tuple) -> dict:
    """One SUM and one MAX all-reduce for the states of all metrics (the embeddings' per-call sums included);
    GRPO's top-K token records add one all-gather, only when enabled."""
    top_k, _ = variant
    return {"all_reduce": 2, **({"all_gather": 2} if top_k else {})}


@pytest.mark.parametrize("layout", [Layout(tp=2, pp=2, dp=2), Layout(cp=2, dp=2)], ids=str)
def test_all_metrics_cost_two_collectives_plus_one_optional_gather(layout):
    runs = assert_layout_invariant(make_metrics, global_batch(), [layout], feed=feed, variants=VARIANTS, rel=1e-5,
                                   accumulate_collectives=accumulate_collectives,
                                   calculate_collectives=calculate_collectives)
    for index, (_, with_embedding) in enumerate(VARIANTS):
        result = runs[layout][0][index].result
        assert ("pos_sim" in result) == with_embedding and "rewards/accuracies" in result


def test_single_process_collection_issues_no_collective():
    metrics = make_metrics((3, True))
    run_calls(metrics, feed(metrics, global_batch(), RankView()))
    with count_collectives() as counts:
        result = metrics.calculate()
    assert not counts
    assert {"accuracy", "loss", "train/entropy", "train/clip_ratio", "_high_kl_records", "logps/chosen",
            "rewards/accuracies", "pos_sim", "neg_sim", "train/score_reward", "train/score_reward_std",
            "train/completion_length", "profiling/Time taken: generate"} <= set(result)
    assert all(isinstance(v, (int, float)) for k, v in result.items() if k != "_high_kl_records")
