"""All the built-in metrics in one collection on one synthetic global batch, fed per rank the way their callers
feed them (the last stage holds it all): shared by the collection's budget tests and the key-owner tests."""

from __future__ import annotations

import torch

from kit.references import full_vocab_stats
from twinkle_megatron import Accuracy, LossMetric, MetricCollection
from twinkle_megatron.metric.language.embedding import EmbeddingMetric
from twinkle_megatron.metric.rl.completion_reward import CompletionRewardMetric
from twinkle_megatron.metric.rl.dpo import DPOMetric
from twinkle_megatron.metric.rl.grpo import GRPOMetric
from twinkle_megatron.testing.batches import RankView, split_microbatches
from twinkle_megatron.testing.invariance import Call

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
