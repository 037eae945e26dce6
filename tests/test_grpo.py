"""GRPO/GSPO/CISPO: hand-computed keys, layout invariance, vocab-parallel entropy, bad input."""

from __future__ import annotations

import math

import pytest
import torch
from kit.grpo_cases import (
    EPSILON,
    EPSILON_HIGH,
    TOP_K,
    VOCAB,
    accumulate_collectives,
    feed_last_stage,
    global_batch,
    reference,
)

from twinkle_megatron import ParallelContext
from twinkle_megatron.metric import CISPOMetric, GRPOMetric, GSPOMetric
from twinkle_megatron.testing.distributed import Layout
from twinkle_megatron.testing.invariance import assert_layout_invariant

METRICS = {"grpo": GRPOMetric, "gspo": GSPOMetric, "cispo": CISPOMetric}
ln = math.log


def assert_same_records(got: list, want: list) -> None:
    assert [(r["gsi"], r["pos"], r["token_id"]) for r in got] == [(r["gsi"], r["pos"], r["token_id"]) for r in want]
    for got_record, want_record in zip(got, want):
        assert got_record == pytest.approx(want_record, rel=1e-12)


# ----------------------------------------------------------------------------- hand-computed

def hand_batch() -> tuple[dict, dict, list, list]:
    """Three sequences of two counted tokens; per-token ratios 2, .5 | .5, 1 | 1.5, 1.5; advantages +, −, +."""
    labels = torch.tensor([[-100, 11, 12], [13, -100, 14], [15, 16, -100]])
    new = torch.tensor([[0.0, ln(.5), ln(.25)], [ln(.25), 9.0, ln(.5)], [ln(.3), ln(.6), 0.0]], dtype=torch.float64)
    old = [[ln(.25), ln(.5)], [ln(.5), ln(.5)], [ln(.2), ln(.4)]]
    entropies = torch.tensor([[5.0, 1.0, 2.0], [3.0, 5.0, 4.0], [1.5, 0.5, 5.0]])
    return {"labels": labels}, {"logps": new, "entropies": entropies}, old, [1.0, -1.0, 1.0]


def test_hand_computed_keys_of_all_three_metrics():
    mean_new = (ln(.5) + ln(.25) + ln(.25) + ln(.5) + ln(.3) + ln(.6)) / 6
    mean_old = (ln(.25) + ln(.5) + ln(.5) + ln(.5) + ln(.2) + ln(.4)) / 6
    kl_a, kl_b, kl_c = 1 - ln(2), ln(2) - 0.5, 0.5 - ln(1.5)  # k3 at ratio 2, ratio 0.5, ratio 1.5
    shared = {
        "train/policy_confidence": math.exp(mean_new),
        "train/mean_new_logp": mean_new,
        "train/mean_old_logp": mean_old,
        "train/logp_diff_mean": ln(2 * .5 * .5 * 1 * 1.5 * 1.5) / 6,
        "train/approx_kl": (kl_a + kl_b + kl_b + 0 + kl_c + kl_c) / 6,
        "train/token_kl_max": kl_a,
        "train/token_ratio_max": 2.0,
        "train/entropy": (1 + 2 + 3 + 4 + 1.5 + 0.5) / 6,
    }
    clip = {
        # token-level, gated: low = B's 0.5 (A < 0); high = A's 2 and C's 1.5, 1.5 (A > 0); A's 0.5 has A > 0
        "grpo": (1 / 6, 3 / 6),
        # one ratio per sequence: A exp((ln2 + ln.5)/2) = 1; B 2^-1/2 = .71 < .8 with A < 0; C 1.5 > 1.28
        "gspo": (1 / 3, 1 / 3),
        # token-level, not gated: low = A's and B's 0.5; high = A's 2, C's 1.5, 1.5
        "cispo": (2 / 6, 3 / 6),
    }
    records = [  # top 3 by k3: ties (A's and B's 0.5) go to the lower sequence index
        {"gsi": 0, "pos": 1, "token_id": 11, "kl": kl_a, "ratio": 2.0, "logp_new": ln(.5), "logp_old": ln(.25)},
        {"gsi": 0, "pos": 2, "token_id": 12, "kl": kl_b, "ratio": 0.5, "logp_new": ln(.25), "logp_old": ln(.5)},
        {"gsi": 1, "pos": 0, "token_id": 13, "kl": kl_b, "ratio": 0.5, "logp_new": ln(.25), "logp_old": ln(.5)},
    ]
    for name, cls in METRICS.items():
        inputs, outputs, old, advantages = hand_batch()
        metric = cls(epsilon=EPSILON, epsilon_high=EPSILON_HIGH, top_k_kl=3)
        metric.accumulate(inputs, outputs, old_logps=old, advantages=advantages)
        result = metric.calculate()
        low, high = clip[name]
        expected = {**shared, "train/clip_ratio_low": low, "train/clip_ratio_high": high,
                    "train/clip_ratio": low + high}
        assert set(result) == set(expected) | {"_high_kl_records"}, name
        for key, value in expected.items():
            assert result[key] == pytest.approx(value, rel=1e-12, abs=1e-15), (name, key)
        assert_same_records(result["_high_kl_records"], records)


