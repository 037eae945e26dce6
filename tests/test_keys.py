"""The tracker's keys: one documented, stable table (twinkle_megatron.keys, docs/tracker.md), and nothing else."""

from __future__ import annotations

import torch
from kit.readme import key_table

from twinkle_megatron import keys
from twinkle_megatron.tracker import MemorySnapshot, MetricsTracker, TrackerConfig, num_floating_point_operations
from twinkle_megatron.tracker import step_states as tracker_module


def test_the_docs_list_exactly_the_key_table():
    assert key_table("tracker") == [key for key, _ in keys.TRACKER_KEYS]


def test_every_key_the_tracker_reports_is_in_the_table(monkeypatch):
    """A GPU-like run (memory, a known peak, FLOPs, a non-finite value): every tracker key appears, none else."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    snapshot = MemorySnapshot(allocated_gib=1.0, peak_allocated_gib=2.0, reserved_gib=3.0, peak_reserved_gib=4.0,
                              total_gib=80.0, alloc_retries=0, ooms=0)
    monkeypatch.setattr(tracker_module, "read_device_memory", lambda: snapshot)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64)
    tracker = MetricsTracker(config=TrackerConfig(log_interval=2, backends=(), model_config=config,
                                                  padded_vocab_size=128, seq_length=16, global_batch_size=4,
                                                  device_name="NVIDIA H100 80GB HBM3"))
    assert tracker.flops_per_step == num_floating_point_operations(config, 4, 16, 128)
    reported = set()
    for step in range(1, 5):
        record = tracker.end_step(step, loss=torch.tensor([8.0, 4.0]), grad_norm=1.0, lr=1e-3, tokens=64,
                                  num_zeros=0)
        reported |= set(record or {})
    assert reported == {key for key, _ in keys.TRACKER_KEYS}


def test_names_are_grouped_and_twinkles_are_kept():
    for key, meaning in keys.TRACKER_KEYS:
        assert meaning
        assert key in (keys.LOSS, keys.GRAD_NORM, keys.LEARNING_RATE) or key.split("/")[0] in (
            "train", "perf", "memory"), key
    assert (keys.LOSS, keys.GRAD_NORM, keys.LEARNING_RATE) == ("loss", "grad_norm", "learning rate")
