"""A microbatch's sums and maxima folded into their states together (``Metric._add_token_sums``,
``_maximum_token_values``): the same states as one update per state, in a fixed number of ops."""

from __future__ import annotations

import pytest
import test_grpo as grpo_cases
import torch
from kit.distributed import Layout
from kit.guards import forbid_host_sync
from kit.invariance import assert_layout_invariant
from test_accumulate_ops import CountOps

import twinkle_megatron as tm

NAMES = tuple(f"s{index}" for index in range(12))


class ManySums(tm.Metric):
    """A user-built metric with twelve per-token sums and two maxima, per group and position bucket too."""

    reports_positions = True

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        for name in NAMES:
            self.add_state(name, "sum", grouped=True)
        self.add_state("count", "sum")
        self.add_state("high", "max", grouped=True)
        self.add_state("low", "max", grouped=True)

    def add_together(self, values, valid, groups, count):
        self._add_token_sums(dict(zip(NAMES, values)), valid, groups, {"count": count})
        self._maximum_token_values({"high": values[0], "low": -values[1]}, valid, groups)

    def add_one_by_one(self, values, valid, groups, count):
        for name, value in zip(NAMES, values):
            self._add_token_sums({name: torch.where(valid, value.to(torch.float64), 0.0)}, groups=groups)
        self._add("count", count)
        self._maximum_token_values({"high": torch.where(valid, values[0].to(torch.float64), float("-inf"))}, None,
                                   groups)
        self._maximum_token_values({"low": torch.where(valid, -values[1].to(torch.float64), float("-inf"))}, None,
                                   groups)

    def slices(self, shape):
        ids = torch.arange(shape[0]) % 3 - int(shape[0] == 4)  # one id out of range when there are four rows
        positions = torch.arange(shape[1])
        return self._token_groups(ids, torch.ones(shape, dtype=torch.bool), torch.ones(shape, dtype=torch.bool),
                                  positions)


def values_with_poison(shape, seed):
    """Twelve per-token tensors (floats of two precisions and bool counts) with NaN and Inf outside ``valid``."""
    generator = torch.Generator().manual_seed(seed)
    valid = torch.rand(shape, generator=generator) > 0.3
    values = []
    for index in range(len(NAMES)):
        if index % 4 == 3:
            values.append(valid & (torch.rand(shape, generator=generator) > 0.5))
        else:
            value = torch.randn(shape, generator=generator, dtype=torch.float64 if index % 2 else torch.float32)
            values.append(torch.where(valid, value, float("nan") if index % 3 else float("inf")))
    return values, valid


@pytest.mark.parametrize("shape", [(4, 16), (3, 5)])
def test_together_equals_one_by_one_and_nothing_outside_valid_leaks(shape):
    metrics = [ManySums(group_names=["a", "b", "c"], position_buckets=[0, 2, 5]) for _ in range(2)]
    for seed in range(3):
        values, valid = values_with_poison(shape, seed)
        count = (~valid).sum()
        metrics[0].add_together(values, valid, metrics[0].slices(shape), count)
        metrics[1].add_one_by_one(values, valid, metrics[1].slices(shape), count)
    together, one_by_one = (metric._states for metric in metrics)
    assert together.keys() == one_by_one.keys()
    for name in together:
        assert not torch.isnan(together[name]).any(), name  # maxima of empty slices are -inf, never NaN
        torch.testing.assert_close(together[name], one_by_one[name], rtol=1e-12, atol=1e-12, msg=name)


def test_the_ops_do_not_grow_with_the_number_of_sums():
    counts = []
    for k in (2, 6, 12):
        metric = ManySums(group_names=["a", "b", "c"], position_buckets=[0, 2, 5])
        values, valid = values_with_poison((4, 16), 0)
        groups = metric.slices((4, 16))
        sums = dict(zip(NAMES[:k], values[:k]))
        metric._add_token_sums(sums, valid, groups)  # states settled
        with forbid_host_sync(), CountOps() as counted:
            metric._add_token_sums(sums, valid, groups, {"count": (~valid).sum()})
        counts.append(counted.launches)
        assert counted.ops["aten::_foreach_add_"] == 1
    # stack, mask, reduction, one add for all; per partition a mask, zeros and one index_add (no row sum: groups
    # are per row, and position buckets of padded rows add up the rows first).
    assert counts == [counts[0]] * 3, counts


def test_maxima_of_an_empty_microbatch_leave_the_states_alone():
    metric = ManySums()
    metric._maximum_token_values({"high": torch.ones(2, 3), "low": torch.ones(2, 3)}, None, None)
    metric._maximum_token_values({"high": torch.empty(0, 3), "low": torch.empty(0, 3)}, None, None)
    assert metric._states["high"] == 1.0 and metric._states["low"] == 1.0


