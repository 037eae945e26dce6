"""The device ops one microbatch costs, counted at the dispatcher against a stated budget.

On an accelerator each op is a kernel launch, and launches, not bytes, are what a small microbatch
pays for. With the accelerator's chunk size (the whole microbatch in one chunk of the local pass),
``MetricCollection.accumulate`` of ``instrument()``'s default metrics (Accuracy, TokenStatsMetric,
LossMetric) on one microbatch's logits dispatches a fixed number of ops, whatever the number of tokens:
views (``view``, ``slice``, ``detach``...) launch nothing and are not counted. Accuracy alone makes the
argmax-only pass (no metric reads a probability) and has its own, smaller budget. The GRPO family and the
eight metrics of ``benchmarks/bench_accumulate.py`` have theirs on Twinkle's RL call form. A metric adds all
its sums of a microbatch together (``Metric._add_token_sums``: one stack, mask, reduction and
``_foreach_add_``), so its bookkeeping costs a fixed few ops however many states it keeps. The budgets below
are the counts as built, so that a change that adds launches per microbatch shows up here; no host sync.
"""

from __future__ import annotations

import pytest
import torch
from kit.op_counts import CountOps

import twinkle_megatron as tm
from twinkle_megatron.ops import shard, vocab_parallel_token_stats
from twinkle_megatron.ops.fused_cross_entropy import vocab_parallel_cross_entropy_with_stats
from twinkle_megatron.testing.guards import forbid_host_sync

STATS_BUDGET = 71  # the vocab-parallel pass: one chunk, statistics of every token
# The fused loss's forward: the statistics' steps with the exponentials kept, and the loss (a padded vocabulary
# adds the all-column maximum's key and the padding's share of Z; unpadded: no tail block to clamp); which of the
# labels this rank owns is found in the backward. Megatron's own loss forward alone dispatches about 20.
FUSED_BUDGET = {500: 110, 512: 80}
# The pass + Accuracy, TokenStatsMetric, LossMetric bookkeeping: each metric's sums of a microbatch stacked,
# masked, reduced and added together (Metric._add_token_sums; was 124 with one sum and one add per state, then
# 108 before a finiteness test of one tensor took 2 ops, 0·x == 0, where isfinite takes 4, then 104 before
# LossMetric held each microbatch's [loss, count] report back as a copy (Metric._add_finite): 2 ops, where checking and
# adding it took 10; the check and the sum of all reports are made once, at the sync).
ACCUMULATE_BUDGET = 96
# The same collection as instrument() feeds it: GPTModel's per-token losses beside the [sum, count] report. The
# report stands while it is finite and the finite counted tokens stand in when it is not (a device select), so
# LossMetric reads the microbatch's token losses through its view (the token mask, one finiteness test, one stack
# and reduction of [Σ finite loss, tokens, non-finite tokens], the select): 20 ops more than a report kept alone
# (2), the price of keeping a NaN sample's healthy neighbours in the loss without a host sync.
INSTRUMENT_FEED_BUDGET = 116
# Accuracy alone reads no probability: the argmax-only pass (block maxima, the first maximum's column, a -inf
# check; no exp, no sums) and its bookkeeping (was 43).
ARGMAX_ONLY_BUDGET = 38
# The GRPO family on Twinkle's call form (per-sequence lists of old log-probs and advantages, entropies in the
# outputs), one metric: the token mask, the lists on the tokens, the ratio and KL terms, one stack, mask and
# reduction for its 11 sums and one for its 2 maxima, its clip counts, then one add and one max for all its
# states. Was 103, 116, 99, 103 with one reduction and one add per state, then 78, 91, 74, 78 plus one host op
# per sequence before the lists were padded in Python and copied in two tensors (metric/inputs/sequences.py), then
# 76, 89, 72, 76 before one finiteness test for all inputs (tensors.all_finite: 4 ops, where isfinite is 4 per
# tensor), the ragged lists laid by a gather from zero-bordered rows (3 ops, was 8 and 4 more for a number
# among them, which the host knows is absent) and the clip counts reading the ratio the terms computed.
# Each includes one AND per ragged per-sequence array (old_logps, advantages): a sequence whose array does not fit
# its tokens is left out of the view's selected tokens (metric/inputs/view.py), never filled with invented values.
# GSPO was 63 while each of its three per-sequence clip counts was multiplied by the counting CP rank's weight; the
# sequences it counts are now gated once (metric/tokens/sequence_totals.py: counts_sequences_here).
GRPO_FAMILY_BUDGET = {"GRPOMetric": 49, "GSPOMetric": 61, "CISPOMetric": 45, "PPOMetric": 49}
# bench_accumulate.py's eight metrics in one collection: the family (its per-token terms and their totals made
# once per call for the four, each then adding its own clip counts: GRPOMetric._token_terms), Accuracy's
# argmax-only pass, LossMetric, TrainMetric, CompletionRewardMetric (its reward names written into their states
# only when a new name comes). Python numbers (the learning rate, the grad norm, rewards, lengths and times as
# lists) are added on the host until the sync (metric/state/pending.py): no op. Was 527, then 214 plus one per
# sequence, then 206, then 143 before LossMetric's finiteness test of its loss took 2 ops, not 4, then 141
# before it kept its loss (a device value) as a copy until the sync: 1 op; 135 with the misaligned-array rule, 133
# since GSPO gates the sequences it counts once (see GRPO_FAMILY_BUDGET).
EIGHT_METRICS = ("Accuracy", "LossMetric", "TrainMetric", "GRPOMetric", "GSPOMetric", "CISPOMetric", "PPOMetric",
                 "CompletionRewardMetric")
