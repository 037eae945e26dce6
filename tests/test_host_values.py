"""Python numbers are added on the host until the states are read (metric/host_values.py): no op per call, and
the same results as the same values given as tensors, in any order of updates, across a sync, a checkpoint and a
reset."""

from __future__ import annotations

import math
import random

import torch
from kit.op_counts import CountOps

import twinkle_megatron as tm
from twinkle_megatron.metric.base import Metric


class Updates(Metric):
    """A metric whose states see every kind of update, in the order a test gives."""

    def __init__(self) -> None:
        super().__init__()
        self.add_state("total", "sum")
        self.add_state("vector", "sum", shape=(3,))
        self.add_state("largest", "max")
        self.add_state("latest", "max")
        self.add_state("nonfinite", "sum")

    def accumulate(self, inputs, outputs, **kwargs) -> None:
        for kind, name, value in kwargs["updates"]:
            {"add": self._add, "max": self._maximum, "assign": self._assign}[kind](name, value)

    def compute(self, states):
        return {name: states[name].tolist() if isinstance(states[name], torch.Tensor) else states[name]
                for name in ("total", "vector", "largest", "latest")}


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


# The first of the calls below: its two new reward names' states made and the host values read into them once
# (a fill, two copies of the values, the running maximum and minimum, the count of non-finite values).
FIRST_CALL_LAUNCHES = 8


def _twinkle_call(metrics: tm.MetricCollection, loss) -> None:
    metrics.accumulate({}, {"loss": loss, "num_tokens": 4}, loss_reduction="sum", lr=[1e-4, 2e-5], step=8,
                       grad_norm=0.5, rewards={"format": [1.0, 0.0, float("nan")], "score": [0.5, 0.25]},
                       completion_lengths=[10, 20, 30], generate_time=2.0)


def _collection() -> tm.MetricCollection:
    return tm.MetricCollection([tm.LossMetric(), tm.TrainMetric(), tm.CompletionRewardMetric()])


def test_twinkles_host_values_cost_no_op_and_equal_the_same_values_as_tensors():
    host, device = _collection(), _collection()
    for call, loss in enumerate((6.0, float("inf"), 2.0)):
        with CountOps() as counted:
            _twinkle_call(host, loss)
        # The first call folds the reward names into their states (each new name once): a few ops, then none.
        assert counted.launches == (FIRST_CALL_LAUNCHES if call == 0 else 0), (call, counted.ops)
        device.accumulate({}, {"loss": torch.tensor(loss), "num_tokens": torch.tensor(4)}, loss_reduction="sum",
                          lr=torch.tensor([1e-4, 2e-5], dtype=torch.float64), step=8, grad_norm=torch.tensor(0.5),
                          rewards={"format": torch.tensor([1.0, 0.0, math.nan]), "score": torch.tensor([0.5, 0.25])},
                          completion_lengths=torch.tensor([10, 20, 30]), generate_time=2.0)
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
