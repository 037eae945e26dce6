"""The train–inference mismatch (``rollout_logps``): float64 reference, identity, forms, layouts, one sync.

For GRPO, GSPO, CISPO and PPO: with ``Δ = logπ_train − logπ_rollout`` over the counted tokens, the keys
equal plain float64 torch on the global batch under DP, CP×DP and TP×PP×DP layouts (rollout log-probs as
Twinkle's ragged lists, as tensors, per microbatch); a rollout identical to the trainer gives exactly
1.0 / 0.0 / 0.0 / 0.0; per position bucket too; the collective counts are those without a rollout.
"""

from __future__ import annotations

import pytest
import torch

from twinkle_megatron import CISPOMetric, GRPOMetric, GSPOMetric, MetricCollection, PPOMetric
from twinkle_megatron.testing.batches import RankView, split_microbatches
from twinkle_megatron.testing.distributed import Layout
from twinkle_megatron.testing.invariance import Call, assert_layout_invariant, assert_matches, run_calls

ROWS, SEQ, THRESHOLD = 8, 8, 0.3
KEYS = ("train/token_mult_prob_error", "train/rollout_kl", "train/rollout_logp_diff_max",
        "train/rollout_mismatch_ratio")
METRICS = (GRPOMetric, GSPOMetric, CISPOMetric, PPOMetric)
EDGES = [0, 3, 8]


