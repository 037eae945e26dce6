"""No silent wrong numbers: graphs, host syncs, NaN, no data, empty input, resume across layouts, mismatched ranks.

Each test runs over every metric (``kit.metric_cases.CASES``) fed the way its
callers feed it, and compares with what the same metric reports for the data
a careful caller would have passed instead (the poisoned token masked).
"""

from __future__ import annotations

import math
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from kit.metric_cases import (
    CASE_IDS,
    CASES,
    COLLECTION_CASES,
    VOCAB,
    Case,
    dropped,
    global_data,
    mask_like,
    poison,
    rows_of,
    tensors_held,
)

from twinkle_megatron import (
    Accuracy,
    EmbeddingMetric,
    GRPOMetric,
    LossMetric,
    MetricCollection,
    MetricSyncError,
    TokenStatsMetric,
    TrainMetric,
)
from twinkle_megatron.testing.batches import RankView
from twinkle_megatron.testing.distributed import Layout, run_distributed
from twinkle_megatron.testing.guards import forbid_host_sync
from twinkle_megatron.testing.invariance import assert_layout_invariant, assert_matches, calculate_or_error, run_calls

TIMING_KEYS = ("total time elapse", "speed")


def comparable(result: dict) -> dict:
    """A result without host timings; GRPO's top-K records as (gsi, pos, token_id) tuples."""
    out = {key: value for key, value in result.items() if key not in TIMING_KEYS}
    if "_high_kl_records" in out:
        out["_high_kl_records"] = [(r["gsi"], r["pos"], r["token_id"]) for r in out["_high_kl_records"]]
    return out


def single(case: Case, *datasets: dict) -> dict:
    metric = case.make()
    for d in datasets:
        case.feed(metric, d)
    return metric.calculate()


# ------------------------------------------------------------------ graphs and host syncs


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_accumulate_keeps_no_graph_and_never_syncs_with_the_host(case):
    d = global_data()
    for key in case.grad_inputs:
        d[key] = d[key].clone().requires_grad_(True)
    metric, calls = case.make(), case.calls(d)  # the caller prepares its inputs outside our code
    with forbid_host_sync():
        run_calls(metric, calls)
    held = tensors_held(metric)
    assert held, "the metric keeps device states"
    assert not any(t.requires_grad or t.grad_fn is not None for t in held), \
        "no tensor the metric holds may require grad or carry a graph"
    assert metric.calculate(), "and it still reports"


# ------------------------------------------------------------------ non-finite values


POISONED = [(case, key, unit, count) for case in CASES for key, unit, count in case.poisonable]


@pytest.mark.parametrize("case, key, unit, count_key", POISONED,
                         ids=[f"{case.name}-{key}" for case, key, _, _ in POISONED])
def test_a_nonfinite_input_is_counted_and_left_out_like_a_masked_one(case, key, unit, count_key):
    d, row = global_data(), 3
    result = single(case, poison(d, key, row))
    masked = mask_like(d, unit, row)
    if masked is not None:
        expected = single(case, masked)
    else:
        metric = case.make()
        run_calls(metric, dropped(case, d, row))
        expected = metric.calculate()
    counted_in_row = int((d["labels"][row] != -100).sum())
    expected[count_key] = counted_in_row if unit == "row" else 1
    assert_matches(result, expected, rel=1e-9, ignore=TIMING_KEYS)
    assert not any(isinstance(v, float) and math.isnan(v) for v in result.values()), "never NaN"


def _nan_on_one_rank(nan_on_rank: int) -> dict:
    """DP2: the same global data, the poisoned row (3) on rank ``nan_on_rank``; grad_norm NaN there too."""
    rank = dist.get_rank()
    d = global_data()
    for case in CASES:
        for key, _, _ in case.poisonable[:1]:
            d = poison(d, key, 3)
    order = [0, 1] if nan_on_rank == 0 else [1, 0]  # which half of the rows each rank holds
    half = RankView(dp_rank=order[rank], dp_size=2)
    results = {}
    for case in CASES:
        metric = case.make()
        case.feed(metric, rows_of(d, half))
        results[case.name] = comparable(metric.calculate())
    loss = LossMetric()
    loss.accumulate({}, {"loss": 1.0}, grad_norm=math.nan if rank == nan_on_rank else 0.5)
    results["grad_norm"] = loss.calculate()
    return results


