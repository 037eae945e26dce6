"""The metrics fed exactly as Twinkle's MegatronModel (twinkle-kit 0.5.1) feeds them, on every stage.

What Twinkle's ``MegatronModel.forward_backward`` hands its metrics, per rank
(read from ``twinkle/model/megatron/megatron.py`` and ``twinkle/processor/base.py``):

* ``inputs``: a list with one dict per microbatch; ``input_ids`` and
  ``completion_mask`` are this CP rank's chunks (``split_cp``: chunks ``i`` and
  ``2·cp−1−i``); on the last pipeline stage ``labels`` and ``position_ids`` are
  gathered back over CP (``postprocess_tensor_cp``), elsewhere they stay local;
* ``outputs['loss']``: one float, Σloss/Σtokens of the last stage broadcast over
  PP and averaged over DP×CP; ``outputs['logps']``: the per-microbatch log-probs
  gathered over CP and concatenated over microbatches on the last stage, None
  elsewhere; ``outputs['logits']`` (``return_logits=True``): this rank's raw TP
  vocab shard of its CP chunks, concatenated over microbatches, ``[]`` on earlier
  stages;
* keywords of its optimizer group: ``lr=[per param group]``, ``step``,
  ``gradient_accumulation_steps``, ``grad_norm``.

Every rank's results must equal the single-process reference on the same global batch.
"""

from __future__ import annotations

import math

import pytest
import torch
from kit.references import accuracy_reference, full_vocab_stats, token_stats_reference

from twinkle_megatron import Accuracy, DPOMetric, GRPOMetric, LossMetric, MetricCollection, TokenStatsMetric
from twinkle_megatron.testing.batches import RankView, split_microbatches
from twinkle_megatron.testing.distributed import Layout, run_distributed
from twinkle_megatron.testing.invariance import Call, assert_layout_invariant, run_variants

BATCH, SEQ, VOCAB, PADDED_VOCAB = 8, 16, 40, 48


def global_batch() -> dict:
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(BATCH, SEQ, PADDED_VOCAB, generator=generator) * 2
    logits[..., VOCAB:] = 50.0  # padding columns: never read
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    hits = torch.rand(BATCH, SEQ, generator=generator) < 0.4
    labels = torch.where(hits, logits[..., :VOCAB].argmax(-1), labels)
    labels[:, :3] = -100  # prompts
    labels[torch.rand(BATCH, SEQ, generator=generator) < 0.1] = -100
    logps = full_vocab_stats(logits, labels, VOCAB).logprobs.float()
    old_logps = logps + 0.3 * torch.randn(BATCH, SEQ, generator=generator)
    advantages = torch.randn(BATCH, generator=generator)
    return {"logits": logits, "labels": labels, "input_ids": torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator),
            "logps": logps, "old_logps": old_logps, "advantages": advantages}


def references() -> dict:
    batch = global_batch()
    labels, logits = batch["labels"], batch["logits"]
    mask = labels != -100
    new, old = batch["logps"].double(), batch["old_logps"].double()
    diff = (new - old)[mask]
    chosen = torch.where(mask, new, 0.0).sum(-1)[0::2]
    rejected = torch.where(mask, new, 0.0).sum(-1)[1::2]
    return {
        **accuracy_reference(logits, labels, vocab_size=VOCAB),
        **token_stats_reference(logits, labels, vocab_size=VOCAB),
        "train/mean_new_logp": float(new[mask].mean()), "train/mean_old_logp": float(old[mask].mean()),
        "train/approx_kl": float((diff.exp() - diff - 1).mean()),
        "logps/chosen": float(chosen.mean()), "logps/rejected": float(rejected.mean()),
        "loss": 2.5, "grad_norm": 0.5,
    }


def feed_twinkle_megatron(collection: MetricCollection, batch: dict, view: RankView, variant: tuple[int, bool]) -> list:
    """(inputs, outputs) exactly as Twinkle's MegatronModel gives them to this rank's metrics, with the
    keywords of its optimizer group and GRPO's ragged per-sample lists (the counted tokens' values, in order).
    ``variant``: the number of microbatches, and whether the data has a ``completion_mask`` (RL data does)."""
    num_microbatches, with_completion_mask = variant
    local = {key: view.rows(value) for key, value in batch.items()}
    inputs = []
    for ids, labels in zip(split_microbatches(local["input_ids"], num_microbatches),
                           split_microbatches(local["labels"], num_microbatches)):
        inputs.append({"input_ids": view.chunks(ids),
                       "labels": labels if view.last_stage else view.chunks(labels),
                       "position_ids": torch.arange(SEQ)[None].expand(labels.shape[0], -1)})
        if with_completion_mask:
            inputs[-1]["completion_mask"] = view.chunks(labels != -100)
    if view.last_stage:
        outputs = {"loss": 2.5, "logits": view.vocab(view.chunks(local["logits"])).contiguous(),
                   "logps": local["logps"]}
    else:
        outputs = {"loss": 2.5, "logits": [], "logps": None}
    old = [row[labels != -100].tolist() for row, labels in zip(local["old_logps"], local["labels"])]
    return [Call(inputs, outputs, {"lr": [1e-4, 1e-5], "step": 7, "gradient_accumulation_steps": 1,
                                   "grad_norm": 0.5, "old_logps": old, "advantages": local["advantages"].tolist()})]


