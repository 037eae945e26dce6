"""Every key of the tracker's record and of each metric is returned by exactly one ``compute``: its owner's.

Data flows one way: each object computes its part of the record from its own
synced states and returns it; nothing reads another object's states. The spy
(``kit/owners.py``) records what every ``compute`` returned during a log step,
and each key of the record must come from exactly one of them -- except the
counts two metrics report alike on purpose (``merge_results`` checks they agree).
"""

from __future__ import annotations

import torch
from kit.collection_cases import feed, global_batch, make_metrics
from kit.megatron_gpt import GPTSpec, make_batch
from kit.megatron_training import build_trained_gpt, train_forward_backward
from kit.owners import owners, spy_on_computes

from twinkle_megatron import Accuracy, LossMetric, MetricCollection, MetricsTracker, TokenStatsMetric, keys
from twinkle_megatron.megatron import HookFailures, instrument
from twinkle_megatron.metric import SampleLosses
from twinkle_megatron.testing.batches import RankView
from twinkle_megatron.testing.cuda_shim import cpu_cuda_shim
from twinkle_megatron.testing.distributed import Layout, run_distributed
from twinkle_megatron.testing.invariance import run_calls
from twinkle_megatron.tracker import MemorySnapshot, TrackerConfig
from twinkle_megatron.tracker import step_states as tracker_module

# Counts two metrics report alike on purpose (each from its own states; the merge checks they agree).
SHARED = {"nonfinite_tokens": {"Accuracy", "TokenStatsMetric"}}

TRACKER_OWNERS = {  # the tracker's keys (keys.TRACKER_KEYS) and the object that computes each
    "StepLoss": {keys.LOSS},
    "RankStates": {keys.GRAD_NORM, keys.LEARNING_RATE, keys.NONFINITE_LOSS_STEPS, keys.NONFINITE_GRAD_NORM_STEPS,
                   keys.NUM_ZEROS_IN_GRAD, *(k for k, _ in keys.TRACKER_KEYS if k.startswith(keys.MEMORY_PREFIX))},
    "Throughput": {keys.CONSUMED_TOKENS, keys.STEP_TIME, keys.STEP_TIME_MIN, keys.SLOWEST_RANK,
                   keys.TOKENS_PER_SECOND, keys.TOKENS_PER_SECOND_PER_GPU, keys.TFLOPS_PER_GPU, keys.MFU},
    "RecordSmoothing": {keys.LOSS_SPIKE, *keys.EMA_OF.values()},
}


def _assert_one_owner_each(record: dict, calls: list) -> dict[str, set[str]]:
    found = owners(record, calls)
    for key, classes in found.items():
        assert classes, f"{key!r}: no compute returned it"
        assert len(classes) == 1 or classes == SHARED.get(key), f"{key!r} is returned by {sorted(classes)}"
    return found


