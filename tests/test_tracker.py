"""MetricsTracker: records, sync sharing, throughput, stragglers, anomalies, MFU, memory."""

from __future__ import annotations

import contextlib
import json
import math
import time

import pytest
import torch

from twinkle_megatron import LossMetric, MetricCollection, TrainMetric
from twinkle_megatron.testing.distributed import Layout, run_distributed
from twinkle_megatron.testing.guards import count_collectives, forbid_host_sync
from twinkle_megatron.tracker import MemorySnapshot, MetricsTracker, TrackerConfig, num_floating_point_operations
from twinkle_megatron.tracker import step_states as tracker_module


def quiet_tracker(**kwargs) -> MetricsTracker:
    """A tracker that writes nowhere (records come back from end_step)."""
    metrics = kwargs.pop("metrics", None)
    return MetricsTracker(config=TrackerConfig(backends=(), **kwargs), metrics=metrics)


def test_log_steps_and_megatron_loss_reports():
    tracker = quiet_tracker(log_interval=3)
    records = {}
    for step in range(1, 7):
        # Two microbatches, as forward_backward_func returns them: [loss sum, token count].
        losses = [{"lm loss": torch.tensor([6.0, 3.0])}, {"lm loss": torch.tensor([float(step), 1.0])}]
        labels = torch.tensor([[5, 6, -100, 7]])
        records[step] = tracker.end_step(step, loss=losses, grad_norm=torch.tensor(0.5 * step), lr=1e-4 * step,
                                         labels=labels, num_zeros=7)
    assert sorted(step for step, record in records.items() if record is not None) == [1, 3, 6]
    first, third, sixth = records[1], records[3], records[6]
    assert first["loss"] == pytest.approx((6 + 1) / 4)
    # Steps 2 and 3 pooled by tokens: (6 + 2 + 6 + 3) / (4 + 4).
    assert third["loss"] == pytest.approx(17 / 8)
    assert third["train/consumed_tokens"] == 9, "3 real tokens per step (one label is padding)"
    assert sixth["grad_norm"] == 3.0 and sixth["learning rate"] == pytest.approx(6e-4)
    assert sixth["train/num_zeros_in_grad"] == 7 and sixth["train/nonfinite_loss_steps"] == 0
    assert sixth["train/consumed_tokens"] == 18
    assert "perf/mfu" not in sixth and not any(key.startswith("memory/") for key in sixth), "CPU: no MFU, no memory"
    assert all(isinstance(value, (int, float)) for value in sixth.values())


def test_context_manager_and_step_numbering():
    tracker = quiet_tracker(log_interval=2)
    for _ in range(4):
        with tracker.step() as values:
            values.update(loss=torch.tensor(1.5), tokens=10)
    assert tracker.last_step == 4 and tracker.last_record["loss"] == 1.5
    assert tracker.last_record["train/consumed_tokens"] == 40 and tracker.last_record["perf/step_time"] >= 0


def test_end_step_never_syncs_with_the_host():
    tracker = quiet_tracker(log_interval=4, model_config=_small_config(), padded_vocab_size=128)
    with forbid_host_sync():
        for step in (2, 3):
            tracker.start_step()
            tracker.end_step(step, loss={"lm loss": torch.tensor([3.0, 2.0])}, grad_norm=torch.tensor(1.0),
                             lr=torch.tensor(1e-3), loss_mask=torch.ones(2, 8), num_zeros=torch.tensor(0.0),
                             seq_lengths=torch.tensor([3, 5]))
            tracker.end_step(step, loss=torch.tensor(float("nan")), labels=torch.zeros(2, 4, dtype=torch.long))
    assert tracker.end_step(4)["train/nonfinite_loss_steps"] == 2


def test_nonfinite_values_are_counted_and_left_out_of_the_loss():
    tracker = quiet_tracker(log_interval=3)
    tracker.end_step(1, loss=1.0)
    tracker.end_step(2, loss=torch.tensor(float("inf")), grad_norm=float("nan"))
    record = tracker.end_step(3, loss=torch.tensor([4.0, 2.0]), grad_norm=torch.tensor(1.0))
    assert record["loss"] == 2.0 and record["train/nonfinite_loss_steps"] == 1
    assert record["train/nonfinite_grad_norm_steps"] == 1


