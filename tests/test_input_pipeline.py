"""The one input pipeline (``metric/inputs/view.py``): each stage entered once per call, in one direction.

A call's ``(inputs, outputs, keywords)`` become one view per microbatch: stage 1 ``inputs`` (microbatches,
per-call values), stage 2 ``sequences`` (per-sequence values), stage 3 ``context_parallel`` (the CP cut),
stage 4 ``packed`` (sub-sequences). The tests below trace which of these modules a metric's ``accumulate``
enters, in order, and check that the sequence never returns to a stage it has left, with several
microbatches, Twinkle's ragged per-sequence lists, and data that needs the CP cut.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

import twinkle_megatron as tm
from twinkle_megatron.metric.inputs import shared_call
from twinkle_megatron.parallel import ParallelContext

METRIC = Path(tm.__file__).parent / "metric" / "inputs"
STAGES = ["microbatches.py", "sequences.py", "context_parallel.py", "packed.py"]


def stages_entered(call) -> list[str]:
    """The stage modules whose functions ``call()`` enters, in order, consecutive repeats collapsed."""
    entered: list[str] = []
    files = {str(METRIC / name): name for name in STAGES}

    def profile(frame, event, arg):
        if event == "call":
            name = files.get(frame.f_code.co_filename)
            if name is not None and (not entered or entered[-1] != name):
                entered.append(name)

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return entered


def assert_one_direction(entered: list[str]) -> None:
    order = [STAGES.index(name) for name in entered]
    assert order == sorted(set(order)), f"stages entered: {entered} (each once, in the order {STAGES})"


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


@pytest.mark.parametrize("metric", [tm.GRPOMetric, tm.GSPOMetric, tm.CISPOMetric, tm.PPOMetric])
def test_grpo_family_enters_each_stage_once_in_order(metric):
    inputs, outputs, keywords = grpo_call()
    instance = metric(top_k_kl=2, position_buckets=[0, 3, 6])
    entered = stages_entered(lambda: instance.accumulate(inputs, outputs, **keywords))
    assert entered == STAGES[:3] + ["packed.py"], entered
    assert_one_direction(entered)


def test_token_metrics_and_sequence_metrics_each_enter_once():
    generator = torch.Generator().manual_seed(3)
    labels = torch.randint(0, 16, (2, 4), generator=generator)
    calls = {
        tm.Accuracy(position_buckets=[0, 2, 4]): ({"labels": labels}, {"logits": torch.randn(2, 4, 16)}, {}),
        tm.TokenStatsMetric(): ([{"labels": labels}] * 2, {"logits": [torch.randn(2, 4, 16)] * 2}, {}),
        tm.DPOMetric(): ({"labels": labels}, {"logps": -torch.rand(2, 4)}, {"ref_logps": -torch.rand(2, 4)}),
        tm.LossMetric(position_buckets=[0, 2, 4]): ([{"labels": labels}] * 2, {"loss": [torch.rand(2, 4)] * 2}, {}),
        tm.PPOValueMetric(): ({"labels": labels}, {"values": torch.rand(2, 4)},
                              {"old_values": [0.5, 0.1], "returns": [[1.0, 2.0, 3.0, 4.0], [1.0] * 4]}),
    }
    for metric, (inputs, outputs, keywords) in calls.items():
        entered = stages_entered(lambda m=metric, i=inputs, o=outputs, k=keywords: m.accumulate(i, o, **k))
        assert_one_direction(entered)
        assert entered[0] == "microbatches.py" and "context_parallel.py" in entered, (type(metric).__name__, entered)


def test_a_collection_builds_the_views_once_for_the_metrics_that_read_the_same():
    """The collection's one SharedCall builds the views of each spec once (GRPO and PPO declare one spec,
    Accuracy another), and PPO reads GRPO's views with the same results as GRPO alone."""
    inputs, outputs, keywords = grpo_call()
    built = []
    original = shared_call.microbatch_views

    def counting(*args, **kwargs):
        built.append(args[3].metric)
        return original(*args, **kwargs)

    # PPO's policy side reports GRPO's keys with the same values (GSPO's and CISPO's clip rates differ).
    collection = tm.MetricCollection([tm.GRPOMetric(), tm.PPOMetric(), tm.Accuracy(), tm.TokenStatsMetric()])
    shared_call.microbatch_views = counting
    try:
        collection.accumulate(inputs, {**outputs, "logits": [torch.randn(2, 6, 50)] * 2}, **keywords)
    finally:
        shared_call.microbatch_views = original
    assert built == ["GRPOMetric", "Accuracy"], built
    results = collection.calculate()
    alone = tm.GRPOMetric()
    alone.accumulate(inputs, {**outputs, "logits": [torch.randn(2, 6, 50)] * 2}, **keywords)
    expected = alone.calculate()
    for key in ("train/approx_kl", "train/clip_ratio", "train/mean_old_logp"):
        assert math.isclose(results[key], expected[key], rel_tol=1e-12), key


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
        entered = stages_entered(lambda m=metric, i=inputs: m.accumulate(i, {"logps": logps}, old_logps=old,
                                                                         advantages=advantages))
        assert_one_direction(entered)
        assert "sequences.py" in entered and "context_parallel.py" in entered, entered
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