def test_temperature_rescales_new_and_old_logps():
    inputs, outputs, old, advantages = hand_batch()
    metric = GRPOMetric(temperature=2.0, epsilon=EPSILON, epsilon_high=EPSILON_HIGH)
    metric.accumulate(inputs, outputs, old_logps=old, advantages=advantages)
    result = metric.calculate()
    mean_new = 2 * (ln(.5) + ln(.25) + ln(.25) + ln(.5) + ln(.3) + ln(.6)) / 6
    assert result["train/mean_new_logp"] == pytest.approx(mean_new, rel=1e-12)
    assert result["train/token_ratio_max"] == pytest.approx(4.0, rel=1e-12)  # ratios are squared
    # squared ratios 4, .25 | .25, 1 | 2.25, 2.25: low B's .25; high A's 4, C's 2.25 twice
    assert result["train/clip_ratio_low"] == pytest.approx(1 / 6)
    assert result["train/clip_ratio_high"] == pytest.approx(3 / 6)
    assert result["train/entropy"] == pytest.approx(2.0), "entropies are not rescaled"


def test_value_forms_agree_and_advantages_without_old_logps_add_no_clip():
    inputs, outputs, old, advantages = hand_batch()
    mask = inputs["labels"] != -100
    old_tensor = torch.zeros(3, 3, dtype=torch.float64)
    old_tensor[mask] = torch.tensor([v for row in old for v in row], dtype=torch.float64)
    forms = [
        (old, advantages),                                            # Twinkle's lists
        (old_tensor, torch.tensor(advantages)),                       # token tensor, one number per sequence
        ([old_tensor], [torch.tensor(advantages)[:, None].expand(3, 3)]),  # one tensor per microbatch
        (old, [[1.0, 1.0], -1.0, torch.tensor([1.0, 1.0])]),           # per-token arrays mixed with numbers
        (old, [[1.0, 1.0], -1.0, [1.0, 1.0]]),                         # the same as Python lists and numbers
    ]
    results = []
    for old_form, advantage_form in forms:
        metric = GSPOMetric(epsilon=EPSILON, epsilon_high=EPSILON_HIGH)
        metric.accumulate(inputs, outputs, old_logps=old_form, advantages=advantage_form)
        results.append(metric.calculate())
    assert all(r == pytest.approx(results[0], rel=1e-12) for r in results)
    metric = GRPOMetric()
    metric.accumulate(inputs, outputs, advantages=advantages)
    assert not any(key.startswith("train/clip") or key == "train/approx_kl" for key in metric.calculate())


def test_misaligned_arrays_are_counted_not_hidden():
    inputs, outputs, old, advantages = hand_batch()
    metric = GRPOMetric()
    metric.accumulate(inputs, outputs, old_logps=[old[0], old[1][:1], old[2] + [0.0]], advantages=advantages)
    assert metric.calculate()["train/misaligned_arrays"] == 2


def test_nonfinite_advantages_are_counted_not_scored():
    inputs, outputs, old, _ = hand_batch()
    metric = GRPOMetric()
    metric.accumulate(inputs, outputs, old_logps=old, advantages=[float("nan"), -1.0, 1.0])
    result = metric.calculate()
    # Sequence 0 leaves out; of the other four tokens, ratio .5 with A<0 is low, 1.5 and 1.5 with A>0 high.
    assert result["train/nonfinite_tokens"] == 2
    assert result["train/clip_ratio_low"] == pytest.approx(1 / 4)
    assert result["train/clip_ratio_high"] == pytest.approx(2 / 4)


def test_records_index_sequences_across_calls():
    inputs, outputs, old, advantages = hand_batch()
    metric = GRPOMetric(top_k_kl=2)
    for _ in range(2):
        metric.accumulate(inputs, outputs, old_logps=old, advantages=advantages)
    records = metric.calculate()["_high_kl_records"]
    assert [(r["gsi"], r["pos"]) for r in records] == [(0, 1), (3, 1)], "the second call's sequences follow the first's"


# ------------------------------------------------------------------------------ bad input

def test_bad_input_says_what_mismatched():
    inputs, outputs, old, advantages = hand_batch()
    metric = GRPOMetric()
    with pytest.raises(ValueError, match=r"labels has shape \(3, 3\) but logps has shape \(3, 2\)"):
        metric.accumulate(inputs, {"logps": outputs["logps"][:, :2]})
    with pytest.raises(ValueError, match="old_logps has 2 sequences but the inputs hold 3 sequences"):
        metric.accumulate(inputs, outputs, old_logps=old[:2])
    with pytest.raises(ValueError, match="advantages has 4 sequences but the inputs hold 3"):
        metric.accumulate(inputs, outputs, old_logps=old, advantages=advantages + [1.0])
    with pytest.raises(ValueError, match=r"old_logps has shape \(3, 4\) but logps has shape \(3, 3\)"):
        metric.accumulate(inputs, outputs, old_logps=torch.zeros(3, 4))
    with pytest.raises(ValueError, match=r"labels has shape \(3, 3\) but entropies has shape \(3, 1\)"):
        metric.accumulate([inputs, inputs], {"logps": [outputs["logps"]] * 2,
                                             "entropies": [outputs["entropies"], torch.zeros(3, 1)]})
    chunked = GRPOMetric(device_mesh=ParallelContext(cp_size=2, cp_rank=1))
    with pytest.raises(ValueError, match="per-token arrays need whole sequences"):
        chunked.accumulate({"labels": torch.zeros(3, 4, dtype=torch.long)}, {"logps": torch.zeros(3, 4)},
                           old_logps=[[0.0] * 4] * 3)
    assert metric.calculate() == {}, "a failed call adds nothing"