def data() -> dict:
    g = torch.Generator().manual_seed(3)
    labels = torch.randint(0, 50, (ROWS, SEQ), generator=g)
    labels[:, :2] = -100  # the prompt
    for row in range(ROWS):
        labels[row, SEQ - row // 2:] = -100  # right padding
    logps = -torch.rand(ROWS, SEQ, generator=g, dtype=torch.float64) * 3
    rollout = logps + 0.4 * torch.randn(ROWS, SEQ, generator=g, dtype=torch.float64)
    return {"labels": labels, "logps": logps, "rollout": rollout,
            "old": logps + 0.1 * torch.randn(ROWS, SEQ, generator=g, dtype=torch.float64),
            "advantages": torch.randn(ROWS, generator=g, dtype=torch.float64)}


def reference(d: dict, rollout: torch.Tensor) -> dict:
    """The four keys in float64, globally and per position bucket."""
    counted = d["labels"] != -100
    positions = torch.arange(SEQ).expand(ROWS, SEQ)

    def keys(mask: torch.Tensor, suffix: str = "") -> dict:
        delta = (d["logps"] - rollout)[mask]
        values = (delta.abs().exp().mean(), (delta.exp() - delta - 1).mean(), delta.abs().max(),
                  (delta.abs() > THRESHOLD).double().mean())
        return {key + suffix: float(value) for key, value in zip(KEYS, values)}

    results = keys(counted)
    for first, end in zip(EDGES[:-1], EDGES[1:]):
        results.update(keys(counted & (positions >= first) & (positions < end), f"/pos_{first}-{end - 1}"))
    return results


def ragged(values: torch.Tensor, labels: torch.Tensor) -> list:
    """Twinkle's form: per sequence, the values of its counted tokens in order."""
    return [row[mask].tolist() for row, mask in zip(values, labels != -100)]


def feed(metric, d: dict, view: RankView, variant: tuple) -> list[Call]:
    """``variant``: (microbatches, form of rollout_logps: 'tensor' | 'list' | 'ragged')."""
    if not view.last_stage:
        return []
    splits, form = variant
    labels, logps = view.tokens(d["labels"]), view.tokens(d["logps"])
    rollout, old = view.tokens(d["rollout"]), view.tokens(d["old"])
    split = lambda tensor: split_microbatches(tensor, splits)  # noqa: E731
    given = {"tensor": rollout, "list": split(rollout), "ragged": ragged(rollout, labels)}[form]
    inputs = [{"labels": mb} for mb in split(labels)]
    return [Call(inputs, {"logps": split(logps)}, {"old_logps": split(old), "advantages": view.rows(d["advantages"]),
                                                   "rollout_logps": given})]


def only_mismatch(results: dict) -> dict:
    return {key: value for key, value in results.items() if key.startswith(KEYS)}


def test_keys_equal_the_float64_reference_and_the_other_keys_are_unchanged():
    d = data()
    want = reference(d, d["rollout"])
    for cls in METRICS:
        for form in ("tensor", "list", "ragged"):
            metric = cls(rollout_threshold=THRESHOLD, position_buckets=EDGES)
            run_calls(metric, feed(metric, d, RankView(), (2, form)))
            result = metric.calculate()
            assert_matches(only_mismatch(result), want, rel=1e-12, where=f"{cls.__name__} {form}")
            without = cls(position_buckets=EDGES)
            calls = feed(without, d, RankView(), (2, form))
            run_calls(without, [Call(c.inputs, c.outputs, {k: v for k, v in c.keywords.items()
                                                          if k != "rollout_logps"}) for c in calls])
            assert {k: v for k, v in result.items() if not k.startswith(KEYS)} == without.calculate()


def test_a_rollout_identical_to_the_trainer_gives_exactly_one_and_zeros():
    d = data()
    for cls in METRICS:
        metric = cls()
        metric.accumulate({"labels": d["labels"]}, {"logps": d["logps"]}, rollout_logps=ragged(d["logps"], d["labels"]))
        result = metric.calculate()
        assert [result[key] for key in KEYS] == [1.0, 0.0, 0.0, 0.0]


LAYOUTS = [Layout(dp=2), Layout(cp=2, dp=2), Layout(tp=2, pp=2, dp=2)]


def _collectives(cls: type) -> callable:
    """GSPO's one CP sum of the per-sequence partials per microbatch; the rollout adds nothing."""
    return lambda layout, variant: {"all_reduce": variant[0]} if cls is GSPOMetric and layout.cp > 1 else {}


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("cls", METRICS, ids=lambda cls: cls.__name__)
def test_keys_are_layout_invariant_in_the_same_sync(layout, cls):
    d = data()
    forms = ("tensor", "list") if layout.cp > 1 else ("tensor", "list", "ragged")
    variants = [(splits, form) for splits in (1, 2) for form in forms]
    runs = assert_layout_invariant(lambda variant: cls(rollout_threshold=THRESHOLD, position_buckets=EDGES), d,
                                   [layout], feed=feed, variants=variants,
                                   rel=1e-9, accumulate_collectives=_collectives(cls),
                                   calculate_collectives={"all_reduce": 2})
    want = reference(d, d["rollout"])
    for rank_runs in runs[layout]:
        for run in rank_runs:
            assert_matches(only_mismatch(run.result), want, rel=1e-9)


def _identical(metric, d: dict, view: RankView, variant) -> list[Call]:
    return feed(metric, {**d, "rollout": d["logps"]}, view, variant)


def test_identity_is_exact_under_context_parallelism_in_a_collection():
    d = data()
    assert_layout_invariant(lambda variant: MetricCollection([GRPOMetric()]), d, [Layout(cp=2, dp=2)],
                            feed=_identical, variants=[(2, "tensor")],
                            expected=lambda *_: {**_single(d), **dict(zip(KEYS, (1.0, 0.0, 0.0, 0.0)))},
                            rel=1e-9, rel_for=dict.fromkeys(KEYS, 0.0))


def _single(d: dict) -> dict:
    metric = GRPOMetric()
    run_calls(metric, _identical(metric, d, RankView(), (2, "tensor")))
    return metric.calculate()


def test_bad_threshold_and_misaligned_rollout_arrays():
    for bad in (0, -1.0, "1", True):
        with pytest.raises(ValueError, match="rollout_threshold"):
            GRPOMetric(rollout_threshold=bad)
    metric = GRPOMetric()
    labels = torch.tensor([[1, 2, 3]])
    metric.accumulate({"labels": labels}, {"logps": torch.zeros(1, 3)}, rollout_logps=[[0.0, 0.0]])
    assert metric.calculate()["train/misaligned_arrays"] == 1
    with pytest.raises(ValueError, match="rollout_logps"):
        metric.accumulate({"labels": labels}, {"logps": torch.zeros(1, 3)}, rollout_logps=torch.zeros(2, 3))


# ------------------------------------------------------------------ misaligned arrays: left out, never filled

SHORT, LONG = 1, 4  # the sequences whose arrays are one value short and one value long


def _misaligned(values: list) -> list:
    values = [list(row) for row in values]
    values[SHORT] = values[SHORT][:-1]
    values[LONG] = values[LONG] + [0.0]
    return values


def _without_misaligned_sequences(d: dict) -> dict:
    keep = [row for row in range(ROWS) if row not in (SHORT, LONG)]
    return {key: value[keep] for key, value in d.items()}


def _ragged_feed(arrays: tuple[str, ...]):
    """Twinkle's Megatron model: each DP rank's whole sequences (gathered over CP), its per-sequence values as
    ragged lists of the whole batch's sequences, ``arrays`` (of 'rollout', 'old', 'advantages') with the
    sequences SHORT and LONG misaligned."""

    def feed(metric, d: dict, view: RankView, variant) -> list[Call]:
        if not view.last_stage:
            return []
        rows = view.rows(torch.arange(d["labels"].shape[0])).tolist()
        whole = {"rollout": ragged(d["rollout"], d["labels"]), "old": ragged(d["old"], d["labels"]),
                 "advantages": [[float(a)] * int(n) for a, n in zip(d["advantages"], (d["labels"] != -100).sum(-1))]}
        given = {name: _misaligned(values) if name in arrays and d["labels"].shape[0] == ROWS else values
                 for name, values in whole.items()}
        keywords = {"rollout_logps": "rollout", "old_logps": "old", "advantages": "advantages"}
        return [Call([{"labels": view.rows(d["labels"])}], {"logps": [view.rows(d["logps"])]},
                     {key: [given[name][row] for row in rows] for key, name in keywords.items()})]

    return feed


@pytest.mark.parametrize("arrays", [("rollout",), ("old", "advantages")], ids="+".join)
@pytest.mark.parametrize("cls", METRICS, ids=lambda cls: cls.__name__)
def test_misaligned_arrays_leave_their_sequences_out_and_are_counted(cls, arrays):
    """A ragged array one value short and one value long: every key (the mismatch keys and the ones reading old
    log-probs and advantages) equals those of the same data without those two sequences; each misaligned array
    is counted in train/misaligned_arrays; the same on DP2 and CP2×DP2."""
    d = data()
    feed = _ragged_feed(arrays)
    factory = lambda _: cls(rollout_threshold=THRESHOLD, position_buckets=EDGES, cp_gathered=True)  # noqa: E731
    without = factory(None)
    reduced = _without_misaligned_sequences(d)
    run_calls(without, feed(without, reduced, RankView(), None))
    want = {**without.calculate(), "train/misaligned_arrays": 2 * len(arrays)}  # arrays, not sequences
    assert set(KEYS) <= set(want) and "train/approx_kl" in want
    assert_layout_invariant(factory, d, [Layout(dp=2), Layout(cp=2, dp=2)], feed=feed, expected=want, rel=1e-9)
    # Filled with zeros, the short array's missing value would have moved the keys: the data are not degenerate.
    filled = factory(None)
    calls = feed(filled, d, RankView(), None)
    for call in calls:
        for values in call.keywords.values():
            values[SHORT] = values[SHORT] + [0.0]
            values[LONG] = values[LONG][:-1]
    run_calls(filled, calls)
    assert filled.calculate() != want


def test_the_value_metric_leaves_sequences_with_misaligned_arrays_out_too():
    """PPOValueMetric reads the same view: old values one short and returns one long leave their sequences out."""
    from twinkle_megatron import PPOValueMetric

    d = data()
    values = d["logps"] + 1.0

    def result(rows: list, old: list, returns: list) -> dict:
        metric = PPOValueMetric(epsilon=0.1)
        metric.accumulate({"labels": d["labels"][rows]}, {"values": values[rows]}, old_values=old, returns=returns)
        return metric.calculate()

    old, returns = ragged(d["old"], d["labels"]), ragged(d["rollout"], d["labels"])
    old[SHORT], returns[LONG] = old[SHORT][:-1], returns[LONG] + [0.0]
    got = result(list(range(ROWS)), old, returns)
    keep = [row for row in range(ROWS) if row not in (SHORT, LONG)]
    assert got.pop("train/misaligned_arrays") == 2
    assert got == result(keep, [old[row] for row in keep], [returns[row] for row in keep])
