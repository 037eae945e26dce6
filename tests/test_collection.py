"""MetricCollection: one sync for many metrics, no host sync in accumulate, no hangs."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from twinkle_megatron import LossMetric, Metric, MetricCollection, TrainMetric
from twinkle_megatron.metric.inputs.microbatches import microbatches
from twinkle_megatron.metric.inputs.tensors import token_mask
from twinkle_megatron.testing.batches import RankView
from twinkle_megatron.testing.distributed import Layout, run_distributed
from twinkle_megatron.testing.guards import HostSyncError, count_collectives, forbid_host_sync
from twinkle_megatron.testing.invariance import Call, assert_layout_invariant


class LabelRange(Metric):
    """A user-written metric: token count (sum), largest and smallest label (max, min)."""

    def __init__(self, device_mesh=None, process_group=None, prefix="", **kwargs):
        super().__init__(device_mesh, process_group, **kwargs)
        self.prefix = prefix
        self.add_state("tokens", "sum")
        self.add_state("largest", "max")
        self.add_state("smallest", "min")
        self.add_state("histogram", "sum", shape=(4,))

    def accumulate(self, inputs, outputs=None, **kwargs):
        for batch, _ in microbatches(inputs, outputs, ()):
            labels = batch["labels"]
            mask = token_mask(labels)
            self._add("tokens", mask.sum())
            self._maximum("largest", torch.where(mask, labels, torch.iinfo(labels.dtype).min).max())
            self._minimum("smallest", torch.where(mask, labels, torch.iinfo(labels.dtype).max).min())
            # A histogram without a host sync: weighted index_add (bincount(labels[mask]) would sync twice).
            histogram = torch.zeros(4, dtype=torch.float64, device=labels.device)
            self._add("histogram", histogram.index_add_(0, (labels % 4).reshape(-1), mask.reshape(-1).double()))

    def compute(self, states):
        if states["tokens"] == 0:
            return {}
        results = {"tokens": int(states["tokens"]), "largest": states["largest"], "smallest": states["smallest"],
                   "histogram": [int(x) for x in states["histogram"]]}
        return {self.prefix + key: value for key, value in results.items()}


def make_collection() -> MetricCollection:
    return MetricCollection({
        "loss": LossMetric(loss_reduction="sum"),
        "train": TrainMetric(),
        "labels": LabelRange(),
        "labels_b": LabelRange(prefix="b/"),
        "labels_c": LabelRange(prefix="c/"),
    })


def local_batch(rank: int) -> tuple[list, dict]:
    labels = torch.arange(12).reshape(2, 6) + 100 * rank
    labels[:, 0] = -100
    inputs = [{"labels": labels[:1]}, {"labels": labels[1:]}]
    outputs = {"loss": [torch.tensor(5.0), torch.tensor(5.0)], "lr": 1e-4, "step": 4, "grad_norm": 0.5}
    return inputs, outputs


def feed_dp_rank(collection: MetricCollection, _, view: RankView, skip_earlier_stages: bool) -> list[Call]:
    """Each DP rank its own batch, on the last stage only or on every stage (whose duplicates must not count)."""
    if skip_earlier_stages and not view.last_stage:
        return []
    return [Call(*local_batch(view.dp_rank))]


@pytest.mark.parametrize("skip_earlier_stages", [True, False])
def test_collection_of_five_metrics_costs_two_collectives(skip_earlier_stages):
    # Two DP ranks, each 10 tokens in two microbatches with loss sum 5 each: loss = 20 / 20.
    labels = {"tokens": 20, "largest": 111, "smallest": 1, "histogram": [4, 6, 4, 6]}  # labels 1..5, 7..11 (mod 4)
    expected = {"loss": 1.0, "grad_norm": 0.5, "iters": 4, "learning rate": 1e-4,
                **{prefix + key: value for prefix in ("", "b/", "c/") for key, value in labels.items()}}
    # Timings are max over ranks, so even they agree exactly on every rank.
    assert_layout_invariant(lambda _: make_collection(), None, [Layout(tp=2, pp=2, dp=2)], feed=feed_dp_rank,
                            variants=[skip_earlier_stages], expected=expected, rel=0,
                            ignore=("total time elapse", "speed"), calculate_collectives={"all_reduce": 2})


def test_accumulate_never_syncs_with_the_host():
    collection = make_collection()
    inputs, outputs = local_batch(0)
    with forbid_host_sync():
        collection.accumulate(inputs, outputs)
        with pytest.raises(HostSyncError):
            torch.ones(()).item()  # the guard itself works
    assert collection.calculate()["tokens"] == 10


def _nobody_accumulates() -> tuple[dict, dict]:
    collection = make_collection()
    with count_collectives() as counts:
        results = collection.calculate()
    return results, dict(counts)


def test_no_data_anywhere_gives_empty_results_without_hanging():
    results = run_distributed(_nobody_accumulates, layout=Layout(pp=2, dp=2), timeout=30)
    assert all(r == ({}, {"all_reduce": 2}) for r in results)


def test_single_process_issues_no_collective_and_metrics_reset():
    collection = make_collection()
    inputs, outputs = local_batch(0)
    collection.accumulate(inputs, outputs)
    with count_collectives() as counts:
        first = collection.calculate()
    assert not counts and first["tokens"] == 10
    second = collection.calculate()
    assert "tokens" not in second and "loss" not in second


def _mismatched_groups():
    group = dist.new_group([0, 1])
    collection = MetricCollection([LossMetric(), LossMetric(process_group=group)])
    collection.calculate()


def test_metrics_with_different_reduction_groups_are_refused():
    with pytest.raises(AssertionError, match="reduces over a different process group"):
        run_distributed(_mismatched_groups, 2)


def test_two_metrics_reporting_the_same_key_are_refused():
    collection = MetricCollection([LossMetric(), LossMetric(loss_reduction="sum")])
    collection.accumulate({}, {"loss": 1.0, "num_tokens": 2})  # mean 1.0 against per-token 0.5
    with pytest.raises(ValueError, match=r"reports 'loss', which LossMetric reports too"):
        collection.calculate()


def test_state_spec_validation():
    metric = LabelRange()
    with pytest.raises(ValueError, match="reduce must be one of"):
        metric.add_state("bad", "mean")


def test_whole_batch_outputs_concatenate_microbatch_inputs():
    inputs = [{"labels": torch.ones(1, 3, dtype=torch.long)}, {"labels": torch.ones(2, 3, dtype=torch.long)}]
    pairs = microbatches(inputs, {"logits": torch.zeros(3, 3, 5)}, ("logits",))
    assert len(pairs) == 1 and pairs[0][0]["labels"].shape == (3, 3)
    with pytest.raises(ValueError, match="mix per-microbatch lists"):
        microbatches(inputs, {"logits": torch.zeros(3, 3, 5), "loss": [1.0, 2.0]}, ("logits", "loss"))
    ragged = microbatches([{"labels": torch.ones(1, 3)}, {"labels": torch.ones(1, 4)}], {"loss": 1.0}, ("loss",))
    with pytest.raises(ValueError, match="differ beyond the batch dimension"):
        ragged[0][0]["labels"]  # concatenated only when read


def test_whole_batch_loss_over_microbatches_padded_to_different_lengths():
    inputs = [{"input_ids": torch.ones(2, 5), "labels": torch.ones(2, 5, dtype=torch.long)},
              {"input_ids": torch.ones(2, 7), "labels": torch.full((2, 7), -100)}]
    mean = LossMetric()
    mean.accumulate(inputs, {"loss": torch.tensor(0.5)})
    assert mean.calculate() == {"loss": 0.5}
    per_token = LossMetric(loss_reduction="sum")
    per_token.accumulate(inputs, {"loss": torch.tensor(5.0)})  # 10 real tokens, counted per microbatch
    assert per_token.calculate() == {"loss": 0.5}


class RankRecords(Metric):
    """Reports objects rather than numbers: costs one extra collective, only when enabled."""

    def __init__(self, enabled, **kwargs):
        super().__init__(**kwargs)
        self.enabled = enabled
        self.add_state("calls", "sum")

    def accumulate(self, inputs, outputs, **kwargs):
        self._add("calls", 1)

    def sync_records(self):
        return [("rank", dist.get_rank())] if self.enabled else None

    def compute(self, states):
        return {"records": list(states.records)} if self.enabled else {"calls": int(states["calls"])}


def _records(enabled: bool) -> tuple[dict, dict]:
    from megatron.core import parallel_state as ps

    collection = MetricCollection([LossMetric(), RankRecords(enabled)])
    if ps.is_pipeline_last_stage():
        collection.accumulate({}, {"loss": 1.0})
    with count_collectives() as counts:
        results = collection.calculate()
    return results, dict(counts)


def test_object_records_cost_one_collective_only_when_enabled():
    results = run_distributed(_records, layout=Layout(tp=2, pp=2), args=(True,))
    for result, counts in results:
        assert counts == {"all_reduce": 2, "all_gather": 2}  # one all_gather_object: sizes, then bytes
        assert result["records"] == [("rank", 2)], "only the last stage's TP rank 0 counts"
    results = run_distributed(_records, layout=Layout(tp=2, pp=2), args=(False,))
    assert all(counts == {"all_reduce": 2} and result["calls"] == 1 for result, counts in results)
