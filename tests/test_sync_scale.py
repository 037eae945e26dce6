"""Every built-in metric in one collection syncs in exactly two all-reduces at any world size.

Forked DP ranks (2, 4, 8) each build one metric of every built-in class, feed the ones that take data
(token metrics, GRPO with its default ``top_k_kl=0``, the embeddings' per-call sums, rewards), and count
the collectives of ``calculate()`` at the dispatcher: two all-reduces, never a gather, whatever the number
of ranks. The embeddings' data-sized state is checked against the single-process value, and ranks whose
numbers of calls differ get a :class:`MetricSyncError` on every rank instead of a wrong number.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import twinkle_megatron as tm
from twinkle_megatron.testing.distributed import run_distributed
from twinkle_megatron.testing.guards import count_collectives

ROWS, DIM, SEQ, VOCAB = 4, 6, 5, 11


def every_builtin_metric() -> list:
    return [tm.Accuracy(), tm.LossMetric(), tm.TrainMetric(), tm.TokenStatsMetric(), tm.GRPOMetric(),
            tm.GSPOMetric(), tm.CISPOMetric(), tm.PPOMetric(), tm.PPOValueMetric(), tm.DPOMetric(),
            tm.CompletionRewardMetric(), tm.EmbeddingMetric()]


def rank_data(rank: int, calls: int = 2) -> list[dict]:
    out = []
    for call in range(calls):
        generator = torch.Generator().manual_seed(100 * rank + call)
        labels = torch.zeros(ROWS, dtype=torch.long)
        labels[0::2] = 1
        out.append({"embeddings": torch.randn(ROWS, DIM, generator=generator), "anchors": labels,
                    "logits": torch.randn(2, SEQ, VOCAB, generator=generator),
                    "labels": torch.randint(0, VOCAB, (2, SEQ), generator=generator)})
    return out


def _sync_cost(calls_on_rank_1: int = 2) -> dict:
    rank = dist.get_rank()
    metrics = every_builtin_metric()
    accuracy, embedding = metrics[0], metrics[-1]
    for data in rank_data(rank, calls_on_rank_1 if rank == 1 else 2):
        accuracy.accumulate({"labels": data["labels"]}, {"logits": data["logits"]})
        embedding.accumulate({"labels": data["anchors"]}, {"embeddings": data["embeddings"]})
    metrics[1].accumulate({}, {"loss": 1.0 + rank})
    collection = tm.MetricCollection(metrics)
    try:
        with count_collectives() as counted:
            result = collection.calculate()
    except tm.MetricSyncError as error:
        return {"error": str(error)}
    return {"collectives": dict(counted), "result": result}


def negative_similarity(world: int) -> float:
    """Twinkle's neg_sim (cosines) over each call's global batch, from all ranks' rows."""
    total, pairs = 0.0, 0
    per_rank = [rank_data(rank) for rank in range(world)]
    for call in range(2):
        embeddings = torch.cat([per_rank[r][call]["embeddings"] for r in range(world)]).double()
        labels = torch.cat([per_rank[r][call]["anchors"] for r in range(world)])
        # anchors are rows 0, 2 of each rank's block; their positives rows 1, 3 (never across ranks)
        index = labels.nonzero()[:, 0]
        similarity = F.normalize(embeddings[index], dim=-1) @ F.normalize(embeddings[index + 1], dim=-1).T
        off = ~torch.eye(len(index), dtype=torch.bool)
        total, pairs = total + float(similarity[off].sum()), pairs + int(off.sum())
    return total / pairs


@pytest.mark.parametrize("world", [2, 4, 8])
def test_every_builtin_collection_costs_two_all_reduces_at_any_world_size(world):
    results = run_distributed(_sync_cost, world, timeout=120)
    assert all(r["collectives"] == {"all_reduce": 2} for r in results), [r["collectives"] for r in results]
    assert all(r["result"] == results[0]["result"] for r in results)
    assert results[0]["result"]["neg_sim"] == pytest.approx(negative_similarity(world), rel=1e-9)
    assert results[0]["result"]["total_tokens"] == world * 2 * 2 * SEQ


def test_ranks_with_different_numbers_of_calls_raise_on_every_rank():
    results = run_distributed(_sync_cost, 2, args=(3,), timeout=60)
    assert all("EmbeddingMetric's data-sized state differs" in r.get("error", "") for r in results), results
