"""Every call form of Twinkle's metric documentation (../shared/seeds/001_*.txt), typed in literally.

Where the documentation writes ``...`` for a value, ``device_mesh=...`` and
``process_group=...`` are passed literally (they mean "not given"); data
placeholders (``labels=...``, ``loss=...``) get real tensors, and every
documented key is checked as a Python number against a value computed here,
independently. ``InputFeature`` / ``ModelOutput`` are Twinkle's TypedDicts
(plain dicts at run time); Twinkle's own classes are used when Twinkle is
installed (``make test-twinkle``), dicts otherwise. The forms of Twinkle's code
(twinkle-kit 0.5.1) where they differ from the documentation follow.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from kit.references import accuracy_reference

from twinkle_megatron import (
    Accuracy,
    CISPOMetric,
    CompletionRewardMetric,
    DPOMetric,
    EmbeddingMetric,
    GRPOMetric,
    GSPOMetric,
    LossMetric,
    Metric,
    MetricCollection,
    PPOMetric,
    PPOValueMetric,
    TrainMetric,
)
from twinkle_megatron.testing.invariance import assert_matches

try:  # Twinkle's TypedDicts are dicts at run time
    from twinkle.data_format import InputFeature, ModelOutput
except ImportError:
    InputFeature = ModelOutput = dict


def assert_numbers(result: dict, keys) -> None:
    for key in keys:
        assert key in result, f"missing {key!r} in {sorted(result)}"
        assert isinstance(result[key], (int, float)) and not isinstance(result[key], bool), (key, result[key])


# ------------------------------------------------------------------ TrainMetric


def test_train_metric_doc_form():
    metric = TrainMetric()
    metric.accumulate(None, None, lr=0.0001, step=10, gradient_accumulation_steps=16)
    _metric = metric.calculate()
    assert_numbers(_metric, ["learning rate", "iters", "total time elapse", "speed"])
    assert _metric["learning rate"] == 0.0001
    assert _metric["iters"] == 10 // 16
    assert _metric["total time elapse"] >= 0 and _metric["speed"] >= 0


def test_train_metric_twinkle_code_form_one_rate_per_param_group():
    # Twinkle's optimizer group: lr=[one per param group], step=cur_step - 1, gradient_accumulation_steps, grad_norm.
    metric = TrainMetric()
    metric.accumulate([{"labels": torch.ones(1, 2, dtype=torch.long)}], {"loss": 1.0}, lr=[1e-4, 2e-5], step=32,
                      gradient_accumulation_steps=4, grad_norm=0.7, temperature=1.0)
    result = metric.calculate()
    assert result["learning rate(param group 1)"] == 1e-4 and result["learning rate(param group 2)"] == 2e-5
    assert result["iters"] == 8
    metric.accumulate(None, None, lr=[3e-4], step=40, gradient_accumulation_steps=4)
    assert metric.calculate()["learning rate"] == 3e-4, "one param group: Twinkle's plain key"


# ------------------------------------------------------------------ LossMetric


def test_loss_metric_doc_form_with_literal_placeholders_for_mesh_and_group():
    labels = torch.tensor([[1, 2, -100], [3, -100, -100]])
    metric = LossMetric(device_mesh=..., process_group=...)
    metric.accumulate(InputFeature(labels=labels), ModelOutput(loss=torch.tensor(2.5)), grad_norm=1.25)
    _metric = metric.calculate()
    assert _metric == {"loss": 2.5, "grad_norm": 1.25}


def test_loss_metric_transformers_model_form_sum_and_num_tokens():
    # Twinkle's TransformersModel: outputs['loss'] is a token SUM, outputs['num_tokens'] its count, and it passes
    # loss_reduction='sum' as a keyword; the reported loss is per token.
    labels = torch.tensor([[1, 2, 3, -100], [4, 5, -100, -100]])
    per_token = torch.tensor([[2.0, 3.0, 4.0, 0.0], [1.0, 2.0, 0.0, 0.0]])
    loss_sum = per_token.sum()
    metric = LossMetric(device_mesh=None, process_group=None)
    metric.accumulate(InputFeature(labels=labels), ModelOutput(loss=loss_sum, num_tokens=torch.tensor(5)),
                      loss_reduction="sum", lr=[1e-4], step=0, gradient_accumulation_steps=1, grad_norm=0.5)
    assert metric.calculate() == {"loss": pytest.approx(12.0 / 5), "grad_norm": 0.5}
    # Without num_tokens, the tokens are counted from the labels, as Twinkle does.
    metric.accumulate(InputFeature(labels=labels), ModelOutput(loss=loss_sum), loss_reduction="sum")
    assert metric.calculate()["loss"] == pytest.approx(12.0 / 5)


def test_loss_metric_megatron_model_form_one_float_per_step():
    # Twinkle's MegatronModel: a list of microbatch inputs and one float, already averaged over DP×CP.
    metric = LossMetric(device_mesh=None, process_group=None)
    inputs = [InputFeature(labels=torch.ones(2, 4, dtype=torch.long)) for _ in range(4)]
    metric.accumulate(inputs, ModelOutput(loss=2.75, logits=None, logps=None), lr=[1e-4], step=3,
                      gradient_accumulation_steps=1, grad_norm=0.25)
    assert metric.calculate() == {"loss": 2.75, "grad_norm": 0.25}


# ------------------------------------------------------------------ Accuracy


def test_accuracy_doc_form():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=generator)
    labels = logits.argmax(-1)
    labels[0, :2] = (labels[0, :2] + 1) % 11  # two wrong
    labels[2, 3:] = -100
    metric = Accuracy(device_mesh=..., process_group=...)
    metric.accumulate(InputFeature(labels=labels), ModelOutput(logits=logits))
    _metric = metric.calculate()
    assert_numbers(_metric, ["accuracy", "correct_tokens", "total_tokens"])
    assert_matches(_metric, accuracy_reference(logits, labels), rel=1e-12)


def test_accuracy_takes_the_list_of_input_features_the_docs_say_twinkle_cannot():
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 6, 9, generator=generator)
    labels = torch.randint(0, 9, (4, 6), generator=generator)
    metric = Accuracy(device_mesh=None, process_group=None)
    metric.accumulate([InputFeature(labels=labels[:2]), InputFeature(labels=labels[2:])],
                      ModelOutput(logits=[logits[:2], logits[2:]]))
    assert_matches(metric.calculate(), accuracy_reference(logits, labels), rel=1e-12)


# ------------------------------------------------------------------ CompletionRewardMetric


def test_completion_reward_doc_form():
    completion_texts = ["a short one", "a somewhat longer completion", "mid length"]
    reward_values = [1.0, 0.0, 0.5]
    inputs, outputs = None, None
    gen_time, sync_time = 3.5, 0.25
    metric = CompletionRewardMetric(device_mesh=..., process_group=...)
    metric.accumulate(
        inputs,
        outputs,
        generation_time=gen_time,
        weight_sync_time=sync_time,
        rewards=reward_values,
        completions=completion_texts,
    )
    result = metric.calculate()
    assert result == {
        "profiling/Time taken: generate": 3.5,
        "profiling/Time taken: move_model_to_sampler": 0.25,
        "train/reward": pytest.approx(statistics.mean(reward_values)),
        "train/reward_std": pytest.approx(statistics.stdev(reward_values)),
        "train/completion_length": pytest.approx(statistics.mean(len(t) for t in completion_texts)),
    }


def test_completion_reward_twinkle_code_form():
    metric = CompletionRewardMetric(device_mesh=None, process_group=None)
    metric.accumulate(None, None, rewards={"accuracy": [1.0, 0.0], "format": [1.0, 1.0]}, completion_lengths=[12, 30],
                      generate_time=2.0, weight_sync_time=0.5)
    metric.accumulate(None, None, rewards={"accuracy": [1.0], "format": [0.0]}, completion_lengths=[18],
                      generate_time=4.0)
    assert metric.calculate() == {
        "profiling/Time taken: generate": 3.0,
        "profiling/Time taken: move_model_to_sampler": 0.5,
        "train/accuracy_reward": pytest.approx(2 / 3),
        "train/accuracy_reward_std": pytest.approx(statistics.stdev([1.0, 0.0, 1.0])),
        "train/format_reward": pytest.approx(2 / 3),
        "train/format_reward_std": pytest.approx(statistics.stdev([1.0, 1.0, 0.0])),
        "train/completion_length": pytest.approx(20.0),
    }


# ------------------------------------------------------------------ DPOMetric


def test_dpo_doc_form():
    labels = torch.tensor([[-100, 1, 2], [-100, 3, 4], [5, 6, -100], [7, -100, -100]])
    logps = torch.tensor([[0.0, -1.0, -2.0], [0.0, -3.0, -1.0], [-0.5, -0.5, 0.0], [-4.0, 0.0, 0.0]])
    ref = torch.tensor([[0.0, -1.5, -2.0], [0.0, -2.0, -1.0], [-1.0, -0.5, 0.0], [-2.0, 0.0, 0.0]])
    inputs, outputs, ref_outputs = InputFeature(labels=labels), ModelOutput(logps=logps), ModelOutput(logps=ref)
    metric = DPOMetric(device_mesh=..., process_group=...)
    metric.accumulate(inputs, outputs, ref_outputs=ref_outputs)
    result = metric.calculate()
    beta = 0.1
    # interleaved pairs (chosen, rejected): (0, 1) and (2, 3); sequence logps are sums over counted tokens
    chosen, rejected, ref_chosen, ref_rejected = [-3.0, -1.0], [-4.0, -4.0], [-3.5, -1.5], [-3.0, -2.0]
    rewards_c = [beta * (a - b) for a, b in zip(chosen, ref_chosen)]
    rewards_r = [beta * (a - b) for a, b in zip(rejected, ref_rejected)]
    margins = [c - r for c, r in zip(rewards_c, rewards_r)]
    assert result == pytest.approx({
        "logps/chosen": statistics.mean(chosen), "logps/rejected": statistics.mean(rejected),
        "logps/ref_chosen": statistics.mean(ref_chosen), "logps/ref_rejected": statistics.mean(ref_rejected),
        "rewards/chosen": statistics.mean(rewards_c), "rewards/rejected": statistics.mean(rewards_r),
        "rewards/margins": statistics.mean(margins),
        "rewards/accuracies": sum(m > 0 for m in margins) / len(margins)})


# ------------------------------------------------------------------ GRPO, GSPO, CISPO, PPO


def grpo_batch():
    labels = torch.tensor([[-100, 11, 12], [13, -100, 14]])
    logps = torch.tensor([[0.0, math.log(0.5), math.log(0.25)], [math.log(0.25), 0.0, math.log(0.5)]])
    old_logps = [[math.log(0.25), math.log(0.5)], [math.log(0.5), math.log(0.5)]]  # ragged, per counted token
    advantages = [1.0, -1.0]
    return InputFeature(labels=labels), ModelOutput(logps=logps), old_logps, advantages


def test_grpo_doc_form_and_documented_keys():
    device_mesh = process_group = None
    inputs, outputs, old_logps, advantages = grpo_batch()
    metric = GRPOMetric(
        device_mesh=device_mesh,
        process_group=process_group,
        epsilon=0.2,  # PPO clip range
        temperature=1.0,  # sampling temperature
        top_k_kl=10,  # top-K high-KL tokens
    )
    metric.accumulate(inputs, outputs, old_logps=old_logps, advantages=advantages)
    results = metric.calculate()
    new = [math.log(0.5), math.log(0.25), math.log(0.25), math.log(0.5)]
    old = [math.log(0.25), math.log(0.5), math.log(0.5), math.log(0.5)]
    diff = [n - o for n, o in zip(new, old)]
    k3 = [math.exp(d) - d - 1 for d in diff]
    ratios = [math.exp(d) for d in diff]  # 2, .5, .5, 1; advantages +, +, -, -
    expected = {
        "train/policy_confidence": math.exp(statistics.mean(new)),
        "train/mean_new_logp": statistics.mean(new),
        "train/mean_old_logp": statistics.mean(old),
        "train/logp_diff_mean": statistics.mean(diff),
        "train/approx_kl": statistics.mean(k3),
        "train/token_kl_max": max(k3),
        "train/token_ratio_max": max(ratios),
        "train/clip_ratio_low": 1 / 4,  # ratio .5 with A < 0 (sequence 1)
        "train/clip_ratio_high": 1 / 4,  # ratio 2 with A > 0 (sequence 0)
        "train/clip_ratio": 2 / 4,
    }
    assert_numbers(results, expected)
    assert {k: v for k, v in results.items() if k != "_high_kl_records"} == pytest.approx(expected)
    assert [r["kl"] for r in results["_high_kl_records"]] == pytest.approx(sorted((k for k in k3 if k > 0),
                                                                                  reverse=True))


@pytest.mark.parametrize("cls", [GSPOMetric, CISPOMetric, PPOMetric])
def test_variants_take_the_same_constructor_and_accumulate_forms(cls):
    inputs, outputs, old_logps, advantages = grpo_batch()
    metric = cls(device_mesh=None, process_group=None, epsilon=0.2, epsilon_high=0.28, temperature=1.0, top_k_kl=0,
                 ignore_index=-100)
    metric.accumulate(inputs, outputs, old_logps=old_logps, advantages=advantages)
    assert_numbers(metric.calculate(), ["train/approx_kl", "train/clip_ratio", "train/clip_ratio_low",
                                        "train/clip_ratio_high", "train/mean_new_logp"])


def test_ppo_value_metric_twinkle_code_form():
    labels = torch.tensor([[-100, 1, 2], [3, 4, -100]])
    values = torch.tensor([[0.0, 0.5, 1.0], [2.0, 0.0, 0.0]])
    metric = PPOValueMetric(device_mesh=None, process_group=None, epsilon=0.2)
    metric.accumulate(InputFeature(labels=labels), ModelOutput(values=values), old_values=[[0.4, 0.5], [1.0, 0.1]],
                      returns=[[1.0, 1.0], [2.0, 1.0]], advantages=[0.5, -0.5])
    v, r, old = [0.5, 1.0, 2.0, 0.0], [1.0, 1.0, 2.0, 1.0], [0.4, 0.5, 1.0, 0.1]
    residual = [b - a for a, b in zip(v, r)]
    assert metric.calculate() == pytest.approx({
        "train/value_mean": statistics.mean(v), "train/return_mean": statistics.mean(r),
        "train/value_clip_ratio": sum(abs(a - b) > 0.2 for a, b in zip(v, old)) / 4,
        "train/explained_variance": 1 - statistics.pvariance(residual) / statistics.pvariance(r),
        "train/advantage_mean": 0.0, "train/advantage_std": 0.5})


# ------------------------------------------------------------------ EmbeddingMetric


def test_embedding_doc_form():
    device_mesh = process_group = None
    embeddings = torch.tensor([[1.0, 0.0], [0.8, 0.6], [0.0, 1.0], [0.6, 0.8]])
    inputs = InputFeature(labels=torch.tensor([1, 0, 1, 0]))  # rows 0 and 2 are anchors; their positives follow
    outputs = ModelOutput(embeddings=embeddings, loss=torch.tensor(0.3412))
    metric = EmbeddingMetric(device_mesh=device_mesh, process_group=process_group)
    metric.accumulate(inputs, outputs, grad_norm=1.234567)
    results = metric.calculate()
    positives = [0.8, 0.8]  # cos(row 0, row 1), cos(row 2, row 3)
    negatives = [0.6, 0.6]  # cos(row 0, row 3), cos(row 2, row 1)
    assert results == pytest.approx({"pos_sim": statistics.mean(positives), "pos_sim_min": min(positives),
                                     "pos_sim_max": max(positives), "neg_sim": statistics.mean(negatives),
                                     "loss": 0.3412, "grad_norm": 1.234567})


# ------------------------------------------------------------------ Building Metrics


class CountingMetric(Metric):
    """The documentation's "Building Metrics" skeleton, filled in: tokens seen, gathered over ranks."""

    def __init__(self, device_mesh, process_group, **kwargs):
        super().__init__(device_mesh, process_group, **kwargs)
        self.reset()

    def accumulate(self, inputs, outputs):
        inputs = inputs if isinstance(inputs, list) else [inputs]
        self.tokens += sum(int((batch["labels"] != -100).sum()) for batch in inputs)

    def calculate(self):
        all_results = self.gather_results([{"tokens": self.tokens}])
        self.reset()
        return {"user/tokens": sum(r["tokens"] for r in all_results)}

    def reset(self):
        self.tokens = 0


def test_building_metrics_doc_skeleton_alone_and_in_a_collection():
    labels = torch.tensor([[1, 2, -100]])
    metric = CountingMetric(device_mesh=None, process_group=None)
    metric.accumulate(InputFeature(labels=labels), ModelOutput(loss=1.0))
    assert metric.calculate() == {"user/tokens": 2}
    collection = MetricCollection([LossMetric(), CountingMetric(None, None)])
    collection.accumulate([InputFeature(labels=labels)] * 2, ModelOutput(loss=[1.0, 3.0]))
    assert collection.calculate() == {"loss": 2.0, "user/tokens": 4}