def test_every_tracker_key_has_one_owner(monkeypatch):
    """A GPU-like run (memory, a known peak, FLOPs) where every key of the tracker's table appears."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    snapshot = MemorySnapshot(allocated_gib=1.0, peak_allocated_gib=2.0, reserved_gib=3.0, peak_reserved_gib=4.0,
                              total_gib=80.0, alloc_retries=0, ooms=0)
    monkeypatch.setattr(tracker_module, "read_device_memory", lambda: snapshot)
    model = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64)
    tracker = MetricsTracker(config=TrackerConfig(log_interval=2, backends=(), model_config=model,
                                                  padded_vocab_size=128, seq_length=16, global_batch_size=4,
                                                  device_name="NVIDIA H100 80GB HBM3"))
    owned: dict[str, set[str]] = {}
    with spy_on_computes() as calls:
        for step in range(1, 5):
            calls.clear()
            record = tracker.end_step(step, loss=torch.tensor([8.0, 4.0]), grad_norm=1.0, lr=1e-3, tokens=64,
                                      num_zeros=0)
            for key, classes in (_assert_one_owner_each(record, calls) if record else {}).items():
                owned.setdefault(key, set()).update(classes)
    assert set(owned) == {key for key, _ in keys.TRACKER_KEYS}
    for owner, owned_keys in TRACKER_OWNERS.items():
        for key in owned_keys:
            assert owned[key] == {owner}, (key, owned[key])


SPEC = GPTSpec(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, max_sequence_length=8)


def _forward_step(data_iterator, model):
    from kit.megatron_gpt import gpt_forward_step

    return gpt_forward_step(data_iterator, model)


def _instrumented_run() -> list[tuple[dict, dict]]:
    """Megatron's schedule, instrument()'s metrics (per dataset), SampleLosses, per-layer norms, the tracker."""
    with cpu_cuda_shim():
        chunks, optimizer = build_trained_gpt(SPEC)
        metrics = instrument([c.module for c in chunks], [
            Accuracy(vocab_size=SPEC.vocab_size, group_names=["even", "odd"]),
            TokenStatsMetric(vocab_size=SPEC.vocab_size), LossMetric(group_names=["even", "odd"]), SampleLosses()])
        tracker = MetricsTracker(config=TrackerConfig(log_interval=1, backends=()), metrics=metrics.metrics)
        found = []
        with spy_on_computes() as calls:
            for step in (1, 2):
                batch = make_batch(SPEC, global_batch_size=8, seq_length=8, seed=step)
                batch["dataset_id"] = torch.arange(8) % 2
                batch["sample_index"] = torch.arange(8)
                tracker.start_step()
                train_forward_backward(chunks, batch, micro_batch_size=2,
                                       forward_step_func=metrics.wrap(_forward_step))
                tracker.record_grad_norms(chunks, optimizer)
                _, grad_norm, _ = optimizer.step()
                calls.clear()
                record = tracker.end_step(step, grad_norm=grad_norm, lr=1e-3, tokens=int(batch["labels"].numel()))
                found.append((record, {k: sorted(v) for k, v in owners(record, calls).items()}))
        metrics.detach()
    return found


def test_every_key_of_an_instrumented_megatron_run_has_one_owner():
    """Under TP×PP×DP with per-layer norms and per-dataset metrics: every key, one compute (every rank alike)."""
    results = run_distributed(_instrumented_run, layout=Layout(tp=2, pp=2), timeout=240)
    for rank_result in results:
        assert rank_result == results[0]  # the same record, and the same owners, on every rank
    for _, found in results[0]:
        for key, classes in found.items():
            assert classes, f"{key!r}: no compute returned it"
            assert len(classes) == 1 or set(classes) == SHARED.get(key), f"{key!r} is returned by {classes}"
        assert found[keys.LOSS] == ["LossMetric"] and found["loss/odd"] == ["LossMetric"]
        assert found["accuracy/even"] == ["Accuracy"] and found[keys.STEP_TIME] == ["Throughput"]
        assert found[keys.GRAD_NORM_TOTAL] == ["LayerNorms"] and found[keys.LOSS_EMA] == ["RecordSmoothing"]


def test_every_key_of_each_builtin_metric_has_one_owner():
    """All built-in metrics in one collection (and a hook failure): each key from one metric's compute."""
    collection = make_metrics((3, True))
    run_calls(collection, feed(collection, global_batch(), RankView()))
    failures = HookFailures()
    failures.record("a hook", ValueError("planted"))
    metrics = MetricCollection([*collection.metrics, failures])
    with spy_on_computes() as calls:
        result = metrics.calculate()
    found = _assert_one_owner_each(result, calls)
    assert found[keys.METRIC_HOOK_FAILURES] == {"HookFailures"} and found["accuracy"] == {"Accuracy"}
    assert found["pos_sim"] == {"EmbeddingMetric"} and found["rewards/accuracies"] == {"DPOMetric"}
