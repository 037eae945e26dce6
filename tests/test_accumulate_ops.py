"""The device ops one microbatch costs, counted at the dispatcher against a stated budget.

On an accelerator each op is a kernel launch, and launches, not bytes, are what a small microbatch
pays for. With the accelerator's chunk size (the whole microbatch in one chunk of the local pass),
``MetricCollection.accumulate`` of ``instrument()``'s default metrics (Accuracy, TokenStatsMetric,
LossMetric) on one microbatch's logits dispatches a fixed number of ops, whatever the number of tokens:
views (``view``, ``slice``, ``detach``...) launch nothing and are not counted. Accuracy alone makes the
argmax-only pass (no metric reads a probability) and has its own, smaller budget. The budgets below are
the counts as built, so that a change that adds launches per microbatch shows up here; no host sync.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from kit.guards import forbid_host_sync
from torch.utils._python_dispatch import TorchDispatchMode

import twinkle_megatron as tm
from twinkle_megatron.ops import shard, vocab_parallel_token_stats
from twinkle_megatron.ops.fused_cross_entropy import vocab_parallel_cross_entropy_with_stats

# Ops that only make views or aliases: no kernel on any device.
VIEWS = {"aten::view", "aten::slice", "aten::select", "aten::unsqueeze", "aten::squeeze", "aten::alias",
         "aten::detach", "aten::lift_fresh", "aten::t", "aten::transpose", "aten::permute", "aten::expand",
         "aten::as_strided", "aten::_reshape_alias", "aten::reshape", "aten::unflatten", "aten::split"}
STATS_BUDGET = 71  # the vocab-parallel pass: one chunk, statistics of every token
# The fused loss's forward: the loss and the same statistics (a padded vocabulary adds the all-column maximum's
# key); Megatron's own loss forward alone dispatches about 20.
FUSED_BUDGET = {500: 113, 512: 85}  # unpadded: no tail block to clamp (was 86)
ACCUMULATE_BUDGET = 124  # the pass + Accuracy, TokenStatsMetric, LossMetric bookkeeping (was 125)
# Accuracy alone reads no probability: the argmax-only pass (block maxima, the first maximum's column, a -inf
# check; no exp, no sums) and its bookkeeping. One process: no key to pack.
ARGMAX_ONLY_BUDGET = 43


class CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func._schema.name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def launches(self) -> int:
        return sum(n for name, n in self.ops.items() if name not in VIEWS)


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
def test_accuracy_alone_costs_the_argmax_only_budget(accelerator_chunks, batch, seq):
    collection = tm.MetricCollection([tm.Accuracy(vocab_size=500)])
    inputs, outputs = microbatch(batch, seq)
    collection.accumulate(inputs, outputs)
    with forbid_host_sync(), CountOps() as counted:
        collection.accumulate(inputs, outputs)
    assert counted.launches == ARGMAX_ONLY_BUDGET, counted.ops
    assert "aten::exp" not in counted.ops


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
