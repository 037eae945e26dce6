"""Updates held back until the states are read (metric/state/pending.py): Python numbers cost no op per call, values
that count only when finite one copy; the same results as the updates applied one by one, in any order of updates,
across a sync, a checkpoint and a reset."""

from __future__ import annotations

import math
import random

import pytest
import torch
from kit.op_counts import CountOps

import twinkle_megatron as tm
from twinkle_megatron.metric.state.base import Metric
from twinkle_megatron.metric.state.pending import PENDING_ROWS
from twinkle_megatron.testing.guards import forbid_host_sync


class Updates(Metric):
    """A metric whose states see every kind of update, in the order a test gives."""

    def __init__(self) -> None:
        super().__init__()
        self.add_state("total", "sum")
        self.add_state("vector", "sum", shape=(3,))
        self.add_state("largest", "max")
        self.add_state("latest", "max")
        self.add_state("weight", "sum")
        self.add_state("nonfinite", "sum")

    def accumulate(self, inputs, outputs, **kwargs) -> None:
        for kind, name, value in kwargs["updates"]:
            if kind == "finite":  # a row: value counts in `name` and 1 in `weight` when both are finite
                self._add_finite({name: value[0], "weight": value[1]}, "nonfinite")
            else:
                {"add": self._add, "max": self._maximum, "assign": self._assign}[kind](name, value)

    def compute(self, states):
        return {name: states[name].tolist() if isinstance(states[name], torch.Tensor) else states[name]
                for name in ("total", "vector", "largest", "latest", "weight", "nonfinite")}


def _random_updates(seed: int, as_tensors: bool) -> list:
    rng = random.Random(seed)
    updates = []
    for _ in range(40):
        kind, name = rng.choice([("add", "total"), ("add", "vector"), ("max", "largest"), ("assign", "latest"),
                                 ("add", "latest"), ("max", "total"), ("assign", "total")])
        value = [rng.uniform(-2, 2) for _ in range(3)] if name == "vector" else rng.uniform(-2, 2)
        host = rng.random() < 0.6  # mixed: some updates on the host, some on the device, in one order
        updates.append((kind, name, torch.tensor(value, dtype=torch.float64) if as_tensors or not host else value))
    return updates


def test_host_and_device_updates_in_any_order_equal_device_updates_alone():
    for seed in range(20):
        mixed, device = Updates(), Updates()
        mixed.accumulate(None, None, updates=_random_updates(seed, as_tensors=False))
        device.accumulate(None, None, updates=_random_updates(seed, as_tensors=True))
        results, expected = mixed.calculate(), device.calculate()
        # Host additions associate differently ((a + b) + state): float64 rounding only.
        assert torch.allclose(torch.tensor([results[k] for k in ("total", "largest", "latest")] + results["vector"]),
                              torch.tensor([expected[k] for k in ("total", "largest", "latest")] + expected["vector"]),
                              rtol=1e-12, atol=1e-12), seed


def _rows_among_updates(seed: int, count: int) -> list:
    """Rows of values that count only when finite (some NaN or Inf, some Python numbers, some tensors) among
    every other kind of update of the same states, host and device, in a random order."""
    rng = random.Random(seed)
    updates = []
    for _ in range(count):
        kind, name = rng.choice([("finite", "total"), ("finite", "latest"), ("add", "total"), ("max", "total"),
                                 ("assign", "total"), ("add", "latest"), ("max", "latest"), ("assign", "latest"),
                                 ("add", "weight"), ("finite", "total"), ("finite", "total")])
        if kind == "finite":
            value = [rng.choice([rng.uniform(-2, 2)] * 8 + [math.nan, math.inf]), float(rng.randint(0, 9))]
            value = [torch.tensor(v, dtype=rng.choice([torch.float32, torch.float64])) if rng.random() < 0.7 else v
                     for v in value]
        else:
            value = rng.uniform(-2, 2)
            value = torch.tensor(value, dtype=torch.float64) if rng.random() < 0.4 else value
        updates.append((kind, name, value))
    return updates


def _applied_one_by_one(updates: list) -> dict:
    """The updates applied in order to Python floats: the reference for what the mechanism holds back."""
    states = {"total": 0.0, "latest": float("-inf"), "weight": 0.0, "nonfinite": 0.0}
    for kind, name, value in updates:
        if kind == "finite":
            value, weight = (float(v) for v in value)
            if math.isfinite(value) and math.isfinite(weight):
                states[name] += value
                states["weight"] += weight
            else:
                states["nonfinite"] += 1
        elif kind == "add":
            states[name] += float(value)
        elif kind == "max":
            states[name] = max(states[name], float(value))
        else:
            states[name] = float(value)
    return states


