"""EmbeddingMetric: hand-computed similarities, the exact global in-batch negatives, any layout, bad input."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from twinkle_megatron.metric.language.embedding import EmbeddingMetric
from twinkle_megatron.testing.batches import RankView, split_microbatches
from twinkle_megatron.testing.distributed import Layout, run_distributed
from twinkle_megatron.testing.invariance import Call, assert_layout_invariant

ROWS, SEQ, DIM = 16, 8, 6


def test_hand_computed_cosines():
    # anchor (1, 0) / positive (3, 0): cos 1;  anchor (0, 2) / positive (3, 3): cos 1/√2
    embeddings = torch.tensor([[1.0, 0.0], [3.0, 0.0], [0.0, 2.0], [3.0, 3.0]])
    metric = EmbeddingMetric()
    loss = torch.tensor(0.7, dtype=torch.float64)
    metric.accumulate({"labels": torch.tensor([1, 0, 1, 0])}, {"embeddings": embeddings, "loss": loss}, grad_norm=2.5)
    r = 1 / math.sqrt(2)
    # negatives: cos((1, 0), (3, 3)) = 1/√2 and cos((0, 2), (3, 0)) = 0 (a raw dot product would say 3 and 0)
    expected = {"pos_sim": (1 + r) / 2, "pos_sim_min": r, "pos_sim_max": 1.0, "neg_sim": r / 2, "loss": 0.7,
                "grad_norm": 2.5}
    assert metric.calculate() == pytest.approx(expected, rel=1e-12)
    assert metric.calculate() == {}, "no data gives {}"


def global_batch(seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(ROWS, SEQ, DIM, generator=generator)
    hidden[1::4, 0] += hidden[0::4, 0]  # positives resemble their anchors
    labels = torch.zeros(ROWS, dtype=torch.long)
    labels[0::4] = 1  # groups of [anchor, positive, negative, negative]
    return {"hidden": hidden, "embeddings": hidden[:, 0], "labels": labels}


def reference(batches: list[dict]) -> dict:
    """Twinkle's definitions with cosine negatives, one global batch per accumulate call."""
    positives, negatives = [], []
    for batch in batches:
        index = batch["labels"].nonzero()[:, 0]
        anchors = F.normalize(batch["embeddings"][index].double(), dim=-1)
        matches = F.normalize(batch["embeddings"][index + 1].double(), dim=-1)
        similarity = anchors @ matches.T
        positives.append(similarity.diag())
        negatives.append(similarity[~torch.eye(len(index), dtype=torch.bool)])
    positives, negatives = torch.cat(positives), torch.cat(negatives)
    return {"pos_sim": float(positives.mean()), "pos_sim_min": float(positives.min()),
            "pos_sim_max": float(positives.max()), "neg_sim": float(negatives.mean())}


def feed_last_stage(metric: EmbeddingMetric, batch: dict, view: RankView, variant: tuple) -> list[Call]:
    count, as_list, hidden = variant
    if not view.last_stage:
        return []
    labels = view.rows(batch["labels"])
    # Pooled embeddings are whole on every CP rank; hidden states [n, s, d] are CP chunks
    # (position 0 lives on CP rank 0, the rank that counts).
    embeddings = view.tokens(batch["hidden"]) if hidden else view.rows(batch["embeddings"])
    inputs = [{"labels": part} for part in split_microbatches(labels, count)]
    return [Call(inputs, {"embeddings": split_microbatches(embeddings, count) if as_list else embeddings,
                          "loss": torch.tensor(1.0 + view.dp_rank), "grad_norm": 0.5 + view.dp_rank})]


@pytest.mark.parametrize("layout", [Layout(tp=2), Layout(tp=2, pp=2, dp=2), Layout(cp=2, dp=2)], ids=str)
def test_same_global_batch_gives_the_single_process_result(layout):
    batch = global_batch()
    # The per-call sums are a data-sized SUM state: the two all-reduces, nothing else, at any world size.
    assert_layout_invariant(
        lambda _: EmbeddingMetric(), batch, [layout], feed=feed_last_stage,
        variants=[(1, True, False), (2, True, False), (2, False, False), (2, True, True)],  # microbatches, list, hidden
        expected={**reference([batch]), "loss": 1.0 + (layout.dp - 1) / 2, "grad_norm": 0.5 + layout.dp - 1},
        rel=1e-9, calculate_collectives={"all_reduce": 2})


def _uneven_ranks() -> dict:
    batch = global_batch()
    rows = slice(0, 12) if dist.get_rank() == 0 else slice(12, 16)
    metric = EmbeddingMetric()
    inputs = [{"labels": part} for part in split_microbatches(batch["labels"][rows], 2)]
    metric.accumulate(inputs, {"embeddings": split_microbatches(batch["embeddings"][rows], 2)})
    return metric.calculate()


def test_data_parallel_ranks_with_different_batch_sizes():
    results = run_distributed(_uneven_ranks, 2)
    assert results[0] == results[1] == pytest.approx(reference([global_batch()]), rel=1e-9)


def test_in_batch_negatives_are_per_call():
    first, second = global_batch(0), global_batch(1)
    metric = EmbeddingMetric()
    for batch in (first, second):
        metric.accumulate({"labels": batch["labels"]}, {"logits": batch["hidden"]})  # Twinkle's fallback key
    assert metric.calculate() == pytest.approx(reference([first, second]), rel=1e-9)


def test_bad_input_and_batches_without_anchors():
    metric = EmbeddingMetric()
    with pytest.raises(ValueError, match=r"outputs\['embeddings'\] has 4 rows \(shape \(4, 3\)\) but labels has 5"):
        metric.accumulate({"labels": torch.zeros(5)}, {"embeddings": torch.randn(4, 3)})
    metric.accumulate({"labels": torch.zeros(4)}, {"embeddings": torch.randn(4, 3)})
    metric.accumulate({"labels": torch.tensor([1])}, {"embeddings": torch.randn(1, 3)})  # no positive: skipped
    assert metric.calculate() == {}


def test_resume_mid_interval_keeps_the_per_call_sums():
    first, second = global_batch(0), global_batch(1)
    metric = EmbeddingMetric()
    metric.accumulate({"labels": first["labels"]}, {"embeddings": first["embeddings"]})
    resumed = EmbeddingMetric()
    resumed.load_state_dict(metric.state_dict())
    resumed.accumulate({"labels": second["labels"]}, {"embeddings": second["embeddings"]})
    assert resumed.calculate() == pytest.approx(reference([first, second]), rel=1e-9)