def make_collection(_=None) -> MetricCollection:
    # Twinkle's logits are [b, s, V]; a CP rank's [8, 8, V] cannot tell that itself (b == s / cp).
    return MetricCollection([Accuracy(vocab_size=VOCAB, logits_layout="bsv"),
                             TokenStatsMetric(vocab_size=VOCAB, logits_layout="bsv"), LossMetric(),
                             GRPOMetric(logits_layout="bsv"), DPOMetric()])


@pytest.mark.parametrize("layout", [Layout(pp=2, dp=2), Layout(tp=2, pp=2, dp=2), Layout(cp=2, dp=2),
                                    Layout(tp=2, cp=2), Layout(cp=2, pp=2)], ids=str)
def test_twinkle_megatron_model_shapes_give_the_single_process_result(layout):
    batch = global_batch()
    variants = [(count, with_mask) for count in (1, 2) for with_mask in (False, True)]
    single = run_variants(make_collection, batch, feed_twinkle_megatron, variants, RankView())

    def expected(layout: Layout, variant: tuple[int, bool]) -> dict:
        """Every key as the same collection reports it in one process on the whole batch, and those with a
        full-vocabulary reference as that says. GRPO's entropy from logits (no vocab_size given: over every
        column) needs the logits and log-probs of the same tokens: under CP Twinkle gathers the log-probs and
        not the logits, so without a (local) completion_mask to cut the log-probs to this rank's chunks GRPO
        leaves ``train/entropy`` out there (its documented limitation)."""
        result = {**single[variants.index(variant)].result, **references()}
        with_mask = variant[1]
        return {k: v for k, v in result.items() if k != "train/entropy" or layout.cp == 1 or with_mask}

    assert_layout_invariant(make_collection, batch, [layout], feed=feed_twinkle_megatron, variants=variants,
                            expected=expected, rel=1e-5, calculate_collectives={"all_reduce": 2})  # still one sync


def test_gathered_labels_with_local_logits_are_cut_to_this_cp_rank_single_process_view():
    """The CP alignment on its own: full labels, this rank's logits chunks, by hand (CP rank 1 of 2)."""

    def feed(metric: Accuracy, batch: dict, view: RankView, _) -> list[Call]:
        return [Call({"labels": batch["labels"]}, {"logits": view.chunks(batch["logits"])})]

    batch = global_batch()
    assert_layout_invariant(lambda _: Accuracy(vocab_size=VOCAB, logits_layout="bsv"), batch, [Layout(cp=2)], feed=feed,
                            expected=accuracy_reference(batch["logits"], batch["labels"], vocab_size=VOCAB))


def test_a_ragged_array_of_the_wrong_length_is_counted_once_over_cp_ranks():
    """Whole labels, a local completion_mask, ragged old_logps with one sequence one value short: the arrays
    are laid onto the whole labels on every CP rank, and the misaligned sequence is counted once."""

    def feed(metric: GRPOMetric, batch: dict, view: RankView, _) -> list[Call]:
        labels = batch["labels"]
        old = [row[row_labels != -100].tolist() for row, row_labels in zip(batch["old_logps"], labels)]
        old[3] = old[3][:-1]
        return [Call({"labels": labels, "completion_mask": view.chunks(labels != -100),
                      "input_ids": view.chunks(batch["input_ids"])},
                     {"logps": batch["logps"]}, {"old_logps": old, "advantages": batch["advantages"].tolist()})]

    runs = assert_layout_invariant(lambda _: GRPOMetric(), global_batch(), [Layout(cp=2)], feed=feed,
                                   accumulate_collectives={})
    assert runs[Layout(cp=2)][0][0].result["train/misaligned_arrays"] == 1


def test_mismatched_lengths_under_cp_say_which_tensor_is_which():
    def one_rank():
        batch = global_batch()
        metric = Accuracy(vocab_size=VOCAB)
        with pytest.raises(ValueError, match=r"sequence lengths logits 5, labels 16"):
            metric.accumulate({"labels": batch["labels"]}, {"logits": batch["logits"][:, :5]})
        grpo = GRPOMetric(cp_gathered=True)
        with pytest.raises(ValueError, match=r"cp_gathered=True, but \['logps'\] hold this CP rank's chunks"):
            grpo.accumulate({"labels": batch["labels"]}, {"logps": batch["logps"][:, :8]})
        return True

    assert all(run_distributed(one_rank, layout=Layout(cp=2)))


def test_loss_of_twinkle_megatron_is_already_averaged_and_stays_so():
    # 4 microbatch inputs and one float: equal-weight mean, on every stage.
    metric = LossMetric()
    metric.accumulate([{"labels": torch.ones(1, 3, dtype=torch.long)}] * 4, {"loss": 2.5, "logits": [],
                                                                             "logps": None}, lr=[1e-4], step=1)
    assert metric.calculate() == {"loss": 2.5}
    assert math.isfinite(references()["loss"])
