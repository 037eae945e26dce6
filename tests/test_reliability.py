"""No silent wrong numbers: graphs, host syncs, NaN, no data, empty input, resume across layouts, mismatched ranks.

Each test runs over every metric (``metric_cases.CASES``) fed the way its
callers feed it, and compares with what the same metric reports for the data
a careful caller would have passed instead (the poisoned token masked).
"""

from __future__ import annotations

import math
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from guards import forbid_host_sync
from metric_cases import (
    CASE_IDS,
    CASES,
    COLLECTION_CASES,
    ROWS,
    VOCAB,
    Case,
    dropped,
    global_data,
    mask_like,
    poison,
    rows_of,
    run_calls,
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

TIMING_KEYS = ("total time elapse", "speed")


def comparable(result: dict) -> dict:
    """A result without host timings; GRPO's top-K records as (gsi, pos, token_id) tuples."""
    out = {key: value for key, value in result.items() if key not in TIMING_KEYS}
    if "_high_kl_records" in out:
        out["_high_kl_records"] = [(r["gsi"], r["pos"], r["token_id"]) for r in out["_high_kl_records"]]
    return out


def assert_same(got: dict, want: dict, rel: float = 1e-9) -> None:
    got, want = comparable(got), comparable(want)
    assert set(got) == set(want), (sorted(got), sorted(want))
    for key in want:
        if isinstance(want[key], list):
            assert got[key] == want[key], key
        else:
            assert got[key] == pytest.approx(want[key], rel=rel, abs=1e-12), key


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
    assert_same(result, expected)
    assert not any(isinstance(v, float) and math.isnan(v) for v in result.values()), "never NaN"


def _nan_on_one_rank(nan_on_rank: int) -> dict:
    """DP2: the same global data, the poisoned row (3) on rank ``nan_on_rank``; grad_norm NaN there too."""
    rank = dist.get_rank()
    d = global_data()
    for case in CASES:
        for key, _, _ in case.poisonable[:1]:
            d = poison(d, key, 3)
    order = [0, 1] if nan_on_rank == 0 else [1, 0]  # which half of the rows each rank holds
    half = order[rank]
    results = {}
    for case in CASES:
        metric = case.make()
        case.feed(metric, rows_of(d, slice(half * ROWS // 2, (half + 1) * ROWS // 2)))
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


def _save_under(dp_blocks: int) -> dict:
    """Phase 1 on this layout: accumulate the first global batch, return every metric's state and the
    collection's (collective calls, every rank the same)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    d = rows_of(global_data(0), slice(rank * ROWS // size, (rank + 1) * ROWS // size))
    states = {}
    for case in CASES:
        metric = case.make()
        case.feed(metric, d)
        states[case.name] = metric.state_dict()
    collection = MetricCollection([case.make() for case in COLLECTION_CASES])
    for case, metric in zip(COLLECTION_CASES, collection.metrics):
        case.feed(metric, d)
    states["collection"] = collection.state_dict()
    return states


def _resume_under(states: dict) -> dict:
    rank, size = dist.get_rank(), dist.get_world_size()
    d = rows_of(global_data(1), slice(rank * ROWS // size, (rank + 1) * ROWS // size))
    results = {}
    for case in CASES:
        metric = case.make()
        metric.load_state_dict(states[case.name])
        case.feed(metric, d)
        results[case.name] = metric.calculate()
    collection = MetricCollection([case.make() for case in COLLECTION_CASES])
    collection.load_state_dict(states["collection"])
    for case, metric in zip(COLLECTION_CASES, collection.metrics):
        case.feed(metric, d)
    results["collection"] = collection.calculate()
    return results


@pytest.mark.parametrize("resume_dp", [1, 4])
def test_state_saved_under_dp2_resumes_exactly_under_another_layout(resume_dp):
    saved = run_distributed(_save_under, world_size=2, args=(2,))
    assert all(str(s) == str(saved[0]) for s in saved), "state_dict() is the same on every rank"
    resumed = run_distributed(_resume_under, world_size=resume_dp, args=(saved[0],))
    expected = {case.name: single(case, global_data(0), global_data(1)) for case in CASES}
    collection = {}
    for case in COLLECTION_CASES:
        collection.update(expected[case.name])
    for result in resumed:
        for case in CASES:
            assert_same(result[case.name], expected[case.name]), case.name
        assert_same(result["collection"], collection)


# ------------------------------------------------------------------ ranks that disagree


def _swapped_order() -> str:
    metrics = [Accuracy(), LossMetric()]
    if dist.get_rank() == 1:
        metrics.reverse()
    try:
        MetricCollection(metrics).calculate()
    except MetricSyncError as error:
        return str(error)
    return "no error"


def _different_sets() -> str:
    metrics = [Accuracy(), LossMetric(), TrainMetric()] if dist.get_rank() == 0 else [Accuracy()]
    try:
        MetricCollection(metrics).calculate()
    except MetricSyncError as error:
        return str(error)
    return "no error"


def test_ranks_with_different_metrics_raise_on_every_rank_naming_them():
    for messages in (run_distributed(_swapped_order, world_size=2), run_distributed(_different_sets, world_size=2)):
        assert all("the ranks sync different metrics" in m for m in messages), messages
        assert all("ranks [0]" in m and "ranks [1]" in m and "Accuracy(" in m for m in messages), messages


def _only_some_ranks_calculate() -> str:
    # The metrics' own group, with a short timeout, so the test's default group stays usable.
    group = dist.new_group(ranks=[0, 1], timeout=timedelta(seconds=3))
    metric = LossMetric(process_group=group)
    if dist.get_rank() == 1:
        return "skipped calculate()"
    try:
        metric.calculate()
    except MetricSyncError as error:
        return str(error)
    return "no error"


def test_a_calculate_entered_by_some_ranks_only_fails_with_a_message_that_says_so():
    messages = run_distributed(_only_some_ranks_calculate, world_size=2, timeout=60)
    assert messages[1] == "skipped calculate()"
    assert "every rank of the reduction group must call them" in messages[0], messages[0]


def test_a_single_process_issues_no_collective_and_cannot_disagree():
    assert MetricCollection([Accuracy(vocab_size=VOCAB), LossMetric()]).calculate() == {}
