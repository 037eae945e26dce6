"""All metrics in one MetricCollection: the collective budget of calculate(), no host sync, same results."""

from __future__ import annotations

import pytest
from kit.collection_cases import MICROBATCHES, VARIANTS, feed, global_batch, make_metrics

from twinkle_megatron.testing.batches import RankView
from twinkle_megatron.testing.distributed import Layout
from twinkle_megatron.testing.guards import count_collectives
from twinkle_megatron.testing.invariance import assert_layout_invariant, run_calls


def accumulate_collectives(layout: Layout, _) -> dict:
    """Two TP collectives per microbatch for Accuracy + GRPO entropy together; one CP all-reduce per
    microbatch for DPO's pair sums; nothing else."""
    expected = MICROBATCHES * (2 * (layout.tp > 1) + (layout.cp > 1))
    return {"all_reduce": expected} if expected else {}


def calculate_collectives(_, variant: tuple) -> dict:
    """One SUM and one MAX all-reduce for the states of all metrics (the embeddings' per-call sums included);
    GRPO's top-K token records add one all-gather, only when enabled."""
    top_k, _ = variant
    return {"all_reduce": 2, **({"all_gather": 2} if top_k else {})}


@pytest.mark.parametrize("layout", [Layout(tp=2, pp=2, dp=2), Layout(cp=2, dp=2)], ids=str)
def test_all_metrics_cost_two_collectives_plus_one_optional_gather(layout):
    runs = assert_layout_invariant(make_metrics, global_batch(), [layout], feed=feed, variants=VARIANTS, rel=1e-5,
                                   accumulate_collectives=accumulate_collectives,
                                   calculate_collectives=calculate_collectives)
    for index, (_, with_embedding) in enumerate(VARIANTS):
        result = runs[layout][0][index].result
        assert ("pos_sim" in result) == with_embedding and "rewards/accuracies" in result


def test_single_process_collection_issues_no_collective():
    metrics = make_metrics((3, True))
    run_calls(metrics, feed(metrics, global_batch(), RankView()))
    with count_collectives() as counts:
        result = metrics.calculate()
    assert not counts
    assert {"accuracy", "loss", "train/entropy", "train/clip_ratio", "_high_kl_records", "logps/chosen",
            "rewards/accuracies", "pos_sim", "neg_sim", "train/score_reward", "train/score_reward_std",
            "train/completion_length", "profiling/Time taken: generate"} <= set(result)
    assert all(isinstance(v, (int, float)) for k, v in result.items() if k != "_high_kl_records")
