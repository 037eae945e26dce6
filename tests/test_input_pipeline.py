"""The one input pipeline: a call's ``(inputs, outputs, keywords)`` become one normalised view per microbatch
(microbatches and per-call values, Twinkle's per-sequence lists laid onto the tokens, the CP cut, packed
sub-sequences), built once per call and shared by the metrics of a collection that read the same data.

Checked through what a caller sees: the results against a single-process reference (ragged lists laid onto whole
labels before the CP cut), and the device ops a collection dispatches (a metric that reads what another already
read adds only its own bookkeeping, the same for every further reader, with the same results as alone). That each
stage runs once per call also shows in the per-microbatch op budgets of ``tests/test_accumulate_ops.py`` (the GRPO
family on Twinkle's ragged call form: a stage run twice adds its ops) and in its results in ``tests/test_grpo.py``
(every layout, CP included) and ``tests/test_packed.py`` (packed sub-sequences).
"""

from __future__ import annotations

import math

import pytest
import torch
from kit.op_counts import CountOps

import twinkle_megatron as tm
from twinkle_megatron.parallel import ParallelContext


def grpo_call(microbatches: int = 2, rows: int = 2, length: int = 6):
    generator = torch.Generator().manual_seed(7)
    inputs, logps = [], []
    for _ in range(microbatches):
        labels = torch.randint(0, 50, (rows, length), generator=generator)
        labels[:, :2] = -100
        inputs.append({"labels": labels, "input_ids": labels.clamp(min=0)})
        logps.append(-torch.rand(rows, length, generator=generator, dtype=torch.float64))
    sequences = microbatches * rows
    old = [(-torch.rand(length - 2, generator=generator, dtype=torch.float64)).tolist() for _ in range(sequences)]
    advantages = torch.randn(sequences, generator=generator, dtype=torch.float64).tolist()
    return inputs, {"logps": logps}, {"old_logps": old, "advantages": advantages}


def ops_of_one_call(metrics: list, microbatches: int = 2) -> tuple[int, dict]:
    """The ops a collection of ``metrics`` dispatches for one GRPO call with logits (after a first call settled
    the states), and its results."""
    inputs, outputs, keywords = grpo_call(microbatches)
    outputs = {**outputs, "logits": [torch.randn(2, 6, 50, generator=torch.Generator().manual_seed(5))]
               * microbatches}
    collection = tm.MetricCollection(metrics)
    collection.accumulate(inputs, outputs, **keywords)
    with CountOps() as counted:
        collection.accumulate(inputs, outputs, **keywords)
    return counted.launches, collection.calculate()


# (the metric already in the collection, a metric reading the same data): GRPO's ragged lists, ratios and entropy
# pass; PPO's policy side (GRPO's keys with the same values); Accuracy's argmax-only pass.
READERS = [(tm.GRPOMetric, tm.PPOMetric), (tm.GRPOMetric, tm.GRPOMetric), (tm.Accuracy, tm.Accuracy)]


@pytest.mark.parametrize("first, reader", READERS, ids=lambda cls: cls.__name__)
@pytest.mark.parametrize("microbatches", [1, 3])
def test_a_metric_reading_what_another_read_adds_only_its_own_bookkeeping(first, reader, microbatches):
    alone, expected = ops_of_one_call([reader()], microbatches)
    base, _ = ops_of_one_call([first()], microbatches)
    one, results = ops_of_one_call([first(), reader()], microbatches)
    two, _ = ops_of_one_call([first(), reader(), reader()], microbatches)
    # Views, sequence lists, token terms and the logits pass are made once per call: each further reader costs
    # its own sums and state updates only, the same for the second as for the first, under half of its ops alone.
    assert two - one == one - base, (base, one, two)
    assert 0 < 2 * (one - base) < alone, (one - base, alone)
    for key, value in expected.items():
        assert math.isclose(results[key], value, rel_tol=1e-12), key


def test_ragged_lists_are_laid_onto_whole_labels_before_the_cp_cut():
    """Twinkle's Megatron model under CP: whole labels and logps, a completion mask of this rank's chunks, and
    ragged per-sequence lists; the view cuts the laid-out values with the labels (stage 2 before stage 3)."""
    cp, length = 2, 8
    generator = torch.Generator().manual_seed(11)
    labels = torch.randint(0, 50, (2, length), generator=generator)
    labels[0, :3] = -100
    logps = -torch.rand(2, length, generator=generator, dtype=torch.float64)
    counted = (labels != -100).sum(-1).tolist()
    old = [(-torch.rand(n, generator=generator, dtype=torch.float64)).tolist() for n in counted]
    advantages = [1.0, -0.5]
    totals: dict[str, float] = {}
    for rank in range(cp):
        metric = tm.GRPOMetric(device_mesh=ParallelContext(cp_size=cp, cp_rank=rank))
        chunk = length // (2 * cp)
        local = torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk),
                           torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)])
        inputs = {"labels": labels, "input_ids": labels[:, local].clamp(min=0),
                  "completion_mask": torch.ones(2, length // cp, dtype=torch.bool)}
        metric.accumulate(inputs, {"logps": logps}, old_logps=old, advantages=advantages)
        for name, value in metric.sync_states().items():
            totals[name] = totals.get(name, 0.0) + float(value.sum())
    # The single-process reference: each ragged list on its sequence's counted tokens, k3 = e^d − d − 1.
    mask = labels != -100
    old_tokens = torch.zeros_like(logps)
    for row in range(2):
        old_tokens[row, mask[row]] = torch.tensor(old[row], dtype=torch.float64)
    d = (logps - old_tokens)[mask]
    assert totals["tokens"] == mask.sum()
    assert math.isclose(totals["approx_kl_sum"], float((d.exp() - d - 1).sum()), rel_tol=1e-12)
    assert math.isclose(totals["old_logp_sum"], float(old_tokens[mask].sum()), rel_tol=1e-12)