def test_loss_spike_against_the_smoothed_loss():
    tracker = quiet_tracker(log_interval=1, spike_threshold=0.5, ema_alpha=0.5)
    spikes = [tracker.end_step(loss=loss)["train/loss_spike"] for loss in (2.0, 2.0, 2.0, 2.9, 4.0, 2.0)]
    # EMA before each: -, 2, 2, 2, 2.45, 3.225: only 4.0 > 1.5·2.45.
    assert spikes == [0, 0, 0, 0, 1, 0]
    assert tracker.last_record["train/loss_ema"] == pytest.approx(0.5 * 2.0 + 0.5 * 3.225)


def test_mfu_only_against_a_known_peak():
    config, vocab = _small_config(), 128
    flops = num_floating_point_operations(config, 4, 16, vocab)
    common = dict(log_interval=1, model_config=config, padded_vocab_size=vocab, seq_length=16, global_batch_size=4)
    cpu = quiet_tracker(**common).end_step(1, tokens=64)
    assert "perf/mfu" not in cpu
    assert cpu["perf/tflops_per_gpu"] == pytest.approx(flops / (cpu["perf/step_time"] * 1e12))
    unknown = quiet_tracker(device_name="NVIDIA GeForce RTX 4090", **common).end_step(1, tokens=64)
    assert "perf/mfu" not in unknown
    h100 = quiet_tracker(device_name="NVIDIA H100 80GB HBM3", **common).end_step(1, tokens=64)
    assert h100["perf/mfu"] == pytest.approx(h100["perf/tflops_per_gpu"] / 989.5)
    pcie = quiet_tracker(device_name="NVIDIA H100 PCIe", **common).end_step(1, tokens=64)
    assert pcie["perf/mfu"] == pytest.approx(pcie["perf/tflops_per_gpu"] / 756.5)
    config.fp8 = "hybrid"  # FP8 training: MFU against the FP8 peak
    fp8 = quiet_tracker(device_name="NVIDIA H100 80GB HBM3", **common).end_step(1, tokens=64)
    assert fp8["perf/mfu"] == pytest.approx(fp8["perf/tflops_per_gpu"] / 1979.0)
    override = quiet_tracker(peak_tflops=0.5, **common).end_step(1, tokens=64)
    assert override["perf/mfu"] == pytest.approx(override["perf/tflops_per_gpu"] / 0.5)


def test_packed_sequence_lengths_give_the_flops():
    config, vocab = _small_config(), 128
    tracker = quiet_tracker(log_interval=2, model_config=config, padded_vocab_size=vocab, peak_tflops=1.0)
    tracker.end_step(1, seq_lengths=[4, 12])
    record = tracker.end_step(2, seq_lengths=torch.tensor([16, 2, 6]))
    expected = num_floating_point_operations(config, 1, 24, vocab, seq_lengths=[16, 2, 6])
    assert record["perf/tflops_per_gpu"] * record["perf/step_time"] * 1e12 == pytest.approx(expected)


def test_memory_record(monkeypatch):
    snapshot = MemorySnapshot(allocated_gib=10.0, peak_allocated_gib=30.0, reserved_gib=40.0,
                              peak_reserved_gib=60.0, total_gib=80.0, alloc_retries=2, ooms=0)
    monkeypatch.setattr(tracker_module, "read_device_memory", lambda: snapshot)
    record = quiet_tracker(log_interval=1).end_step(1)
    assert record["memory/peak_reserved_gib"] == 60.0 and record["memory/utilization"] == 0.75
    assert record["memory/alloc_retries"] == 2 and record["memory/total_gib"] == 80.0


def test_metric_keys_clashing_with_the_tracker_are_refused():
    loss_metric = LossMetric()
    tracker = quiet_tracker(log_interval=1, metrics=[loss_metric])
    loss_metric.accumulate({}, {"loss": 1.0, "grad_norm": 0.5})
    with pytest.raises(ValueError, match=r"reports 'loss', which MetricsTracker \(end_step's values\) reports too"):
        tracker.end_step(1, loss=2.0, grad_norm=0.5)  # the same grad norm from both is no clash


def test_state_dict_continues_steps_totals_and_ema():
    tracker = quiet_tracker(log_interval=2)
    for _ in range(4):
        tracker.end_step(loss=3.0, tokens=5)
    resumed = quiet_tracker(log_interval=2)
    resumed.load_state_dict(tracker.state_dict())
    resumed.end_step(loss=1.0, tokens=5)
    record = resumed.end_step(loss=1.0, tokens=5)
    assert resumed.last_step == 6 and record["train/consumed_tokens"] == 30
    weight = 1 - 0.9 ** 2  # the interval of two steps blended in with the weight of two per-step updates
    assert record["train/loss_ema"] == pytest.approx(weight * 1.0 + (1 - weight) * 3.0)