EIGHT_METRICS_BUDGET = 133


@pytest.fixture
def accelerator_chunks(monkeypatch):
    monkeypatch.setattr(shard, "CPU_CHUNK_BYTES", shard.ACCELERATOR_CHUNK_BYTES)


def microbatch(batch: int, seq: int, vocab: int = 512):
    generator = torch.Generator().manual_seed(batch * seq)
    inputs = {"labels": torch.randint(0, vocab - 12, (batch, seq), generator=generator),
              "completion_mask": torch.rand(batch, seq, generator=generator) > 0.2}
    outputs = {"logits": torch.randn(batch, seq, vocab, generator=generator), "loss": torch.tensor(3.0),
               "num_tokens": inputs["completion_mask"].sum()}
    return inputs, outputs


@pytest.mark.parametrize("batch, seq", [(2, 64), (4, 256)])
def test_one_microbatch_costs_a_fixed_number_of_ops(accelerator_chunks, batch, seq):
    collection = tm.MetricCollection([tm.Accuracy(vocab_size=500), tm.TokenStatsMetric(vocab_size=500),
                                      tm.LossMetric()])
    inputs, outputs = microbatch(batch, seq)
    collection.accumulate(inputs, outputs, loss_reduction="sum")  # states on the device, shapes settled
    with forbid_host_sync(), CountOps() as counted:
        collection.accumulate(inputs, outputs, loss_reduction="sum")
    assert counted.launches == ACCUMULATE_BUDGET, counted.ops
    with CountOps() as stats:
        vocab_parallel_token_stats(outputs["logits"], inputs["labels"], vocab_size=500)
    assert stats.launches == STATS_BUDGET, stats.ops


@pytest.mark.parametrize("batch, seq", [(2, 64), (4, 256)])
def test_the_instrument_feed_costs_a_fixed_number_of_ops(accelerator_chunks, batch, seq):
    collection = tm.MetricCollection([tm.Accuracy(vocab_size=500), tm.TokenStatsMetric(vocab_size=500),
                                      tm.LossMetric()])
    inputs, outputs = microbatch(batch, seq)
    outputs["token_losses"] = torch.rand(batch, seq, generator=torch.Generator().manual_seed(seq))
    collection.accumulate(inputs, outputs, loss_reduction="sum")
    with forbid_host_sync(), CountOps() as counted:
        collection.accumulate(inputs, outputs, loss_reduction="sum")
    assert counted.launches == INSTRUMENT_FEED_BUDGET, counted.ops


@pytest.mark.parametrize("batch, seq", [(2, 64), (4, 256)])
def test_accuracy_alone_costs_the_argmax_only_budget(accelerator_chunks, batch, seq):
    collection = tm.MetricCollection([tm.Accuracy(vocab_size=500)])
    inputs, outputs = microbatch(batch, seq)
    collection.accumulate(inputs, outputs)
    with forbid_host_sync(), CountOps() as counted:
        collection.accumulate(inputs, outputs)
    assert counted.launches == ARGMAX_ONLY_BUDGET, counted.ops
    assert "aten::exp" not in counted.ops