def test_nonfinite_results_do_not_depend_on_which_rank_saw_the_value():
    on_rank0 = run_distributed(_nan_on_one_rank, world_size=2, args=(0,))
    on_rank1 = run_distributed(_nan_on_one_rank, world_size=2, args=(1,))
    assert on_rank0[0] == on_rank0[1] and on_rank1[0] == on_rank1[1]
    for name in on_rank0[0]:
        if name in ("GRPOMetric", "GSPOMetric"):  # the global sequence index of a record follows the rank order
            for result in (on_rank0[0][name], on_rank1[0][name]):
                result.pop("_high_kl_records", None)
        assert on_rank0[0][name] == pytest.approx(on_rank1[0][name], rel=1e-12), name
    assert on_rank0[0]["grad_norm"] == {"loss": 1.0, "grad_norm": 0.5, "nonfinite_grad_norms": 1}


# ------------------------------------------------------------------ no data, empty input, bad input


@pytest.mark.parametrize("case", [c for c in CASES if c.calls.__name__ in ("feed_logits", "feed_token_loss",
                                                                          "feed_policy", "feed_value_head",
                                                                          "feed_pairs")], ids=lambda c: c.name)
def test_fully_masked_data_gives_an_empty_result_never_nan(case):
    d = global_data()
    d["labels"][:] = -100
    assert single(case, d) == {}


def test_loss_without_counted_tokens_is_empty_on_every_rank():
    metric = LossMetric()
    metric.accumulate({"labels": torch.full((2, 3), -100)}, {"loss": torch.zeros(2, 3)})
    assert metric.calculate() == {}
    metric.accumulate({}, {"loss": torch.tensor(0.0), "num_tokens": 0}, loss_reduction="sum")
    assert metric.calculate() == {}

    def fully_masked_everywhere():
        metric = LossMetric(loss_reduction="sum")
        metric.accumulate({"labels": torch.full((2, 3), -100)}, {"loss": torch.tensor(0.0)})
        return metric.calculate()

    assert run_distributed(fully_masked_everywhere, world_size=2) == [{}, {}]


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_an_empty_microbatch_list_is_no_data(case):
    metric = case.make()
    metric.accumulate([], {"logits": [], "logps": [], "embeddings": [], "values": [], "loss": []})
    assert metric.calculate() == {}


def test_embedding_metric_takes_an_empty_call():
    metric = EmbeddingMetric()
    metric.accumulate([], {"embeddings": []})
    assert metric.calculate() == {}


@pytest.mark.parametrize("make", [Accuracy, TokenStatsMetric, GRPOMetric], ids=lambda m: m.__name__)
@pytest.mark.parametrize("vocab_size", [0, -3, 2.5, True])
def test_a_bad_vocab_size_is_refused_per_call_as_in_the_constructor(make, vocab_size):
    with pytest.raises(ValueError, match="vocab_size must be a positive int"):
        make(vocab_size=vocab_size)
    d = global_data()
    outputs = {"logits": d["logits"], "logps": d["logps"]}
    with pytest.raises(ValueError, match="vocab_size must be a positive int"):
        make().accumulate({"labels": d["labels"]}, outputs, vocab_size=vocab_size)


# ------------------------------------------------------------------ resume across layouts


COLLECTION = "collection"  # the variant of a MetricCollection of COLLECTION_CASES
VARIANTS = [*CASES, COLLECTION]


def name_of(variant) -> str:
    return variant.name if isinstance(variant, Case) else variant


