"""CompletionRewardMetric: global mean and sample std over all ranks' completions, names agreed in the sync."""

from __future__ import annotations

import statistics

import pytest
import torch
import torch.distributed as dist

from twinkle_megatron.metric.rl.completion_reward import CompletionRewardMetric
from twinkle_megatron.testing.batches import RankView
from twinkle_megatron.testing.distributed import Layout, run_distributed
from twinkle_megatron.testing.invariance import Call, assert_layout_invariant, calculate_or_error

COMPLETIONS = 16


def test_hand_computed_single_process():
    metric = CompletionRewardMetric()
    metric.accumulate(rewards={"accuracy": [1.0, 0.0, 1.0], "format": [0.5, 0.25, 1.0]},
                      completion_lengths=[10, 20, 30], generate_time=2.0)
    metric.accumulate(None, None, rewards={"accuracy": torch.tensor([1.0])}, weight_sync_time=1.0,
                      generate_time=4.0)
    assert metric.calculate() == pytest.approx({
        "profiling/Time taken: move_model_to_sampler": 1.0,
        "profiling/Time taken: generate": 3.0,
        "train/accuracy_reward": 0.75,
        "train/accuracy_reward_std": statistics.stdev([1.0, 0.0, 1.0, 1.0]),
        "train/format_reward": 1.75 / 3,
        "train/format_reward_std": statistics.stdev([0.5, 0.25, 1.0]),
        "train/completion_length": 20.0,
    }, rel=1e-12)
    metric.accumulate(rewards={"single": [3.0]})
    assert metric.calculate() == {"train/single_reward": 3.0, "train/single_reward_std": 0.0}
    assert metric.calculate() == {}, "no data gives {}"


def global_rollout(seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {"accuracy": (torch.rand(COMPLETIONS, generator=generator) < 0.6).double(),
            "format": torch.rand(COMPLETIONS, generator=generator, dtype=torch.float64) * 2 - 0.5,
            "lengths": torch.randint(5, 200, (COMPLETIONS,), generator=generator)}


def feed_every_rank(metric: CompletionRewardMetric, rollout: dict, view: RankView, calls: int) -> list[Call]:
    """Every rank passes its data-parallel block (as a driver running on all ranks would), in ``calls`` calls:
    duplicates on TP, CP and earlier pipeline ranks must not count."""
    local = {k: view.rows(v) for k, v in rollout.items()}
    pieces = [{k: v.chunk(calls)[part] for k, v in local.items()} for part in range(calls)]
    return [Call(None, None, {"rewards": {"accuracy": piece["accuracy"], "format": piece["format"]},
                              "completion_lengths": piece["lengths"], "generate_time": 10.0 + view.dp_rank,
                              "weight_sync_time": 1.0 + view.dp_rank}) for piece in pieces]


@pytest.mark.parametrize("layout", [Layout(tp=2), Layout(tp=2, pp=2, dp=2), Layout(cp=2, dp=2)], ids=str)
def test_same_rollout_gives_the_single_process_result(layout):
    rollout = global_rollout()
    expected = {
        "profiling/Time taken: move_model_to_sampler": 1.0 + (layout.dp - 1) / 2,
        "profiling/Time taken: generate": 10.0 + (layout.dp - 1) / 2,
        "train/accuracy_reward": statistics.mean(rollout["accuracy"].tolist()),
        "train/accuracy_reward_std": statistics.stdev(rollout["accuracy"].tolist()),
        "train/format_reward": statistics.mean(rollout["format"].tolist()),
        "train/format_reward_std": statistics.stdev(rollout["format"].tolist()),
        "train/completion_length": statistics.mean(rollout["lengths"].double().tolist()),
    }
    # Names travel in the states: no extra collective.
    assert_layout_invariant(lambda _: CompletionRewardMetric(), rollout, [layout], feed=feed_every_rank,
                            variants=(1, 2), expected=expected, rel=1e-9,
                            calculate_collectives={"all_reduce": 2})


def _names_on_rank(conflicting: bool) -> dict | str:
    rewards = {"a": [1.0], "b": [2.0]}
    if dist.get_rank() == 1:
        rewards = {"b": [4.0], "a": [3.0]} if conflicting else {"a": [3.0]}
    metric = CompletionRewardMetric()
    metric.accumulate(rewards=rewards)
    return calculate_or_error(metric, ValueError)


def test_reward_names_agree_across_ranks_or_raise_everywhere():
    results = run_distributed(_names_on_rank, 2, args=(False,))
    assert results[0] == results[1] == {"train/a_reward": 2.0, "train/a_reward_std": pytest.approx(2 ** 0.5),
                                        "train/b_reward": 2.0, "train/b_reward_std": 0.0}
    results = run_distributed(_names_on_rank, 2, args=(True,))
    assert all("different orders" in r and "'a'" in r and "'b'" in r for r in results), results


def test_limits_are_checked_when_names_arrive():
    metric = CompletionRewardMetric(max_reward_functions=2, max_name_length=8)
    with pytest.raises(ValueError, match="more than 2 reward functions"):
        metric.accumulate(rewards={"a": [1.0], "b": [1.0], "c": [1.0]})
    with pytest.raises(ValueError, match="longer than 8 characters"):
        CompletionRewardMetric(max_name_length=8).accumulate(rewards={"a_very_long_name": [1.0]})


def test_resume_keeps_reward_slots():
    metric = CompletionRewardMetric()
    metric.accumulate(rewards={"a": [1.0], "b": [2.0]})
    resumed = CompletionRewardMetric()
    resumed.load_state_dict(metric.state_dict())
    resumed.accumulate(rewards={"b": [4.0]})  # slot of 'b' is 1, as before the restart
    assert resumed.calculate() == {"train/a_reward": 1.0, "train/a_reward_std": 0.0, "train/b_reward": 3.0,
                                   "train/b_reward_std": pytest.approx(2 ** 0.5)}
