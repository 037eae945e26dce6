"""TrainMetric: Twinkle's keys with numbers, the same on every rank, resumable."""

from __future__ import annotations

import time

import pytest
import torch

from twinkle_megatron import TrainMetric
from twinkle_megatron.testing.batches import RankView
from twinkle_megatron.testing.distributed import Layout
from twinkle_megatron.testing.invariance import Call, assert_layout_invariant


def test_keys_and_numbers():
    metric = TrainMetric()
    metric.accumulate(None, {"lr": 3e-4, "step": 8, "gradient_accumulation_steps": 4})
    time.sleep(0.05)
    result = metric.calculate()
    assert set(result) == {"learning rate", "iters", "total time elapse", "speed"}
    assert result["learning rate"] == 3e-4 and result["iters"] == 2
    assert result["total time elapse"] >= 0.05
    assert 0 < result["speed"] <= 2 / 0.05
    metric.accumulate(None, {"lr": [1e-3, 2e-4], "step": 16, "gradient_accumulation_steps": 4})
    result = metric.calculate()
    assert result["learning rate(param group 1)"] == 1e-3 and result["learning rate(param group 2)"] == 2e-4
    assert result["iters"] == 4


def test_learning_rates_as_a_tensor():
    metric = TrainMetric()
    metric.accumulate(None, {"lr": torch.tensor([1e-4, 2e-4]), "step": 1})
    result = metric.calculate()
    assert result["learning rate(param group 1)"] == pytest.approx(1e-4)
    assert result["learning rate(param group 2)"] == pytest.approx(2e-4)
    metric.accumulate(None, {"lr": torch.tensor(3e-4), "step": 2})
    assert metric.calculate()["learning rate"] == pytest.approx(3e-4)


def test_too_many_param_groups():
    with pytest.raises(ValueError, match="max_param_groups"):
        TrainMetric(max_param_groups=2).accumulate(None, {"lr": [1.0, 2.0, 3.0]})


def test_resume_continues_elapsed_time_and_steps():
    metric = TrainMetric()
    metric.accumulate(None, {"lr": 1e-3, "step": 10})
    metric.start_time -= 100  # as if the run had been going for 100 s
    state = metric.state_dict()
    resumed = TrainMetric()
    resumed.load_state_dict(state)
    resumed.accumulate(None, {"step": 12})
    result = resumed.calculate()
    assert result["iters"] == 12 and result["total time elapse"] >= 100
    assert result["learning rate"] == 1e-3


def feed_last_stage(metric: TrainMetric, _, view: RankView, __) -> list[Call]:
    return [Call(None, {"lr": 2e-5, "step": 3})] if view.last_stage else []


def test_every_rank_reports_the_same_values():
    # The timings too: they are max over ranks.
    assert_layout_invariant(lambda _: TrainMetric(), None, [Layout(pp=2, dp=2)], feed=feed_last_stage,
                            expected={"learning rate": 2e-5, "iters": 3}, rel=0, ignore=("total time elapse", "speed"))