# ---------------------------------------------------------------- multi-rank


def _small_config():
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64)


def _rank_labels(dp_rank: int, cp_rank: int) -> torch.Tensor:
    """Local labels of a (DP, CP) coordinate: 8 positions, 1 + dp + cp of them padding."""
    labels = torch.arange(8).reshape(1, 8)
    labels[0, : 1 + dp_rank + cp_rank] = -100
    return labels


def _global_tokens_and_one_sync() -> tuple[list, list]:
    from megatron.core import parallel_state as ps

    collection = MetricCollection([LossMetric(), TrainMetric()])
    tracker = quiet_tracker(log_interval=2, metrics=collection)
    dp, cp = ps.get_data_parallel_rank(), ps.get_context_parallel_rank()
    records, counts = [], []
    for step in (1, 2, 3, 4):
        labels = _rank_labels(dp, cp)
        collection.accumulate({"labels": labels}, {"loss": torch.tensor(2.0), "lr": 1e-3, "step": step})
        with count_collectives() as counted:
            record = tracker.end_step(step, labels=labels)  # the loss goes to LossMetric
        records.append(record)
        counts.append(dict(counted))
    return records, counts


def test_tokens_are_real_and_global_and_the_tracker_shares_the_one_sync():
    layout = Layout(tp=2, cp=2, dp=2)
    results = run_distributed(_global_tokens_and_one_sync, layout=layout)
    # Each (DP, CP) coordinate has 8 − (1 + dp + cp) real tokens; TP duplicates count once.
    tokens_per_step = sum(8 - (1 + dp + cp) for dp in range(2) for cp in range(2))
    for records, counts in results:
        # Logging steps 1, 2, 4: the collection's two all-reduces and nothing more; step 3: nothing.
        assert counts == [{"all_reduce": 2}, {"all_reduce": 2}, {}, {"all_reduce": 2}]
        assert records[2] is None
        last = records[3]
        assert records[1]["train/consumed_tokens"] == 2 * tokens_per_step
        assert last["train/consumed_tokens"] == 4 * tokens_per_step
        seconds = last["perf/step_time"] * 2  # two steps in the interval
        assert last["perf/tokens_per_second"] == pytest.approx(2 * tokens_per_step / seconds)
        assert last["perf/tokens_per_second_per_gpu"] == pytest.approx(last["perf/tokens_per_second"] / 8)
        assert last["loss"] == 2.0 and last["iters"] == 4 and last["learning rate"] == 1e-3
        assert last["train/loss_ema"] == 2.0, "a metric's loss is smoothed like the tracker's own"
    timing_free = [{k: v for k, v in r[0][3].items() if "second" not in k and "time" not in k
                    and k != "perf/slowest_rank" and k != "speed" and k != "total time elapse"} for r in results]
    assert all(r == timing_free[0] for r in timing_free), "every rank gets the same record"


def _one_slow_rank(slow_rank: int) -> dict:
    import torch.distributed as dist

    tracker = quiet_tracker(log_interval=2)
    tracker.end_step(1)
    with tracker.step(2):
        if dist.get_rank() == slow_rank:
            time.sleep(0.3)
    return tracker.last_record


def test_step_time_min_max_and_slowest_rank():
    results = run_distributed(_one_slow_rank, 4, args=(2,))
    for record in results:
        assert record["perf/slowest_rank"] == 2
        assert record["perf/step_time"] >= 0.3 and record["perf/step_time_min"] < 0.1
        assert record == results[0]


def _nan_on_one_rank() -> dict:
    import torch.distributed as dist

    tracker = quiet_tracker(log_interval=2)
    rank = dist.get_rank()
    tracker.end_step(1, loss=torch.tensor([2.0, 1.0]))
    # Pipeline groups [0, 2] and [1, 3]: ranks 2 and 3 are the last stage. Rank 3 blows up at step 2.
    loss = torch.tensor([float("nan") if rank == 3 else 6.0, 3.0])
    grad_norm = torch.tensor(float("inf")) if rank == 0 else torch.tensor(1.0)
    return tracker.end_step(2, loss=loss, grad_norm=grad_norm)


def test_a_nan_loss_on_one_rank_is_reported_on_every_rank():
    results = run_distributed(_nan_on_one_rank, layout=Layout(pp=2, dp=2))
    for record in results:
        assert record["train/nonfinite_loss_steps"] == 1 and record["train/nonfinite_grad_norm_steps"] == 1
        assert record["loss"] == 2.0, "the NaN is left out: rank 2's 6 / 3"
        assert math.isfinite(record["train/loss_ema"])


