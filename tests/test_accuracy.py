"""Accuracy: layout invariance against full-vocabulary torch, shared statistics, bad input."""

from __future__ import annotations

import pytest
import torch
from kit.references import accuracy_reference, full_vocab_stats

from twinkle_megatron import Accuracy, MetricCollection
from twinkle_megatron.metric import LogitsMetric
from twinkle_megatron.testing.batches import RankView, split_microbatches
from twinkle_megatron.testing.distributed import Layout, run_distributed
from twinkle_megatron.testing.invariance import Call, assert_layout_invariant, calculate_or_error

BATCH, SEQ, VOCAB, PADDED_VOCAB = 8, 12, 50, 56  # Megatron pads the vocabulary to a multiple of TP


def global_batch(seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(BATCH, SEQ, PADDED_VOCAB, generator=generator) * 3
    logits[..., VOCAB:] = 100.0  # padding columns would win every argmax if they were read
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    hits = torch.rand(BATCH, SEQ, generator=generator) < 0.5
    labels = torch.where(hits, logits[..., :VOCAB].argmax(-1), labels)
    # Ties across the TP shard boundary at column 27/28 (TP=2 shards 28 columns): lowest index wins.
    logits[0, :4, 20] = logits[0, :4, 40] = 50.0
    labels[0, :2] = 20
    labels[0, 2:4] = 40
    labels[torch.rand(BATCH, SEQ, generator=generator) < 0.2] = -100
    completion_mask = torch.rand(BATCH, SEQ, generator=generator) < 0.8
    return {"logits": logits, "labels": labels, "completion_mask": completion_mask}


def feed_megatron_style(metric: Accuracy, batch: dict, view: RankView, variant: tuple) -> list[Call]:
    """The last stage passes its DP rows / CP chunks / vocab shard, whole or per microbatch, [b,s,v] or [s,b,v]."""
    num_microbatches, as_list, megatron_layout = variant
    if not view.last_stage:
        return []
    local = {k: view.tokens(v) for k, v in batch.items()}
    logits = view.vocab(local["logits"])
    inputs = [{"labels": labels, "completion_mask": mask} for labels, mask in
              zip(split_microbatches(local["labels"], num_microbatches),
                  split_microbatches(local["completion_mask"], num_microbatches))]
    if as_list:
        logits = split_microbatches(logits, num_microbatches)
        if megatron_layout:
            logits = [mb.transpose(0, 1).contiguous() for mb in logits]
    elif megatron_layout:
        logits = logits.transpose(0, 1).contiguous()
    return [Call(inputs, {"logits": logits})]


@pytest.mark.parametrize("layout", [Layout(tp=2), Layout(tp=2, pp=2), Layout(tp=2, pp=2, dp=2),
                                    Layout(tp=2, cp=2), Layout(tp=4), Layout()], ids=str)
def test_accuracy_matches_full_vocabulary_reference(layout):
    batch = global_batch()
    assert_layout_invariant(
        lambda _: Accuracy(vocab_size=VOCAB), batch, [layout], feed=feed_megatron_style,
        variants=[(1, True, False), (2, True, True), (2, False, False), (4, True, False), (4, False, True)],
        expected=accuracy_reference(batch["logits"], batch["labels"], batch["completion_mask"], VOCAB), rel=1e-12)


def test_ties_go_to_the_lowest_index_like_torch_argmax():
    logits = torch.zeros(1, 2, 6)
    logits[0, :, 1] = logits[0, :, 4] = 3.0
    metric = Accuracy()
    metric.accumulate({"labels": torch.tensor([[1, 4]])}, {"logits": logits})
    assert metric.calculate() == {"accuracy": 0.5, "correct_tokens": 1, "total_tokens": 2}


class MeanEntropy(LogitsMetric):
    """A second reader of the same logits (as GRPO's entropy is): it reads the collection's call, whose
    token statistics are made once per microbatch for every reader."""

    token_statistics = ("entropy",)

    def __init__(self, device_mesh=None, process_group=None, **kwargs):
        super().__init__(device_mesh, process_group, vocab_size=VOCAB, **kwargs)
        self.add_state("entropy_sum", "sum")
        self.add_state("tokens", "sum")

    def accumulate_call(self, call):
        for batch, classes, _ in self._token_batches(call):
            self._add("entropy_sum", torch.where(classes.counted, batch.stats.entropy, 0.0).sum())
            self._add("tokens", classes.counted.sum())

    def compute(self, states):
        return {"entropy": states["entropy_sum"] / states["tokens"]} if states["tokens"] else {}


def feed_two_microbatches(collection: MetricCollection, batch: dict, view: RankView, _) -> list[Call]:
    inputs = [{"labels": labels} for labels in split_microbatches(view.tokens(batch["labels"]), 2)]
    return [Call(inputs, {"logits": split_microbatches(view.vocab(view.tokens(batch["logits"])), 2)})]


def test_metrics_reading_the_same_logits_share_one_pass():
    batch = global_batch()
    stats = full_vocab_stats(batch["logits"], vocab_size=VOCAB)
    expected = {**accuracy_reference(batch["logits"], batch["labels"], vocab_size=VOCAB),
                "entropy": float(stats.entropy[batch["labels"] != -100].mean())}
    # Two microbatches × two TP collectives, whatever the number of readers.
    assert_layout_invariant(lambda _: MetricCollection([Accuracy(vocab_size=VOCAB), MeanEntropy()]), batch,
                            [Layout(tp=2)], feed=feed_two_microbatches, expected=expected,
                            accumulate_collectives={"all_reduce": 4})


def _invalid_label_on_one_rank(strict: bool) -> dict | str:
    import torch.distributed as dist

    logits = torch.randn(2, 3, 8)
    labels = torch.zeros(2, 3, dtype=torch.long)
    if dist.get_rank() == 1:
        labels[1, 2] = 9  # out of range
    metric = Accuracy(strict=strict)
    metric.accumulate({"labels": labels}, {"logits": logits})
    return calculate_or_error(metric, ValueError)


def test_invalid_labels_raise_on_every_rank():
    results = run_distributed(_invalid_label_on_one_rank, 2, args=(True,))
    assert all("1 label(s) outside [0, vocab_size)" in r for r in results), results
    results = run_distributed(_invalid_label_on_one_rank, 2, args=(False,))
    assert all(r["invalid_labels"] == 1 and r["total_tokens"] == 11 for r in results)


def test_nonfinite_logits_are_counted_not_scored():
    logits = torch.randn(1, 4, 5)
    labels = logits.argmax(-1)
    logits[0, 1, 3] = float("nan")
    logits[0, 2, 0] = float("inf")
    metric = Accuracy()
    metric.accumulate({"labels": labels}, {"logits": logits})
    assert metric.calculate() == {"accuracy": 1.0, "correct_tokens": 2, "total_tokens": 2, "nonfinite_tokens": 2}


def test_fully_masked_and_empty_microbatches():
    metric = Accuracy()
    metric.accumulate([{"labels": torch.full((2, 3), -100)}, {"labels": torch.zeros(0, 3, dtype=torch.long)}],
                      {"logits": [torch.randn(2, 3, 7), torch.randn(0, 3, 7)]})
    assert metric.calculate() == {}
    metric.accumulate({"labels": torch.zeros(2, 3, dtype=torch.long)}, {"logits": torch.randn(2, 3, 7)})
    assert metric.calculate()["total_tokens"] == 6


def test_packed_sequences():
    logits = torch.randn(10, 1, 9)  # Megatron's THD: [t, 1, v] with labels [1, t]
    labels = logits[:, 0].argmax(-1).view(1, 10)
    metric = Accuracy()
    metric.accumulate({"labels": labels}, {"logits": logits})
    assert metric.calculate()["accuracy"] == 1.0
    metric.accumulate({"labels": labels.view(10)}, {"logits": logits.view(10, 9)})
    assert metric.calculate()["total_tokens"] == 10


def test_square_batches_follow_the_layout_keyword():
    logits = torch.randn(3, 3, 5)
    labels = logits.argmax(-1)
    bsv, sbv = Accuracy(logits_layout="bsv"), Accuracy(logits_layout="sbv")  # square: declared (else a warning)
    bsv.accumulate({"labels": labels}, {"logits": logits})
    sbv.accumulate({"labels": labels.t()}, {"logits": logits})
    assert bsv.calculate()["accuracy"] == sbv.calculate()["accuracy"] == 1.0


def test_shape_mismatch_names_both_shapes():
    metric = Accuracy()
    with pytest.raises(ValueError, match=r"labels has shape \(2, 5\) but logits has shape \(2, 4, 7\)"):
        metric.accumulate({"labels": torch.zeros(2, 5, dtype=torch.long)}, {"logits": torch.randn(2, 4, 7)})
    with pytest.raises(ValueError, match=r"labels has shape \(2, 4\) but completion_mask has shape \(2, 3\)"):
        metric.accumulate({"labels": torch.zeros(2, 4, dtype=torch.long), "completion_mask": torch.ones(2, 3)},
                          {"logits": torch.randn(2, 4, 7)})
    with pytest.raises(ValueError, match="logits_layout must be one of"):
        metric.accumulate({"labels": torch.zeros(2, 4, dtype=torch.long)}, {"logits": torch.randn(2, 4, 7)},
                          logits_layout="bs")


def test_accuracy_alone_makes_the_argmax_only_pass_in_one_collective_per_microbatch():
    """No metric of the collection reads a probability: no exp, one TP all-reduce per microbatch, same result."""
    batch = global_batch()
    assert_layout_invariant(lambda _: MetricCollection([Accuracy(vocab_size=VOCAB)]), batch, [Layout(tp=2)],
                            feed=feed_two_microbatches,
                            expected=accuracy_reference(batch["logits"], batch["labels"], vocab_size=VOCAB),
                            accumulate_collectives={"all_reduce": 2})


def _problem_tokens_both_ways() -> list:
    """NaN, +inf and -inf logits (in either TP shard, and in padding columns, which are never read) and labels
    outside the vocabulary: Accuracy alone (the argmax-only pass) and next to an entropy reader (the full pass)."""
    import torch.distributed as dist

    from twinkle_megatron.parallel import ParallelContext

    rank = dist.get_rank()
    context = ParallelContext(tp_group=dist.group.WORLD, tp_size=2, tp_rank=rank)
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 6, PADDED_VOCAB, generator=generator)
    labels = logits[..., :VOCAB].argmax(-1)
    logits[0, 0, 3], logits[0, 1, 40], logits[0, 2, 45] = float("nan"), float("inf"), float("-inf")
    logits[0, 3, 2] = float("-inf")
    logits[1, 0, VOCAB + 1] = float("nan")  # padding: the token still counts
    labels[1, 1], labels[1, 2], labels[1, 3] = VOCAB, -7, -100
    shard = PADDED_VOCAB // 2
    inputs, outputs = {"labels": labels}, {"logits": logits[..., rank * shard:(rank + 1) * shard]}
    results = []
    for metrics in ([Accuracy(context, vocab_size=VOCAB, strict=False)],
                    [Accuracy(context, vocab_size=VOCAB, strict=False), MeanEntropy(context)]):
        collection = MetricCollection(metrics)
        collection.accumulate(inputs, outputs)
        results.append({k: v for k, v in collection.calculate().items() if k != "entropy"})
    return results


