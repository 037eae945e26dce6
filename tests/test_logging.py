"""Logging backends: round trips, failures that never stop training, one writing rank, resumes."""

from __future__ import annotations

import json
import os
import sys
import types
import warnings

import pytest
import torch
from distributed import run_distributed

from twinkle_megatron.logging import (
    Backend,
    JsonlBackend,
    MetricsLogger,
    MlflowBackend,
    StdoutBackend,
    SwanLabBackend,
    TensorBoardBackend,
    WandbBackend,
    build_backend,
    read_jsonl,
)
from twinkle_megatron.tracker import MetricsTracker


def test_jsonl_round_trip(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    logger = MetricsLogger([JsonlBackend(str(path))])
    logger.log({"loss": 2.5, "tokens": 128, "mfu": 0.41, "histogram": [1, 2], "note": "x", "bad": float("nan")}, 1)
    logger.log({"loss": 2.25, "memory/peak_reserved_gib": 60.5, "loss_spike": True}, 10)
    logger.close()
    lines = path.read_text().splitlines()
    assert [json.loads(line) for line in lines] == read_jsonl(str(path)) == [
        {"step": 1, "loss": 2.5, "tokens": 128, "mfu": 0.41, "bad": None},  # numbers only; NaN is not JSON
        {"step": 10, "loss": 2.25, "memory/peak_reserved_gib": 60.5, "loss_spike": 1},
    ]


def test_stdout_line(capsys):
    logger = MetricsLogger([StdoutBackend()])
    logger.log({"loss": 2.34567, "tokens_per_second": 12345.6, "mfu": 0.412, "step_time": 1.5, "accuracy": 0.5,
                "nonfinite_loss_steps": 1, "loss_spike": 0}, 7)
    line = capsys.readouterr().out.strip()
    assert line == ("step 7 | loss 2.3457 | accuracy 0.5000 | tokens/s 12,346 | mfu 41.2% | step_time 1.500s | "
                    "NONFINITE_LOSS_STEPS 1")


def test_tensorboard_scalars_read_back_and_resume_purges(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_dir = str(tmp_path / "tb")
    first = MetricsLogger([TensorBoardBackend(log_dir)])
    for step in (1, 2, 3, 4):
        first.log({"loss": 10.0 - step, "tokens_per_second": 100.0 * step}, step)
    first.close()
    resumed = MetricsLogger([TensorBoardBackend(log_dir)])
    resumed.resume(2)  # the checkpoint was at step 2: steps 3 and 4 are redone
    for step in (3, 4, 5):
        resumed.log({"loss": 20.0 + step}, step)
    resumed.close()
    events = EventAccumulator(log_dir)
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 9.0), (2, 8.0), (3, 23.0), (4, 24.0),
                                                                   (5, 25.0)]
    assert [e.step for e in events.Scalars("tokens_per_second")] == [1, 2]


class ExplodingBackend(Backend):
    name = "exploding"

    def __init__(self):
        self.writes = 0

    def write(self, record, step):
        self.writes += 1
        raise OSError("disk full")


def test_a_failing_write_warns_once_and_training_continues(tmp_path):
    exploding, jsonl = ExplodingBackend(), JsonlBackend(str(tmp_path / "m.jsonl"))
    tracker = MetricsTracker(log_interval=1, backends=[exploding, jsonl])
    with pytest.warns(RuntimeWarning, match=r"'exploding' failed and is disabled.*disk full") as caught:
        for _ in range(3):
            tracker.end_step(loss=1.0)
    tracker.close()
    assert len([w for w in caught if "exploding" in str(w.message)]) == 1
    assert exploding.writes == 1 and [r["step"] for r in read_jsonl(jsonl.path)] == [1, 2, 3]