def make(variant) -> object:
    """A fresh metric of a case, or the collection of COLLECTION_CASES."""
    return variant.make() if isinstance(variant, Case) else MetricCollection([c.make() for c in COLLECTION_CASES])


def calls_of(metric, variant, d: dict) -> list:
    """The caller's calls for ``d``: the case's own, or each collected case's calls on its metric."""
    if isinstance(variant, Case):
        return variant.calls(d)
    return [call._replace(metric=member) for case, member in zip(COLLECTION_CASES, metric.metrics)
            for call in case.calls(d)]


def _save_under() -> dict:
    """Phase 1 under DP (the whole world): accumulate this rank's rows of the first global batch, return
    every metric's and the collection's state (state_dict() calls collectives: every rank the same)."""
    d = rows_of(global_data(0), RankView(dp_rank=dist.get_rank(), dp_size=dist.get_world_size()))
    states = {}
    for variant in VARIANTS:
        metric = make(variant)
        run_calls(metric, calls_of(metric, variant, d))
        states[name_of(variant)] = metric.state_dict()
    return states


@pytest.mark.parametrize("layout", [Layout(), Layout(dp=4)], ids=str)
def test_state_saved_under_dp2_resumes_exactly_under_another_layout(layout):
    saved = run_distributed(_save_under, world_size=2)
    assert all(str(s) == str(saved[0]) for s in saved), "state_dict() is the same on every rank"
    expected = {case.name: single(case, global_data(0), global_data(1)) for case in CASES}
    expected[COLLECTION] = {key: value for case in COLLECTION_CASES for key, value in expected[case.name].items()}

    def resumed(variant):
        metric = make(variant)
        metric.load_state_dict(saved[0][name_of(variant)])
        return metric

    assert_layout_invariant(resumed, global_data(1), [layout], variants=VARIANTS,
                            feed=lambda metric, d, view, variant: calls_of(metric, variant, rows_of(d, view)),
                            expected=lambda _, variant: expected[name_of(variant)], rel=1e-9, ignore=TIMING_KEYS)


# ------------------------------------------------------------------ ranks that disagree


def _swapped_order() -> dict | str:
    metrics = [Accuracy(), LossMetric()]
    if dist.get_rank() == 1:
        metrics.reverse()
    return calculate_or_error(MetricCollection(metrics), MetricSyncError)


def _different_sets() -> dict | str:
    metrics = [Accuracy(), LossMetric(), TrainMetric()] if dist.get_rank() == 0 else [Accuracy()]
    return calculate_or_error(MetricCollection(metrics), MetricSyncError)


def test_ranks_with_different_metrics_raise_on_every_rank_naming_them():
    for messages in (run_distributed(_swapped_order, world_size=2), run_distributed(_different_sets, world_size=2)):
        assert all("the ranks sync different metrics" in m for m in messages), messages
        assert all("ranks [0]" in m and "ranks [1]" in m and "Accuracy(" in m for m in messages), messages


def _only_some_ranks_calculate() -> dict | str:
    # The metrics' own group, with a short timeout, so the test's default group stays usable; connected when it is
    # created, as gloo does by default (the harness's ranks connect lazily): a lazy connection to a rank that never
    # joins can take seconds beyond the timeout.
    os.environ["TORCH_GLOO_LAZY_INIT"] = "0"
    group = dist.new_group(ranks=[0, 1], timeout=timedelta(seconds=3))
    metric = LossMetric(process_group=group)
    if dist.get_rank() == 1:
        return "skipped calculate()"
    return calculate_or_error(metric, MetricSyncError)


def test_a_calculate_entered_by_some_ranks_only_fails_with_a_message_that_says_so():
    messages = run_distributed(_only_some_ranks_calculate, world_size=2, timeout=60)
    assert messages[1] == "skipped calculate()"
    assert "every rank of the reduction group must call them" in messages[0], messages[0]


def test_a_single_process_issues_no_collective_and_cannot_disagree():
    assert MetricCollection([Accuracy(vocab_size=VOCAB), LossMetric()]).calculate() == {}