def _memory_max_over_ranks() -> dict:
    import torch.distributed as dist

    rank = dist.get_rank()
    snapshot = MemorySnapshot(allocated_gib=rank, peak_allocated_gib=rank, reserved_gib=rank,
                              peak_reserved_gib=10.0 * (rank + 1), total_gib=80.0, alloc_retries=rank, ooms=0)
    tracker_module.read_device_memory = lambda: snapshot  # forked worker: the patch dies with it
    return quiet_tracker(log_interval=1).end_step(1)


def test_memory_is_the_max_over_ranks():
    results = run_distributed(_memory_max_over_ranks, 3)
    for record in results:
        assert record["memory/peak_reserved_gib"] == 30.0 and record["memory/alloc_retries"] == 2
        assert record["memory/utilization"] == pytest.approx(30.0 / 80.0)


class FakeCudaEvent:
    """Stands in for torch.cuda.Event: 'GPU time' is the host clock; counts creations and syncs."""

    created = synchronized = 0

    def __init__(self, enable_timing=False):
        assert enable_timing
        FakeCudaEvent.created += 1
        self.seconds = None

    def record(self):
        self.seconds = time.perf_counter()

    def synchronize(self):
        FakeCudaEvent.synchronized += 1

    def elapsed_time(self, end):
        return (end.seconds - self.seconds) * 1000.0


def test_gpu_timing_reads_events_once_per_interval(monkeypatch):
    from twinkle_megatron.tracker import StepTimer

    monkeypatch.setattr(torch.cuda, "Event", FakeCudaEvent)
    timer = StepTimer(use_cuda_events=True)
    assert FakeCudaEvent.created == 0, "no CUDA event (nor context) at construction"
    timer.stop()  # first step without start: from construction, host clock
    timer.start()
    time.sleep(0.02)
    timer.stop()
    time.sleep(0.01)
    timer.stop()  # without start: from the previous stop
    assert FakeCudaEvent.synchronized == 0, "stepping never waits for the GPU"
    durations = timer.collect()
    assert FakeCudaEvent.synchronized == 1 and len(durations) == 3
    assert 0.02 <= durations[1] < 0.2 and 0.01 <= durations[2] < 0.2
    assert timer.collect() == [] and FakeCudaEvent.synchronized == 1


@pytest.mark.parametrize("field, value", [("log_interval", 0), ("log_interval", 2.5), ("precision", "fp4"),
                                          ("ema_alpha", 0.0), ("spike_threshold", -1.0), ("writer_rank", -1),
                                          ("seq_length", 0), ("backends", ("stdout", "nope"))])
def test_tracker_config_refuses_bad_values_naming_the_field(field, value):
    from twinkle_megatron import TrackerConfig

    with pytest.raises(ValueError, match=f"TrackerConfig.{field} must be"):
        TrackerConfig(**{field: value})
    with pytest.raises(ValueError, match=f"TrackerConfig.{field} must be"):
        MetricsTracker(**{field: value})


def test_tracker_config_and_keywords_are_the_same_tracker():
    from twinkle_megatron import TrackerConfig

    config = TrackerConfig(log_interval=3, backends=(), ema_alpha=0.5, run_config={"seed": 1})
    by_config, by_keywords = MetricsTracker(config), MetricsTracker(log_interval=3, backends=(), ema_alpha=0.5,
                                                                      run_config={"seed": 1})
    assert by_config.config == by_keywords.config == config
    overridden = MetricsTracker(config, log_interval=5)
    assert overridden.config.log_interval == 5 and overridden.config.ema_alpha == 0.5
    with pytest.raises(ValueError, match="model_config needs padded_vocab_size"):
        TrackerConfig(model_config=object())