def test_problem_tokens_are_classified_alike_by_both_passes():
    per_rank = run_distributed(_problem_tokens_both_ways, 2)
    assert all(light == full for light, full in per_rank), per_rank
    light = per_rank[0][0]  # TP rank 0 counts the tokens (no DP sync in this context)
    assert light["nonfinite_tokens"] == 4 and light["invalid_labels"] == 2 and light["total_tokens"] == 5, light


def _collectives_with_and_without_entropies() -> dict:
    """Accuracy and GRPOMetric over TP=2 logits: given ``entropies`` (Twinkle's model forward), GRPO reads no
    statistics of the logits, so the collection makes the argmax-only pass; without them, the full one."""
    import torch.distributed as dist

    from twinkle_megatron import GRPOMetric
    from twinkle_megatron.parallel import ParallelContext
    from twinkle_megatron.testing.guards import count_collectives

    rank = dist.get_rank()
    context = ParallelContext(tp_group=dist.group.WORLD, tp_size=2, tp_rank=rank)
    batch = global_batch()
    logits, labels = batch["logits"][:2], batch["labels"][:2]
    shard = PADDED_VOCAB // 2
    full = full_vocab_stats(logits, labels, vocab_size=VOCAB)
    outputs = {"logits": logits[..., rank * shard:(rank + 1) * shard], "logps": torch.where(labels != -100,
                                                                                             full.logprobs, 0.0)}
    counts, results = {}, {}
    for name, extra in (("with", {"entropies": full.entropy}), ("without", {})):
        collection = MetricCollection([Accuracy(context, vocab_size=VOCAB), GRPOMetric(context, vocab_size=VOCAB)])
        with count_collectives() as counted:
            collection.accumulate({"labels": labels}, {**outputs, **extra})
        counts[name] = dict(counted)
        results[name] = collection.calculate()
    return {"counts": counts, "results": results}


def test_given_entropies_leave_the_argmax_only_pass_to_accuracy():
    for rank, r in enumerate(run_distributed(_collectives_with_and_without_entropies, 2)):
        assert r["counts"] == {"with": {"all_reduce": 1}, "without": {"all_reduce": 2}}, r["counts"]
        if rank == 0:
            with_, without = r["results"]["with"], r["results"]["without"]
            assert with_.keys() == without.keys() and "train/entropy" in with_
            assert all(with_[k] == pytest.approx(without[k], rel=1e-5) for k in with_), (with_, without)
