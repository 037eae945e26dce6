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
from batches import split_microbatches
from distributed import Layout, run_distributed
from guards import count_collectives
from megatron_gpt import cp_slice

from twinkle_megatron import Accuracy, DPOMetric, GRPOMetric, LossMetric, MetricCollection, TokenStatsMetric

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
    logprobs = torch.log_softmax(logits[..., :VOCAB].double(), -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    logps = torch.where(labels != -100, logprobs, 0.0).float()
    old_logps = logps + 0.3 * torch.randn(BATCH, SEQ, generator=generator)
    advantages = torch.randn(BATCH, generator=generator)
    return {"logits": logits, "labels": labels, "input_ids": torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator),
            "logps": logps, "old_logps": old_logps, "advantages": advantages}


def references() -> dict:
    batch = global_batch()
    labels, logits = batch["labels"], batch["logits"][..., :VOCAB].double()
    mask = labels != -100
    tokens = int(mask.sum())
    correct = int(((logits.argmax(-1) == labels) & mask).sum())
    logp = torch.log_softmax(logits, -1)
    entropy = -(logp.exp() * logp).sum(-1)
    new, old = batch["logps"].double(), batch["old_logps"].double()
    diff = (new - old)[mask]
    chosen = torch.where(mask, new, 0.0).sum(-1)[0::2]
    rejected = torch.where(mask, new, 0.0).sum(-1)[1::2]
    return {
        "accuracy": correct / tokens, "correct_tokens": correct, "total_tokens": tokens,
        "logprob": float(logp.gather(-1, labels.clamp(min=0)[..., None])[..., 0][mask].mean()),
        "entropy": float(entropy[mask].mean()),
        "train/mean_new_logp": float(new[mask].mean()), "train/mean_old_logp": float(old[mask].mean()),
        "train/approx_kl": float((diff.exp() - diff - 1).mean()),
        "logps/chosen": float(chosen.mean()), "logps/rejected": float(rejected.mean()),
        "loss": 2.5, "learning rate(param group 1)": 1e-4, "learning rate(param group 2)": 1e-5,
    }


def twinkle_megatron_view(num_microbatches: int) -> tuple[list, dict]:
    """(inputs, outputs) exactly as Twinkle's MegatronModel gives them to this rank's metrics."""
    from megatron.core import parallel_state as ps

    batch = global_batch()
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    cp, cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    rows = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
    local = {key: value[rows] for key, value in batch.items()}
    last = ps.is_pipeline_last_stage(ignore_virtual=True)
    inputs = []
    for ids, labels in zip(split_microbatches(local["input_ids"], num_microbatches),
                           split_microbatches(local["labels"], num_microbatches)):
        inputs.append({"input_ids": cp_slice(ids, 1, cp, cp_rank),
                       "labels": labels if last else cp_slice(labels, 1, cp, cp_rank),
                       "position_ids": torch.arange(SEQ)[None].expand(labels.shape[0], -1)})
    if not last:
        return inputs, {"loss": 2.5, "logits": [], "logps": None}
    width = PADDED_VOCAB // tp
    logits = cp_slice(local["logits"], 1, cp, cp_rank)[..., tp_rank * width:(tp_rank + 1) * width]
    outputs = {"loss": 2.5, "logits": logits.contiguous(), "logps": local["logps"]}
    return inputs, outputs


def _twinkle_megatron_step(num_microbatches: int) -> tuple[dict, dict]:
    from megatron.core import parallel_state as ps

    inputs, outputs = twinkle_megatron_view(num_microbatches)
    collection = MetricCollection([Accuracy(vocab_size=VOCAB), TokenStatsMetric(vocab_size=VOCAB), LossMetric(),
                                   GRPOMetric(), DPOMetric()])
    batch = global_batch()
    count = BATCH // ps.get_data_parallel_world_size()
    start = ps.get_data_parallel_rank() * count
    # GRPO's old_logps / advantages: Twinkle's ragged per-sample lists (the counted tokens' values, in order).
    old = [row[labels != -100].tolist() for row, labels in zip(batch["old_logps"][start:start + count],
                                                               batch["labels"][start:start + count])]
    collection.accumulate(inputs, outputs, lr=[1e-4, 1e-5], step=7, gradient_accumulation_steps=1, grad_norm=0.5,
                          old_logps=old, advantages=batch["advantages"][start:start + count].tolist())
    with count_collectives() as counts:
        results = collection.calculate()
    return results, dict(counts)


@pytest.mark.parametrize("layout", [Layout(pp=2, dp=2), Layout(tp=2, pp=2, dp=2), Layout(cp=2, dp=2),
                                    Layout(tp=2, cp=2), Layout(cp=2, pp=2)], ids=str)
def test_twinkle_megatron_model_shapes_give_the_single_process_result(layout):
    expected = references()
    for num_microbatches in (1, 2):
        per_rank = run_distributed(_twinkle_megatron_step, layout=layout, args=(num_microbatches,))
        results = [result for result, _ in per_rank]
        assert all(r == results[0] for r in results), "every stage, every rank: the same dict"
        for key, value in expected.items():
            if key.startswith("learning rate"):
                continue
            assert results[0][key] == pytest.approx(value, rel=1e-5), (key, num_microbatches)
        assert results[0]["grad_norm"] == 0.5
        assert all(counts == {"all_reduce": 2} for _, counts in per_rank), "still one sync"


def test_gathered_labels_with_local_logits_are_cut_to_this_cp_rank_single_process_view():
    """The CP alignment on its own: full labels, this rank's logits chunks, by hand (CP rank 1 of 2)."""

    def one_rank():
        from megatron.core import parallel_state as ps

        batch = global_batch()
        cp, cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
        metric = Accuracy(vocab_size=VOCAB)
        metric.accumulate({"labels": batch["labels"]}, {"logits": cp_slice(batch["logits"], 1, cp, cp_rank)})
        return metric.calculate()

    results = run_distributed(one_rank, layout=Layout(cp=2))
    assert results[0] == results[1]
    assert results[0]["correct_tokens"] == references()["correct_tokens"]


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