def test_all_masked_microbatches_contribute_nothing():
    inputs, outputs, old, advantages = hand_batch()
    masked = {"labels": torch.full((2, 3), -100)}
    empty = {"labels": torch.zeros(0, 3, dtype=torch.long)}
    metric = GSPOMetric(top_k_kl=3)
    metric.accumulate([masked, empty], {"logps": [torch.zeros(2, 3), torch.zeros(0, 3)]},
                      old_logps=[[], [], ], advantages=[1.0, -1.0])
    assert metric.calculate() == {}
    reference = GSPOMetric(top_k_kl=3)
    reference.accumulate(inputs, outputs, old_logps=old, advantages=advantages)
    logps = [torch.full((2, 3), float("nan")), outputs["logps"], torch.zeros(0, 3)]
    entropies = [torch.zeros(2, 3), outputs["entropies"], torch.zeros(0, 3)]
    metric.accumulate([masked, inputs, empty], {"logps": logps, "entropies": entropies},
                      old_logps=[[], []] + old, advantages=[5.0, 5.0] + advantages)
    result, expected = metric.calculate(), reference.calculate()
    records = result.pop("_high_kl_records")
    for record in records:
        record["gsi"] -= 2  # the masked microbatch's two sequences come first
    assert_same_records(records, expected.pop("_high_kl_records"))
    assert result == pytest.approx(expected, rel=1e-12)


def test_nonfinite_tokens_are_counted_and_left_out():
    inputs, outputs, old, advantages = hand_batch()
    logps = outputs["logps"].clone()
    logps[0, 1] = float("nan")
    metric = GRPOMetric()
    metric.accumulate(inputs, {"logps": logps}, old_logps=old, advantages=advantages)
    result = metric.calculate()
    assert result["train/nonfinite_tokens"] == 1
    assert math.isfinite(result["train/mean_new_logp"]) and result["train/token_ratio_max"] == pytest.approx(1.5)


# ------------------------------------------------------------------ layouts and vocab shards

SPLITS = [(1, True), (2, True), (2, False), (4, True)]


@pytest.mark.parametrize("layout", [Layout(tp=2), Layout(tp=2, pp=2, dp=2), Layout(cp=2, dp=2), Layout(tp=4)],
                         ids=str)
def test_same_global_batch_gives_the_single_process_result(layout):
    expected = {name: reference(name) for name in METRICS}
    assert_layout_invariant(
        lambda variant: METRICS[variant[0]](epsilon=EPSILON, epsilon_high=EPSILON_HIGH, top_k_kl=TOP_K,
                                            vocab_size=VOCAB),
        global_batch(), [layout], feed=feed_last_stage,
        variants=[(name, count, as_list) for name in METRICS for count, as_list in SPLITS],
        expected=lambda _, variant: expected[variant[0]], rel=1e-5, rel_for={"_high_kl_records": 1e-12},
        accumulate_collectives=accumulate_collectives)


def test_single_process_matches_reference_and_entropy_from_full_logits():
    batch = global_batch()
    for name, cls in METRICS.items():
        metric = cls(epsilon=EPSILON, epsilon_high=EPSILON_HIGH, top_k_kl=TOP_K, vocab_size=VOCAB)
        mask = batch["labels"] != -100
        metric.accumulate({"labels": batch["labels"]}, {"logps": batch["logps"], "logits": batch["logits"]},
                          old_logps=[row[m].tolist() for row, m in zip(batch["old"], mask)],
                          advantages=batch["advantages"].tolist())
        result, expected = metric.calculate(), reference(name)
        assert_same_records(result.pop("_high_kl_records"), expected.pop("_high_kl_records"))
        assert result == pytest.approx(expected, rel=1e-5)


def test_resume_mid_interval_keeps_states_and_records():
    inputs, outputs, old, advantages = hand_batch()
    straight, first = GSPOMetric(top_k_kl=4), GSPOMetric(top_k_kl=4)
    for _ in range(2):
        straight.accumulate(inputs, outputs, old_logps=old, advantages=advantages)
    first.accumulate(inputs, outputs, old_logps=old, advantages=advantages)
    resumed = GSPOMetric(top_k_kl=4)
    resumed.load_state_dict(first.state_dict())
    resumed.accumulate(inputs, outputs, old_logps=old, advantages=advantages)
    result, expected = resumed.calculate(), straight.calculate()
    assert_same_records(result.pop("_high_kl_records"), expected.pop("_high_kl_records"))
    assert result == expected