def test_a_backend_that_cannot_be_imported_warns_once(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # "import wandb" raises ImportError
    jsonl = JsonlBackend(str(tmp_path / "m.jsonl"))
    tracker = MetricsTracker(log_interval=1, backends=["wandb", jsonl], log_dir=str(tmp_path))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            tracker.end_step(loss=1.0)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    tracker.close()
    assert len(messages) == 1 and "'wandb'" in messages[0] and "ModuleNotFoundError" in messages[0]
    assert len(read_jsonl(jsonl.path)) == 3


class FakeRun:
    def __init__(self, calls):
        self.calls = calls

    def log(self, record, step):
        self.calls.append(("log", record, step))

    def finish(self):
        self.calls.append(("finish",))


def test_wandb_resumes_the_slurm_job_run(monkeypatch):
    calls = []
    fake = types.SimpleNamespace(init=lambda **kwargs: calls.append(("init", kwargs)) or FakeRun(calls))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    logger = MetricsLogger([WandbBackend(project="p", config={"lr": 1e-4})])
    logger.log({"loss": 1.0}, 5)
    logger.close()
    assert calls == [("init", {"project": "p", "config": {"lr": 1e-4}, "id": "4242", "resume": "allow"}),
                     ("log", {"loss": 1.0}, 5), ("finish",)]
    calls.clear()
    MetricsLogger([WandbBackend(run_id="abc")]).log({"loss": 2.0}, 6)
    assert calls[0][1]["id"] == "abc", "an explicit run id wins over SLURM_JOB_ID"


def test_swanlab_and_mlflow_adapters(monkeypatch):
    calls = []
    swanlab = types.SimpleNamespace(init=lambda **kw: calls.append(("swanlab.init", kw)),
                                    log=lambda record, step: calls.append(("swanlab.log", record, step)),
                                    finish=lambda: calls.append(("swanlab.finish",)))
    mlflow = types.SimpleNamespace(
        set_tracking_uri=lambda uri: calls.append(("mlflow.uri", uri)),
        set_experiment=lambda name: calls.append(("mlflow.experiment", name)),
        start_run=lambda run_id=None, run_name=None: calls.append(("mlflow.start", run_id, run_name)),
        log_metrics=lambda record, step: calls.append(("mlflow.log", record, step)),
        end_run=lambda: calls.append(("mlflow.end",)))
    monkeypatch.setitem(sys.modules, "swanlab", swanlab)
    monkeypatch.setitem(sys.modules, "mlflow", mlflow)
    logger = MetricsLogger([SwanLabBackend(project="p", run_id="r1"),
                            MlflowBackend(experiment="e", run_name="n", tracking_uri="file:///tmp/x")])
    logger.log({"loss": 1.5}, 3)
    logger.close()
    assert calls == [
        ("swanlab.init", {"project": "p", "id": "r1", "resume": "allow"}), ("swanlab.log", {"loss": 1.5}, 3),
        ("mlflow.uri", "file:///tmp/x"), ("mlflow.experiment", "e"), ("mlflow.start", None, "n"),
        ("mlflow.log", {"loss": 1.5}, 3),
        ("swanlab.finish",), ("mlflow.end",),
    ]


def test_backends_by_name(tmp_path):
    assert build_backend("jsonl", str(tmp_path)).path == os.path.join(str(tmp_path), "metrics.jsonl")
    assert build_backend("tensorboard", str(tmp_path)).log_dir == os.path.join(str(tmp_path), "tensorboard")
    with pytest.raises(ValueError, match="unknown logging backend"):
        build_backend("csv")


def _write_from(writer_rank: int, directory: str) -> bool:
    import torch.distributed as dist

    path = os.path.join(directory, f"rank{dist.get_rank()}.jsonl")
    tracker = MetricsTracker(log_interval=1, backends=[JsonlBackend(path)], writer_rank=writer_rank)
    tracker.end_step(loss=torch.tensor(1.0))
    tracker.close()
    return os.path.exists(path)


def test_only_the_writer_rank_writes(tmp_path):
    assert run_distributed(_write_from, 3, args=(0, str(tmp_path / "a"))) == [True, False, False]
    assert run_distributed(_write_from, 3, args=(2, str(tmp_path / "b"))) == [False, False, True]


def test_resume_from_a_state_dict_continues_steps_without_duplicates(tmp_path):
    path = str(tmp_path / "metrics.jsonl")
    first = MetricsTracker(log_interval=2, backends=[JsonlBackend(path)])
    for step in range(1, 11):
        first.end_step(step, loss=10.0, tokens=4)
        if step == 6:
            checkpoint = first.state_dict()  # saved with the model at step 6
    first.close()  # then the job dies at step 10
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 4, 6, 8, 10]
    resumed = MetricsTracker(log_interval=2, backends=[JsonlBackend(path)])
    resumed.load_state_dict(checkpoint)
    for _ in range(6):
        resumed.end_step(loss=20.0, tokens=4)  # steps 7..12, numbered by the tracker
    resumed.close()
    records = read_jsonl(path)
    assert [r["step"] for r in records] == [1, 2, 4, 6, 8, 10, 12]
    assert [r["loss"] for r in records] == [10.0] * 4 + [20.0] * 3, "steps 8 and 10 are the resumed run's"
    assert records[-1]["tokens_total"] == 12 * 4


def test_log_eval_writes_eval_keys_at_the_training_step(tmp_path):
    from twinkle_megatron import LossMetric

    path = str(tmp_path / "metrics.jsonl")
    tracker = MetricsTracker(log_interval=1, backends=[JsonlBackend(path)])
    tracker.end_step(loss=2.0)
    metric = LossMetric()
    metric.accumulate({}, {"loss": 1.5})
    record = tracker.log_eval(metrics=[metric], perplexity=torch.tensor(4.0))
    tracker.close()
    assert record == {"eval/loss": 1.5, "eval/perplexity": 4.0}
    assert read_jsonl(path)[-1] == {"step": 1, "eval/loss": 1.5, "eval/perplexity": 4.0}
