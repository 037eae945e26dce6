"""Inside real Twinkle (twinkle-kit 0.5.1, installed by ``make test-twinkle``): construction and the call path.

* Twinkle's ``construct_class`` (what ``model.add_metric(cls, **kw)`` calls)
  builds our classes with the mesh and process group it passes.
* Twinkle's own optimizer group (``BaseOptimizerGroup.accumulate_metrics`` /
  ``calculate_metrics``, the code every Twinkle model runs) drives our metrics
  and Twinkle's side by side on the same data; Twinkle's numbers (strings,
  rounded as Twinkle prints them) are the oracle wherever the two define a
  statistic the same way.
* Two ranks with Twinkle's real ``DeviceMesh`` and the DP process group its
  models create: the same dict on both, equal to one process on the whole batch.

Skipped, with the reason, where Twinkle is not installed (``make test`` does not install it).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from twinkle_megatron.testing.distributed import run_distributed

twinkle = pytest.importorskip("twinkle.metric", reason="Twinkle is not installed here: run `make test-twinkle`")

from twinkle.data_format import InputFeature, ModelOutput  # noqa: E402
from twinkle.model.optimizer_group import BaseOptimizerGroup, TrainStatus  # noqa: E402
from twinkle.utils import DeviceMesh, construct_class  # noqa: E402

import twinkle_megatron  # noqa: E402

OURS = ["Accuracy", "LossMetric", "TrainMetric", "CompletionRewardMetric", "DPOMetric", "GRPOMetric", "GSPOMetric",
        "CISPOMetric", "PPOMetric", "PPOValueMetric", "EmbeddingMetric"]


def number(value) -> float:
    """A Twinkle result as a float: '0.85', '85.0%', '1.000000e-04', '12 seconds', '0.50 iters/s'."""
    if isinstance(value, str):
        text = value.split()[0]
        return float(text[:-1]) / 100 if text.endswith("%") else float(text)
    return float(value)


def printed_tolerance(value) -> float:
    """Half a unit of the last digit Twinkle printed (0 for a number it did not format)."""
    if not isinstance(value, str) or "." not in value.split()[0] or "e" in value:
        return 1e-12
    digits = len(value.split()[0].rstrip("%").split(".")[1])
    return 0.5 * 10 ** -digits * (0.01 if value.split()[0].endswith("%") else 1) + 1e-12


@pytest.mark.parametrize("name", OURS)
def test_twinkles_construct_class_builds_our_metrics(name):
    mesh = DeviceMesh.from_sizes(dp_size=1)
    cls = getattr(twinkle_megatron, name)
    assert issubclass(cls, twinkle.Metric), "our metrics are Twinkle metrics when Twinkle is installed"
    metric = construct_class(cls, twinkle.Metric, twinkle, device_mesh=mesh, process_group=None)
    assert isinstance(metric, cls) and metric.device_mesh is mesh and metric.process_group is None
    # By name, from our package (Twinkle's add_metric looks names up in its own twinkle.metric).
    by_name = construct_class(name, twinkle.Metric, [twinkle_megatron], device_mesh=mesh, process_group=None)
    assert type(by_name) is cls


class OptimizerGroup(BaseOptimizerGroup):
    """Twinkle's base optimizer group with the learning rates a real optimizer would report."""

    def _get_lr(self):
        return [1e-4, 2e-5]


def drive(metrics, inputs, outputs, **forward_kwargs) -> dict:
    """One training step through Twinkle's own metric call path."""
    group = OptimizerGroup(train_status=TrainStatus(metrics=metrics), gradient_accumulation_steps=2, cur_step=9)
    group._last_grad_norm = 0.75
    group.train_status.inputs, group.train_status.outputs = inputs, outputs
    group.train_status.forward_kwargs = forward_kwargs
    return group.calculate_metrics(is_training=True)


