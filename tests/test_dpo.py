"""DPOMetric: hand-computed keys, pair layouts, layout invariance (CP sums before the margin sign), bad input."""

from __future__ import annotations

import pytest
import torch

from twinkle_megatron.metric.rl.dpo import DPOMetric
from twinkle_megatron.testing.batches import RankView, split_microbatches
from twinkle_megatron.testing.distributed import Layout
from twinkle_megatron.testing.invariance import Call, assert_layout_invariant

BATCH, SEQ, BETA = 8, 12, 0.1


def hand_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three interleaved pairs; sequence log-probs (policy / reference):
    pair 1: chosen −3 / −4, rejected −4 / −3 → margin .2;  pair 2: −2 / −2.5, −1 / −.5 → .1;
    pair 3: −6 / −5, −2 / −3 → −.2."""
    labels = torch.tensor([[1, 2, -100], [3, -100, -100], [4, -100, -100], [6, -100, -100], [7, 8, -100],
                           [9, -100, 5]])
    labels[5, 0] = -100
    logps = torch.tensor([[-1, -2, 9], [-4, 9, 9], [-2, 9, 9], [-1, 9, 9], [-4, -2, 9], [9, 9, -2]],
                         dtype=torch.float64)  # 9: masked positions, never read
    ref = torch.tensor([[-1.5, -2.5, 9], [-3, 9, 9], [-2.5, 9, 9], [-.5, 9, 9], [-2, -3, 9], [9, 9, -3]],
                       dtype=torch.float64)
    return labels, logps, ref


HAND_EXPECTED = {
    "logps/chosen": (-3 - 2 - 6) / 3,
    "logps/rejected": (-4 - 1 - 2) / 3,
    "logps/ref_chosen": (-4 - 2.5 - 5) / 3,
    "logps/ref_rejected": (-3 - .5 - 3) / 3,
    "rewards/chosen": BETA * (1 + .5 - 1) / 3,
    "rewards/rejected": BETA * (-1 - .5 + 1) / 3,
    "rewards/margins": (.2 + .1 - .2) / 3,
    "rewards/accuracies": 2 / 3,
}


def test_hand_computed_keys_in_both_pair_layouts():
    labels, logps, ref = hand_batch()
    metric = DPOMetric(beta=BETA)
    metric.accumulate({"labels": labels}, {"logps": logps}, ref_outputs={"logps": ref})
    result = metric.calculate()
    assert set(result) == set(HAND_EXPECTED)
    assert result == pytest.approx(HAND_EXPECTED, rel=1e-12)
    assert isinstance(result["rewards/accuracies"], float) and 0 <= result["rewards/accuracies"] <= 1

    halves = torch.tensor([0, 2, 4, 1, 3, 5])  # [c1, c2, c3, r1, r2, r3]
    metric = DPOMetric(beta=BETA, pair_layout="halves")
    metric.accumulate([{"labels": labels[halves]}], {"logps": [logps[halves]]}, ref_logps=[ref[halves]])
    assert metric.calculate() == pytest.approx(HAND_EXPECTED, rel=1e-12)


def test_without_reference_only_policy_logps_are_reported():
    labels, logps, _ = hand_batch()
    metric = DPOMetric()
    metric.accumulate({"labels": labels}, {"logps": logps})
    assert metric.calculate() == pytest.approx({"logps/chosen": -11 / 3, "logps/rejected": -7 / 3}, rel=1e-12)


def test_all_masked_pairs_and_microbatches_contribute_nothing():
    labels, logps, ref = hand_batch()
    masked = torch.full((2, 3), -100)
    metric = DPOMetric(beta=BETA)
    metric.accumulate([{"labels": masked}, {"labels": torch.zeros(0, 3, dtype=torch.long)}],
                      {"logps": [torch.zeros(2, 3), torch.zeros(0, 3)]}, ref_outputs={"logps": [torch.zeros(2, 3),
                                                                                               torch.zeros(0, 3)]})
    assert metric.calculate() == {}
    metric.accumulate([{"labels": masked}, {"labels": labels}], {"logps": [torch.ones(2, 3), logps]},
                      ref_outputs={"logps": [torch.ones(2, 3), ref]})
    assert metric.calculate() == pytest.approx(HAND_EXPECTED, rel=1e-12)


def test_bad_input_says_what_mismatched():
    labels, logps, ref = hand_batch()
    metric = DPOMetric()
    with pytest.raises(ValueError, match="microbatch 1 holds 5 sequences"):
        metric.accumulate([{"labels": labels}, {"labels": labels[:5]}], {"logps": [logps, logps[:5]]})
    with pytest.raises(ValueError, match=r"labels has shape \(6, 3\) but logps has shape \(6, 2\)"):
        metric.accumulate({"labels": labels}, {"logps": logps[:, :2]})
    with pytest.raises(ValueError, match=r"labels has shape \(6, 3\) but ref_outputs\['logps'\] has shape \(4, 3\)"):
        metric.accumulate({"labels": labels}, {"logps": logps}, ref_outputs={"logps": ref[:4]})
    with pytest.raises(ValueError, match="pair_layout must be one of"):
        DPOMetric(pair_layout="pairs")
    assert metric.calculate() == {}


# ------------------------------------------------------------------------------- layouts

def global_batch(seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 50, (BATCH, SEQ), generator=generator)
    prompt = torch.randint(1, 8, (BATCH, 1), generator=generator)
    labels[torch.arange(SEQ)[None, :] < prompt] = -100
    labels[6:8] = -100  # a fully masked pair: not counted
    labels[2:4, :4] = labels[2:4, 8:] = -100  # a pair with tokens on CP rank 1 only (chunks 1 and 2 of 4)
    logps = -torch.rand(BATCH, SEQ, generator=generator) * 3
    ref = logps + 0.4 * torch.randn(BATCH, SEQ, generator=generator)
    return {"labels": labels, "logps": logps, "ref": ref}


def reference() -> dict:
    batch = global_batch()
    mask = batch["labels"] != -100
    sequences = (batch["logps"].double() * mask).sum(-1)
    ref = (batch["ref"].double() * mask).sum(-1)
    counted = (mask[0::2].sum(-1) + mask[1::2].sum(-1)) > 0
    chosen, rejected = sequences[0::2][counted], sequences[1::2][counted]
    ref_chosen, ref_rejected = ref[0::2][counted], ref[1::2][counted]
    chosen_rewards, rejected_rewards = BETA * (chosen - ref_chosen), BETA * (rejected - ref_rejected)
    margins = chosen_rewards - rejected_rewards
    return {"logps/chosen": float(chosen.mean()), "logps/rejected": float(rejected.mean()),
            "logps/ref_chosen": float(ref_chosen.mean()), "logps/ref_rejected": float(ref_rejected.mean()),
            "rewards/chosen": float(chosen_rewards.mean()), "rewards/rejected": float(rejected_rewards.mean()),
            "rewards/margins": float(margins.mean()), "rewards/accuracies": float((margins > 0).double().mean())}


def feed_last_stage(metric: DPOMetric, batch: dict, view: RankView, variant: tuple) -> list[Call]:
    count, as_list = variant
    if not view.last_stage:
        return []
    local = {k: view.tokens(v) for k, v in batch.items()}
    inputs = [{"labels": labels} for labels in split_microbatches(local["labels"], count)]
    logps, ref = (split_microbatches(local[k], count) if as_list else local[k] for k in ("logps", "ref"))
    return [Call(inputs, {"logps": logps}, {"ref_outputs": {"logps": ref}})]


def accumulate_collectives(layout: Layout, variant: tuple) -> dict:
    """Under CP: one all-reduce per microbatch completes the pairs' token counts and margins."""
    count, as_list = variant
    return {"all_reduce": count if as_list else 1} if layout.cp > 1 else {}


@pytest.mark.parametrize("layout", [Layout(tp=2), Layout(tp=2, pp=2, dp=2), Layout(cp=2, dp=2)], ids=str)
def test_same_global_batch_gives_the_single_process_result(layout):
    expected = reference()
    assert 0 < expected["rewards/accuracies"] < 1
    assert_layout_invariant(lambda _: DPOMetric(beta=BETA), global_batch(), [layout], feed=feed_last_stage,
                            variants=[(1, True), (2, True), (2, False)], expected=expected, rel=1e-5,
                            accumulate_collectives=accumulate_collectives)


def test_single_process_matches_reference():
    batch = global_batch()
    metric = DPOMetric(beta=BETA)
    for labels, logps, ref in zip(*(split_microbatches(batch[k], 4) for k in ("labels", "logps", "ref"))):
        metric.accumulate({"labels": labels}, {"logps": logps}, ref_outputs={"logps": ref})
    assert metric.calculate() == pytest.approx(reference(), rel=1e-6)