def test_rows_that_count_only_when_finite_among_other_updates_equal_the_updates_one_by_one():
    """Rows pend past the bound (PENDING_ROWS per set of states) and fold before an update that does not commute
    with them; a row's float32 tensors are copied, so changing them in place after the call changes nothing."""
    for seed in range(12):
        updates = _rows_among_updates(seed, 3 * PENDING_ROWS)
        expected = _applied_one_by_one(updates)
        metric = Updates()
        for update in updates:
            metric.accumulate(None, None, updates=[update])
            if update[0] == "finite":
                for value in update[2]:
                    if isinstance(value, torch.Tensor):
                        value.fill_(123.0)  # the caller reuses its buffer
        results = metric.calculate()
        for name in ("total", "latest", "weight", "nonfinite"):
            assert results[name] == pytest.approx(expected[name], rel=1e-6, abs=1e-6), (seed, name)


def test_a_row_costs_one_copy_per_tensor_and_its_check_waits_for_the_read():
    metric = Updates()
    row = [("finite", "total", [torch.tensor(2.0), torch.tensor(3.0)])]
    metric.accumulate(None, None, updates=row)
    with forbid_host_sync(), CountOps() as counted:
        metric.accumulate(None, None, updates=row)
    assert counted.launches == counted.ops["aten::_to_copy"] == 2, counted.ops
    metric.accumulate(None, None, updates=[("finite", "total", [torch.tensor(math.nan), 1.0])])
    results = metric.calculate()
    assert (results["total"], results["weight"], results["nonfinite"]) == (4.0, 6.0, 1.0), results


def _twinkle_call(metrics: tm.MetricCollection, loss) -> None:
    metrics.accumulate({}, {"loss": loss, "num_tokens": 4}, loss_reduction="sum", lr=[1e-4, 2e-5], step=8,
                       grad_norm=0.5, rewards={"format": [1.0, 0.0, float("nan")], "score": [0.5, 0.25]},
                       completion_lengths=[10, 20, 30], generate_time=2.0)


def _collection() -> tm.MetricCollection:
    return tm.MetricCollection([tm.LossMetric(), tm.TrainMetric(), tm.CompletionRewardMetric()])


def test_twinkles_host_values_cost_no_op_and_equal_the_same_values_as_tensors():
    host, device = _collection(), _collection()
    launches = []
    for loss in (6.0, float("inf"), 2.0):
        with CountOps() as counted:
            _twinkle_call(host, loss)
        launches.append(counted.launches)
        device.accumulate({}, {"loss": torch.tensor(loss), "num_tokens": torch.tensor(4)}, loss_reduction="sum",
                          lr=torch.tensor([1e-4, 2e-5], dtype=torch.float64), step=8, grad_norm=torch.tensor(0.5),
                          rewards={"format": torch.tensor([1.0, 0.0, math.nan]), "score": torch.tensor([0.5, 0.25])},
                          completion_lengths=torch.tensor([10, 20, 30]), generate_time=2.0)
    # The first call writes the reward names into their states (each new name once); the calls after it, none.
    assert launches[1:] == [0, 0], launches
    results, expected = host.calculate(), device.calculate()
    timings = ("total time elapse", "speed")
    assert {k: v for k, v in results.items() if k not in timings} == {k: v for k, v in expected.items()
                                                                       if k not in timings}
    assert results["loss"] == 1.0 and results["nonfinite_losses"] == 1
    assert results["train/format_nonfinite_rewards"] == 3 and results["learning rate(param group 2)"] == 2e-5


def test_a_checkpoint_holds_the_pending_values_and_a_reset_or_a_load_drops_them():
    metrics = _collection()
    _twinkle_call(metrics, 6.0)
    saved = metrics.state_dict()  # collective, folds what is pending
    resumed = _collection()
    _twinkle_call(resumed, 100.0)  # pending, then superseded by the load
    resumed.load_state_dict(saved)
    assert resumed.calculate()["loss"] == 1.5 == metrics.calculate()["loss"]
    _twinkle_call(metrics, 100.0)
    metrics.reset()
    after_reset = metrics.calculate()
    assert "loss" not in after_reset and not any(key.startswith("train/") for key in after_reset), after_reset