def test_states_follow_the_device_of_the_data_and_stay_float64():
    metric = ManySums()
    metric._add_token_sums({"s0": torch.ones(2, 2, dtype=torch.float32), "s1": torch.ones(2, 2, dtype=torch.bool)},
                           None, None, {"count": torch.tensor(3)})
    assert {state.dtype for state in metric._states.values()} == {torch.float64}
    assert (metric._states["s0"], metric._states["s1"], metric._states["count"]) == (4.0, 4.0, 3.0)


def rl_microbatches(seed: int):
    """Two microbatches with groups, a rollout's log-probs, Twinkle's ragged old log-probs and advantages."""
    generator = torch.Generator().manual_seed(seed)
    inputs, logps, entropies, old, rollout = [], [], [], [], []
    for _ in range(2):
        labels = torch.randint(0, 50, (3, 12), generator=generator)
        labels[:, :3] = -100
        inputs.append({"labels": labels, "dataset_id": torch.randint(0, 2, (3,), generator=generator)})
        logps.append(-torch.rand(3, 12, generator=generator) * 3)
        entropies.append(torch.rand(3, 12, generator=generator))
        rollout.append(logps[-1] + 0.3 * torch.randn(3, 12, generator=generator))
        old += [(row[keep] + 0.2 * torch.randn(int(keep.sum()), generator=generator)).tolist()
                for row, keep in zip(logps[-1], labels >= 0)]
    outputs = {"logps": logps, "entropies": entropies}
    kwargs = {"old_logps": old, "advantages": torch.randn(6, generator=generator).tolist(), "rollout_logps": rollout}
    return inputs, outputs, kwargs


FAMILY = ("GRPOMetric", "GSPOMetric", "CISPOMetric", "PPOMetric")


def family(**options):
    return [getattr(tm, name)(group_names=["a", "b"], position_buckets=[0, 6, 12], top_k_kl=3, **options)
            for name in FAMILY]


def test_the_family_in_one_collection_equals_each_metric_alone():
    together, alone = tm.MetricCollection(family()), family()
    for seed in range(2):
        call = rl_microbatches(seed)
        together.accumulate(call[0], call[1], **call[2])
        for metric in alone:
            metric.accumulate(call[0], call[1], **call[2])
    # The family's metrics report the same keys (a collection refuses two different values for one), so their
    # states are compared: every sum, maximum and per-slice twin, and the top-K records.
    for shared, own in zip(together.metrics, alone):
        shared_state, own_state = shared.state_dict(), own.state_dict()
        for name, value in own_state.pop("states").items():
            torch.testing.assert_close(shared_state["states"][name], value, rtol=1e-12, atol=0, msg=name)
        assert own_state and {k: v for k, v in shared_state.items() if k != "states"} == own_state


def test_the_family_shares_its_terms_only_when_they_are_the_same(monkeypatch):
    computed = []
    terms = tm.GRPOMetric._token_terms
    monkeypatch.setattr(tm.GRPOMetric, "_token_terms", lambda self, *args: computed.append(self) or terms(self, *args))
    call = rl_microbatches(0)
    tm.MetricCollection(family()).accumulate(call[0], call[1], **call[2])
    assert len(computed) == 2  # once per microbatch for the four metrics
    computed.clear()
    # Another temperature scales the log-probs: its terms are its own, and its results are the ones it has alone.
    hot, alone = tm.GRPOMetric(temperature=2.0), tm.GRPOMetric(temperature=2.0)
    tm.MetricCollection([tm.GRPOMetric(), hot]).accumulate(call[0], call[1], **call[2])
    assert len(computed) == 4
    alone.accumulate(call[0], call[1], **call[2])
    assert hot.calculate() == pytest.approx(alone.calculate(), rel=1e-12)


@pytest.mark.parametrize("layout", [Layout(tp=2, pp=2, dp=2), Layout(cp=2, dp=2)], ids=str)
def test_grpo_and_ppo_sharing_their_terms_give_the_single_process_result(layout):
    """GRPO and PPO (the same keys, the same values) in one collection on every layout: GRPO's reference, and
    the TP collectives of one entropy pass."""
    expected = grpo_cases.reference("grpo")
    options = {"epsilon": grpo_cases.EPSILON, "epsilon_high": grpo_cases.EPSILON_HIGH, "top_k_kl": grpo_cases.TOP_K,
               "vocab_size": grpo_cases.VOCAB}
    assert_layout_invariant(
        lambda variant: tm.MetricCollection([tm.GRPOMetric(**options), tm.PPOMetric(**options)]),
        grpo_cases.global_batch(), [layout], feed=grpo_cases.feed_last_stage,
        variants=[("grpo", count, as_list) for count, as_list in ((1, True), (2, True), (2, False))],
        expected=lambda *_: expected, rel=1e-5, rel_for={"_high_kl_records": 1e-12},
        accumulate_collectives=grpo_cases.accumulate_collectives)
