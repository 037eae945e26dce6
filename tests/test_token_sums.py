"""A microbatch's sums and maxima applied to their states together (``Metric._add_token_sums``,
``_maximum_token_values``): the states equal a token-by-token float64 reference, in a fixed number of ops."""

from __future__ import annotations

import pytest
import torch
from kit import grpo_cases
from kit.op_counts import CountOps

import twinkle_megatron as tm
from twinkle_megatron.testing.distributed import Layout
from twinkle_megatron.testing.guards import forbid_host_sync
from twinkle_megatron.testing.invariance import assert_layout_invariant

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

    def slices(self, shape):
        return self._token_groups(row_group_ids(shape), torch.ones(shape, dtype=torch.bool),
                                  torch.ones(shape, dtype=torch.bool), torch.arange(shape[1]))


def row_group_ids(shape) -> torch.Tensor:
    """Each row's group id: 0, 1, 2 in turn, shifted down by one (so two rows out of range) when there are four."""
    return torch.arange(shape[0]) % 3 - int(shape[0] == 4)


POSITION_BUCKETS = ((0, 2), (2, 5))  # position_buckets=[0, 2, 5]: [0, 2) and [2, 5); later positions in none


def reference_states(calls: list, shape) -> dict:
    """The states written out token by token in float64, from the values alone: each sum over the valid tokens
    (of all, of each group's rows, of each bucket's columns), each maximum likewise (-inf where none), the counts."""
    ids = row_group_ids(shape)
    slices = {"": torch.ones(shape, dtype=torch.bool)}
    slices.update({f"/groups{g}": (ids == g)[:, None].expand(shape) for g in range(3)})
    columns = torch.arange(shape[1])
    slices.update({f"/positions{b}": ((columns >= lo) & (columns < hi))[None, :].expand(shape)
                   for b, (lo, hi) in enumerate(POSITION_BUCKETS)})
    per_token = {name: [] for name in (*NAMES, "high", "low")}
    valids = []
    for values, valid in calls:
        valids.append(valid)
        for name, value in zip(NAMES, values):
            per_token[name].append(value.to(torch.float64))
        per_token["high"].append(values[0].to(torch.float64))
        per_token["low"].append(-values[1].to(torch.float64))
    expected = {"count": torch.tensor(float(sum(int((~valid).sum()) for valid in valids)), dtype=torch.float64),
                "invalid_group_ids": torch.tensor(float(len(calls) * int((ids < 0).sum()) * shape[1]),
                                                  dtype=torch.float64)}
    for name, tensors in per_token.items():
        for suffix, where in slices.items():
            picked = [value[valid & where] for value, valid in zip(tensors, valids)]
            every = torch.cat(picked)
            if name in NAMES:
                total = every.sum() if every.numel() else torch.tensor(0.0, dtype=torch.float64)
            else:
                total = every.max() if every.numel() else torch.tensor(float("-inf"), dtype=torch.float64)
            key, index = (name + suffix[:-1], int(suffix[-1])) if suffix else (name, None)
            if index is None:
                expected[key] = total
            else:
                expected.setdefault(key, []).append(total)
    return {key: torch.stack(value) if isinstance(value, list) else value for key, value in expected.items()}


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
def test_the_states_equal_a_token_by_token_reference_and_nothing_outside_valid_leaks(shape):
    metric = ManySums(group_names=["a", "b", "c"], position_buckets=[0, 2, 5])
    calls = [values_with_poison(shape, seed) for seed in range(3)]
    for values, valid in calls:
        metric.add_together(values, valid, metric.slices(shape), (~valid).sum())
    expected = reference_states(calls, shape)
    assert metric._states.keys() == expected.keys()
    for name, state in metric._states.items():
        assert not torch.isnan(state).any(), name  # maxima of empty slices are -inf, never NaN
        torch.testing.assert_close(state, expected[name], rtol=1e-12, atol=1e-12, msg=name)


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
