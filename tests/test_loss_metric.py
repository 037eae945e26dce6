"""LossMetric: layout invariance against a single-process reference, and bad input."""

from __future__ import annotations

import math

import pytest
import torch

from twinkle_megatron import LossMetric, MetricCollection, ParallelContext
from twinkle_megatron.testing.batches import RankView, split_microbatches
from twinkle_megatron.testing.distributed import Layout, run_distributed
from twinkle_megatron.testing.invariance import Call, assert_layout_invariant

GLOBAL_BATCH, SEQ = 8, 12
LAYOUTS = [
    Layout(),
    Layout(tp=2),
    Layout(tp=2, pp=2),
    Layout(cp=2, dp=2),
    Layout(tp=2, pp=2, dp=2),
]


def global_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token losses and labels (about a quarter ignored) of the whole global batch."""
    generator = torch.Generator().manual_seed(seed)
    losses = torch.rand(GLOBAL_BATCH, SEQ, generator=generator, dtype=torch.float64) * 5
    labels = torch.randint(0, 50, (GLOBAL_BATCH, SEQ), generator=generator)
    labels[torch.rand(GLOBAL_BATCH, SEQ, generator=generator) < 0.25] = -100
    return losses.float(), labels


def reference_loss() -> float:
    losses, labels = global_batch()
    mask = labels != -100
    return float(losses.double()[mask].sum() / mask.sum())


def feed_megatron_style(metric: LossMetric, batch: tuple, view: RankView, variant: tuple) -> list[Call]:
    """Every last-stage rank passes its local loss sums; earlier stages never accumulate."""
    num_microbatches, as_list, per_token = variant
    if not view.last_stage:
        return []
    losses, labels = (view.tokens(t) for t in batch)
    loss_mbs, label_mbs = split_microbatches(losses, num_microbatches), split_microbatches(labels, num_microbatches)
    inputs = [{"labels": labels} for labels in label_mbs]
    if per_token:
        outputs = {"loss": loss_mbs if as_list else losses}
    else:
        sums = [(loss * (labels != -100)).sum() for loss, labels in zip(loss_mbs, label_mbs)]
        outputs = {"loss": sums if as_list else sum(sums)}
    outputs["grad_norm"] = torch.tensor(1.5 + view.dp_rank)
    return [Call(inputs, outputs)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_loss_sum_matches_single_process_reference(layout):
    assert_layout_invariant(
        lambda _: LossMetric(loss_reduction="sum"), global_batch(), [layout], feed=feed_megatron_style,
        variants=[(1, True, False), (2, True, False), (2, False, False), (1, True, True), (2, True, True)],
        expected=lambda layout, _: {"loss": reference_loss(), "grad_norm": 1.5 + layout.dp - 1}, rel=1e-6)


def test_loss_single_process_plain_call():
    losses, labels = global_batch()
    metric = LossMetric(loss_reduction="sum")
    for loss, label in zip(split_microbatches(losses, 4), split_microbatches(labels, 4)):
        metric.accumulate({"labels": label}, {"loss": (loss * (label != -100)).sum()})
    assert metric.calculate()["loss"] == pytest.approx(reference_loss(), rel=1e-6)
    assert metric.calculate() == {}, "calculate() resets, and no data gives {}"


def feed_twinkle_mean(metric: LossMetric, batch: float, view: RankView, _) -> list[Call]:
    # Twinkle's Megatron model hands every rank the loss already averaged over DP.
    return [Call([{"labels": torch.ones(2, 3, dtype=torch.long)}] * 2, {"loss": [batch, batch]})]


def test_loss_mean_of_an_already_averaged_loss_stays_the_same():
    assert_layout_invariant(lambda _: LossMetric(loss_reduction="mean"), 2.75, [Layout(tp=2, pp=2, dp=2)],
                            feed=feed_twinkle_mean, expected={"loss": 2.75}, rel=0)


def test_loss_mean_weighs_values_equally():
    metric = LossMetric()
    metric.accumulate([{}, {}, {}], {"loss": [1.0, torch.tensor(2.0), torch.tensor([6.0])]})
    assert metric.calculate() == {"loss": 3.0}


def test_num_tokens_from_outputs_or_keyword():
    metric = LossMetric(loss_reduction="sum")
    metric.accumulate({}, {"loss": torch.tensor(6.0), "num_tokens": torch.tensor(3)})
    metric.accumulate({}, {"loss": 4.0}, num_tokens=1)
    assert metric.calculate()["loss"] == pytest.approx(10.0 / 4)


def test_nonfinite_loss_is_counted_not_averaged():
    metric = LossMetric()
    metric.accumulate([{}, {}, {}], {"loss": [1.0, float("nan"), 3.0]})
    assert metric.calculate() == {"loss": 2.0, "nonfinite_losses": 1}
    metric.accumulate({}, {"loss": float("inf")})
    results = metric.calculate()
    assert results.keys() == {"loss", "nonfinite_losses"} and math.isnan(results["loss"]), \
        "every loss non-finite: loss reads NaN (not absent) beside the count"
    assert results["nonfinite_losses"] == 1


def _nan_loss_on_one_rank() -> dict:
    import torch.distributed as dist

    metric = LossMetric()
    loss = float("nan") if dist.get_rank() == 1 else 2.0
    metric.accumulate({}, {"loss": loss})
    return metric.calculate()


def test_nonfinite_loss_on_one_rank_is_reported_on_every_rank():
    results = run_distributed(_nan_loss_on_one_rank, 4)
    assert all(r == {"loss": 2.0, "nonfinite_losses": 1} for r in results)


# ----------------------------------------------------------------- bad input


def test_unknown_loss_reduction():
    with pytest.raises(ValueError, match="loss_reduction must be one of"):
        LossMetric(loss_reduction="avg")


def test_per_token_loss_and_labels_of_different_shapes():
    metric = LossMetric()
    with pytest.raises(ValueError, match=r"loss has shape \(2, 3\) but labels has shape \(2, 4\)"):
        metric.accumulate({"labels": torch.zeros(2, 4, dtype=torch.long)}, {"loss": torch.ones(2, 3)})


def test_outputs_list_and_microbatch_list_of_different_lengths():
    metric = LossMetric()
    with pytest.raises(ValueError, match=r"outputs\['loss'\] has 3 microbatch entries but inputs has 2"):
        metric.accumulate([{}, {}], {"loss": [1.0, 2.0, 3.0]})


def test_sum_reduction_without_any_token_count():
    with pytest.raises(ValueError, match="num_tokens"):
        LossMetric(loss_reduction="sum").accumulate({}, {"loss": 1.0})


def test_state_dict_round_trip_continues_accumulation():
    metric = LossMetric(loss_reduction="sum")
    metric.accumulate({}, {"loss": 6.0, "num_tokens": 3})
    resumed = LossMetric(loss_reduction="sum")
    resumed.load_state_dict(metric.state_dict())
    resumed.accumulate({}, {"loss": 2.0, "num_tokens": 1})
    assert resumed.calculate() == {"loss": 2.0}


def test_collection_state_dict_and_explicit_context():
    collection = MetricCollection({"loss": LossMetric(device_mesh=ParallelContext.single())})
    collection.accumulate({}, {"loss": 1.0})
    restored = MetricCollection([LossMetric()])
    restored.load_state_dict(collection.state_dict())
    assert restored.calculate() == {"loss": 1.0}


# ------------------------------ microbatch reports held back until the states are read (Metric._add_finite)


def test_reports_kept_until_the_sync_equal_the_reference_and_survive_a_change_in_place():
    """Device reports are copied at ``accumulate`` and folded when the states are read, past the bound too:
    the same result as the sum over the reports, whatever the caller does with its tensors afterwards."""
    from twinkle_megatron.metric.state.pending import PENDING_ROWS

    generator = torch.Generator().manual_seed(0)
    count = 2 * PENDING_ROWS + 3
    sums = torch.rand(count, generator=generator, dtype=torch.float64) * 10
    tokens = torch.randint(1, 50, (count,), generator=generator)
    sums[5], sums[PENDING_ROWS + 7] = float("nan"), float("inf")
    metric = LossMetric(loss_reduction="sum")
    for value, n in zip(sums, tokens):
        loss, num_tokens = value.clone(), n.clone()  # float64: copied although it needs no conversion
        metric.accumulate({}, {"loss": loss, "num_tokens": num_tokens})
        loss.mul_(1000.0), num_tokens.add_(7)  # the caller reuses its buffers: the metric holds copies
    finite = torch.isfinite(sums)
    expected = float(sums[finite].sum() / tokens[finite].sum())
    assert metric.calculate() == {"loss": pytest.approx(expected, rel=1e-12), "nonfinite_losses": 2}


def test_reports_kept_until_the_sync_join_checkpoints_and_go_with_a_reset():
    metric = LossMetric()
    metric.accumulate({}, {"loss": torch.tensor(2.0)})
    metric.accumulate({}, {"loss": torch.tensor(4.0)})
    resumed = LossMetric()
    resumed.load_state_dict(metric.state_dict())  # the pending reports are in the checkpoint
    assert resumed.calculate() == {"loss": 3.0}
    metric.reset()
    metric.accumulate({}, {"loss": torch.tensor(5.0)})
    assert metric.calculate() == {"loss": 5.0}, "a reset drops what was pending"
    metric.accumulate({}, {"loss": torch.tensor(9.0)})
    metric.load_state_dict(resumed.state_dict())  # empty: the loaded states replace what was pending
    assert metric.calculate() == {}


def test_reports_of_both_reductions_in_one_window():
    """Means (weight 1, a host number) and sums with device counts pend together: each with its own weight."""
    metric = LossMetric()
    metric.accumulate({}, {"loss": torch.tensor(3.0)})  # a mean: weight 1
    metric.accumulate({}, {"loss": torch.tensor(8.0), "num_tokens": torch.tensor(4)}, loss_reduction="sum")
    metric.accumulate({}, {"loss": torch.tensor(float("nan")), "num_tokens": torch.tensor(9)}, loss_reduction="sum")
    assert metric.calculate() == {"loss": pytest.approx(11.0 / 5), "nonfinite_losses": 1}


def test_a_nonfinite_loss_with_an_invalid_group_id_is_counted_in_both():
    metric = LossMetric(group_names=["a", "b"])
    metric.accumulate({}, {"loss": torch.tensor(float("nan")), "group_ids": 7})
    metric.accumulate({}, {"loss": torch.tensor(2.0), "group_ids": 1})
    assert metric.calculate() == {"loss": 2.0, "loss/b": 2.0, "nonfinite_losses": 1, "invalid_group_ids": 1}