def test_a_loss_metrics_nonfinite_loss_flags_the_step_and_the_loss_reads_nan(tmp_path, capsys):
    """The loop of docs/step-health.md: no loss= to end_step, a LossMetric among the tracker's metrics; a NaN
    loss it counts is a non-finite-loss step, the loss reads NaN (null in the file), an incident is printed and
    written without SampleLosses or layer norms; an fp16 step Megatron skipped is counted."""
    loss = LossMetric()
    tracker = MetricsTracker(config=TrackerConfig(log_interval=3, backends=("stdout", "jsonl"), log_dir=str(tmp_path)),
                             metrics=[loss])
    values = {1: [2.0, 2.0], 2: [2.0, 2.0], 3: [2.0, 2.0], 4: [2.0, float("nan")], 5: [float("nan")] * 2,
              6: [float("nan")]}
    records = {}
    for step, losses in values.items():
        with forbid_host_sync() if step in (2, 4, 5) else contextlib.nullcontext():  # no log step
            loss.accumulate([{}] * len(losses), {"loss": [torch.tensor(v) for v in losses]})
            records[step] = tracker.end_step(step, update_successful=step != 6, grad_norm=None if step == 6 else 1.0)
    tracker.close()
    assert records[3]["train/nonfinite_loss_steps"] == 0 and records[3]["loss"] == 2.0
    assert records[6]["train/nonfinite_loss_steps"] == 3 and records[6]["nonfinite_losses"] == 4
    assert records[6]["loss"] == 2.0 and records[6]["train/skipped_steps"] == 1  # step 4's finite value
    out = capsys.readouterr().out
    assert "NONFINITE_LOSS_STEPS 3 | NONFINITE_LOSSES 4 | SKIPPED_STEPS 1" in out
    assert "[incident] step 6: nonfinite_loss (loss 2" in out
    lines = (tmp_path / "incidents.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [6]

    only_nan = LossMetric()
    tracker = MetricsTracker(config=TrackerConfig(log_interval=1, backends=("stdout", "jsonl"),
                                                  log_dir=str(tmp_path / "nan")), metrics=[only_nan])
    only_nan.accumulate([{}], {"loss": [torch.tensor(float("nan"))]})
    record = tracker.end_step(1)
    assert record["loss"] != record["loss"] and record["train/nonfinite_loss_steps"] == 1
    assert "step 1 | loss nan |" in capsys.readouterr().out
    written = json.loads((tmp_path / "nan" / "metrics.jsonl").read_text(),
                         parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}"))
    assert written["loss"] is None and written["nonfinite"]["/loss"] == "NaN"


def test_an_embedding_metrics_nonfinite_loss_flags_the_step(capsys):
    """Any loss metric among the tracker's (a ``nonfinite_loss_state``), not only LossMetric: EmbeddingMetric's
    NaN loss at step 2 is a non-finite-loss step; step 1's finite loss is not."""
    from twinkle_megatron import EmbeddingMetric

    metric = EmbeddingMetric()
    tracker = MetricsTracker(config=TrackerConfig(log_interval=2, backends=("stdout",)), metrics=[metric])
    embeddings = torch.tensor([[1.0, 0.0], [3.0, 0.0], [0.0, 2.0], [3.0, 3.0]])
    flags = {}
    for step, value in ((1, 0.7), (2, float("nan"))):
        metric.accumulate({"labels": torch.tensor([1, 0, 1, 0])},
                          {"embeddings": embeddings, "loss": torch.tensor(value, dtype=torch.float64)})
        flags[step] = tracker.end_step(step)["train/nonfinite_loss_steps"]
    tracker.close()
    assert flags == {1: 0, 2: 1}
    assert "[incident] step 2: nonfinite_loss" in capsys.readouterr().out


def test_a_nan_microbatch_report_beside_per_token_losses_keeps_the_finer_loss():
    """Megatron's reports given to end_step and a LossMetric fed the per-token losses of the same microbatches:
    a NaN report drops its whole microbatch from end_step's loss while the metric keeps the microbatch's healthy
    tokens. The record's loss is the metric's (not a clash); with finite reports the two agree exactly."""
    tokens = [torch.tensor([[1.0, 5.0]], dtype=torch.float64), torch.tensor([[2.0, float("nan")]], dtype=torch.float64)]
    labels = {"labels": torch.tensor([[1, 2]])}
    metric = LossMetric()
    tracker = MetricsTracker(config=TrackerConfig(log_interval=1, backends=()), metrics=[metric])
    reports = [{"lm loss": torch.tensor([t.nansum().item() if t.isfinite().all() else float("nan"), 2.0],
                                        dtype=torch.float64)} for t in tokens]
    metric.accumulate([labels, labels], {"loss": [r["lm loss"][0] for r in reports], "num_tokens": [2, 2],
                                         "token_losses": tokens}, loss_reduction="sum")
    record = tracker.end_step(1, loss=reports)
    assert record["loss"] == pytest.approx((1.0 + 5.0 + 2.0) / 3)  # the healthy tokens, NaN microbatch's included
    assert record["train/nonfinite_loss_steps"] == 1
    tracker.close()