def assert_agree(ours: dict, theirs: dict, keys) -> None:
    for key in keys:
        assert key in ours and key in theirs, (key, sorted(ours), sorted(theirs))
        assert not isinstance(ours[key], str), f"{key}: ours is a number"
        # Twinkle computes in float32 and prints rounded strings: agree within both.
        assert ours[key] == pytest.approx(number(theirs[key]), rel=1e-6, abs=printed_tolerance(theirs[key])), key


def transformers_step():
    """Twinkle's TransformersModel: one input dict, loss a token sum, num_tokens, logits; loss_reduction='sum'."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 10, 17, generator=generator)
    labels = torch.where(torch.rand(4, 10, generator=generator) < 0.5, logits.argmax(-1),
                         torch.randint(0, 17, (4, 10), generator=generator))
    labels[:, :2] = -100
    per_token = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
    outputs = ModelOutput(logits=logits, loss=per_token.sum(), num_tokens=(labels != -100).sum())
    return InputFeature(labels=labels), outputs


def test_twinkles_call_path_gives_twinkles_numbers_for_loss_accuracy_and_train():
    inputs, outputs = transformers_step()
    names = ("LossMetric", "Accuracy", "TrainMetric")
    ours = drive([getattr(twinkle_megatron, n)(None, None) for n in names], inputs, outputs, loss_reduction="sum")
    theirs = drive([getattr(twinkle, n)(None, None) for n in names], inputs, outputs, loss_reduction="sum")
    assert_agree(ours, theirs, ["loss", "grad_norm", "accuracy", "correct_tokens", "total_tokens", "iters",
                                "learning rate(param group 1)", "learning rate(param group 2)"])
    assert isinstance(ours["speed"], float) and isinstance(ours["total time elapse"], float)


def rl_step():
    generator = torch.Generator().manual_seed(1)
    labels = torch.randint(0, 30, (6, 9), generator=generator)
    labels[:, :3] = -100
    logps = -torch.rand(6, 9, generator=generator) * 3
    mask = labels != -100
    old = [(row[m] + 0.2 * torch.randn(int(m.sum()), generator=generator)).tolist() for row, m in zip(logps, mask)]
    advantages = torch.randn(6, generator=generator).tolist()
    return InputFeature(labels=labels), ModelOutput(logps=logps), old, advantages


@pytest.mark.parametrize("name", ["GRPOMetric", "GSPOMetric", "CISPOMetric", "PPOMetric"])
def test_policy_metrics_agree_with_twinkles(name):
    inputs, outputs, old, advantages = rl_step()
    kwargs = {"epsilon": 0.1, "epsilon_high": 0.15, "top_k_kl": 4}
    ours = drive([getattr(twinkle_megatron, name)(None, None, **kwargs)], inputs, outputs, old_logps=old,
                 advantages=advantages)
    theirs = drive([getattr(twinkle, name)(None, None, **kwargs)], inputs, outputs, old_logps=old,
                   advantages=advantages)
    assert_agree(ours, theirs, [k for k in theirs if k != "_high_kl_records"])
    ours_top = [(r["gsi"], r["pos"], r["token_id"]) for r in ours["_high_kl_records"]]
    assert ours_top == [(r["gsi"], r["pos"], r["token_id"]) for r in theirs["_high_kl_records"]]


def test_dpo_ppo_value_completion_reward_and_embedding_agree_with_twinkles():
    generator = torch.Generator().manual_seed(2)
    labels = torch.randint(0, 20, (4, 6), generator=generator)
    labels[:, :2] = -100
    logps, ref = -torch.rand(4, 6, generator=generator), -torch.rand(4, 6, generator=generator)
    ours = drive([twinkle_megatron.DPOMetric(None, None)], InputFeature(labels=labels), ModelOutput(logps=logps),
                 ref_outputs=ModelOutput(logps=ref))
    theirs = drive([twinkle.DPOMetric(None, None)], InputFeature(labels=labels), ModelOutput(logps=logps),
                   ref_outputs=ModelOutput(logps=ref))
    assert_agree(ours, theirs, list(theirs))

    values = torch.randn(4, 6, generator=generator)
    per_sample = {key: [torch.randn(4, generator=generator).tolist() for _ in range(4)]
                  for key in ("old_values", "returns")}
    ours = drive([twinkle_megatron.PPOValueMetric(None, None)], InputFeature(labels=labels),
                 ModelOutput(values=values), advantages=[0.5, -1.0, 2.0, 0.0], **per_sample)
    theirs = drive([twinkle.PPOValueMetric(None, None)], InputFeature(labels=labels), ModelOutput(values=values),
                   advantages=[0.5, -1.0, 2.0, 0.0], **per_sample)
    assert_agree(ours, theirs, list(theirs))

    rewards = {"accuracy": [1.0, 0.0, 1.0], "format": [0.5, 0.5, 1.0]}
    keywords = {"rewards": rewards, "completion_lengths": [10, 20, 33], "generate_time": 1.5, "weight_sync_time": 0.2}
    ours_metric, their_metric = twinkle_megatron.CompletionRewardMetric(), twinkle.CompletionRewardMetric()
    ours_metric.accumulate(None, None, **keywords)
    their_metric.accumulate(None, None, **keywords)
    theirs = their_metric.calculate()
    assert_agree(ours_metric.calculate(), theirs, list(theirs))

    # Twinkle's neg_sim is a raw dot product: it agrees with our cosine for unit embeddings.
    embeddings = torch.nn.functional.normalize(torch.randn(6, 5, generator=generator), dim=-1)
    anchors = InputFeature(labels=torch.tensor([1, 0, 1, 0, 1, 0]))
    ours = drive([twinkle_megatron.EmbeddingMetric(None, None)], anchors, ModelOutput(embeddings=embeddings,
                                                                                       loss=torch.tensor(0.5)))
    theirs = drive([twinkle.EmbeddingMetric(None, None)], anchors, ModelOutput(embeddings=embeddings,
                                                                               loss=torch.tensor(0.5)))
    assert_agree(ours, theirs, ["pos_sim", "pos_sim_min", "pos_sim_max", "neg_sim", "loss", "grad_norm"])


def _two_ranks_with_twinkles_mesh() -> dict:
    import torch.distributed as dist

    os.environ["RANK"] = str(dist.get_rank())  # Twinkle's DeviceMesh reads the rank from the environment
    mesh = DeviceMesh.from_sizes(dp_size=2)
    process_group = mesh.create_process_group(["dp"])  # what Twinkle's models pass as process_group
    metrics = [construct_class(getattr(twinkle_megatron, n), twinkle.Metric, twinkle, device_mesh=mesh,
                               process_group=process_group) for n in ("LossMetric", "Accuracy")]
    inputs, outputs = transformers_step()
    rows = slice(2 * dist.get_rank(), 2 * dist.get_rank() + 2)
    per_token = torch.nn.functional.cross_entropy(outputs["logits"][rows].flatten(0, 1),
                                                  inputs["labels"][rows].flatten(), reduction="none")
    local_outputs = ModelOutput(logits=outputs["logits"][rows], loss=per_token.sum(),
                                num_tokens=(inputs["labels"][rows] != -100).sum())
    return drive(metrics, InputFeature(labels=inputs["labels"][rows]), local_outputs, loss_reduction="sum")


def test_two_data_parallel_ranks_on_twinkles_mesh_equal_one_process():
    results = run_distributed(_two_ranks_with_twinkles_mesh, world_size=2, timeout=120)
    assert results[0] == results[1]
    inputs, outputs = transformers_step()
    single = drive([twinkle_megatron.LossMetric(None, None), twinkle_megatron.Accuracy(None, None)], inputs, outputs,
                   loss_reduction="sum")
    for key in ("loss", "accuracy", "correct_tokens", "total_tokens", "grad_norm"):
        assert results[0][key] == pytest.approx(single[key], rel=1e-6), key
    assert math.isfinite(results[0]["loss"])