def rl_call(batch: int, seq: int, vocab: int = 512):
    """One microbatch in Twinkle's RL call form: logits, log-probs and entropies in the outputs, per-sequence
    lists of old log-probs (one per completion token) and advantages, a loss, rewards."""
    inputs, outputs = microbatch(batch, seq, vocab)
    labels = inputs["labels"]
    labels[:, :seq // 4] = -100  # the prompt
    logps = torch.log_softmax(outputs["logits"], -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    outputs.update(logps=logps, entropies=torch.rand(batch, seq))
    counted = (labels >= 0) & inputs["completion_mask"]
    kwargs = {"old_logps": [(row[keep] + 0.1).tolist() for row, keep in zip(logps, counted)],
              "advantages": [float(index % 3 - 1) for index in range(batch)], "loss_reduction": "sum",
              "lr": 1e-4, "step": 1, "grad_norm": 1.0, "rewards": {"score": [1.0] * batch},
              "completion_lengths": [seq] * batch, "generate_time": 1.0}
    return inputs, outputs, kwargs


def call_ops(metrics: list, call: tuple) -> CountOps:
    collection = tm.MetricCollection(metrics)
    inputs, outputs, kwargs = call
    collection.accumulate(inputs, outputs, **kwargs)  # states on the device, shapes settled
    with forbid_host_sync(), CountOps() as counted:
        collection.accumulate(inputs, outputs, **kwargs)
    return counted


@pytest.mark.parametrize("batch, seq", [(2, 64), (4, 256)])
@pytest.mark.parametrize("name", sorted(GRPO_FAMILY_BUDGET))
def test_the_grpo_family_costs_a_fixed_number_of_ops(accelerator_chunks, name, batch, seq):
    counted = call_ops([getattr(tm, name)()], rl_call(batch, seq))
    assert counted.launches == GRPO_FAMILY_BUDGET[name], counted.ops
    assert counted.ops["aten::_foreach_add_"] == counted.ops["aten::_foreach_maximum_"] == 1


@pytest.mark.parametrize("batch, seq", [(2, 64), (4, 256)])
def test_the_eight_benchmark_metrics_cost_a_fixed_number_of_ops(accelerator_chunks, batch, seq):
    counted = call_ops([getattr(tm, name)(vocab_size=500) if name == "Accuracy" else getattr(tm, name)()
                        for name in EIGHT_METRICS], rl_call(batch, seq))
    assert counted.launches == EIGHT_METRICS_BUDGET, counted.ops


@pytest.mark.parametrize("seq", [64, 256])
@pytest.mark.parametrize("vocab_size", [500, 512], ids=["padded", "unpadded"])
def test_the_fused_loss_forward_costs_a_fixed_number_of_ops(accelerator_chunks, seq, vocab_size):
    logits = torch.randn(seq, 2, 512)
    labels = torch.randint(0, 500, (seq, 2))
    with forbid_host_sync(), CountOps() as counted:
        vocab_parallel_cross_entropy_with_stats(logits, labels, vocab_size=vocab_size)
    assert counted.launches == FUSED_BUDGET[vocab_size], counted.ops


def test_in_place_state_updates_never_touch_a_loaded_checkpoint():
    metric = tm.Accuracy()
    inputs, outputs = microbatch(2, 8)
    metric.accumulate(inputs, outputs)
    saved = metric.state_dict()
    before = {name: value.clone() for name, value in saved["states"].items()}
    resumed = tm.Accuracy()
    resumed.load_state_dict(saved)
    resumed.accumulate(inputs, outputs)
    assert all(torch.equal(before[name], saved["states"][name]) for name in before)
    assert resumed.calculate()["total_tokens"] == 2 * int(before["total_tokens"])


@pytest.mark.parametrize("batch, seq", [(2, 64), (4, 256)])
def test_the_instrument_path_classifies_a_microbatchs_tokens_once(accelerator_chunks, batch, seq):
    """instrument() classifies a microbatch's tokens for its loss reports and hands the classes to the metrics in
    the microbatch's call: the metrics then make no classification of their own (its ops are saved), and the
    results are those of metrics that classify themselves."""
    from twinkle_megatron.megatron.microbatch_feed import microbatch_call, microbatch_feed
    from twinkle_megatron.megatron.token_reports import TokenReports

    inputs, outputs = microbatch(batch, seq)
    stats = vocab_parallel_token_stats(outputs["logits"], inputs["labels"], vocab_size=500)
    labels, loss_mask = inputs["labels"], inputs["completion_mask"]
    feed = microbatch_feed(labels=labels, loss_mask=loss_mask, stats=stats, loss=outputs["loss"],
                           num_tokens=outputs["num_tokens"])
    reports = TokenReports()
    with CountOps() as classifying:
        mask, classes = reports.loss_mask_tokens(labels, loss_mask, stats)
    results, launches = [], []
    for given in (None, classes):
        collection = tm.MetricCollection([tm.Accuracy(vocab_size=500), tm.TokenStatsMetric(vocab_size=500),
                                          tm.LossMetric()])
        collection.accumulate_call(microbatch_call(*feed, {"loss_reduction": "sum"}, given))
        with forbid_host_sync(), CountOps() as counted:
            collection.accumulate_call(microbatch_call(*feed, {"loss_reduction": "sum"}, given))
        launches.append(counted.launches)
        results.append(collection.calculate())
    token_mask_ops = 2  # labels != ignore_index, & the loss mask: the view's own, kept
    assert launches[0] - launches[1] == classifying.launches - token_mask_ops, (launches, classifying.ops)
    assert results[0] == results[1] and results[0]["total_tokens"] == 2 * int(mask.sum())  # two calls each
