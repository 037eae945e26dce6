"""Logging without a logging library: JSONL round trips and restarts, stdout, failing backends, one writing rank.

The backends of TensorBoard, W&B, MLflow and SwanLab are tested against the real
packages, read back by each tool's own reader, in test_backends.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

from twinkle_megatron.logging import (
    Backend,
    JsonlBackend,
    MetricsLogger,
    RunStart,
    StdoutBackend,
    build_backend,
    read_jsonl,
)
from twinkle_megatron.logging.stdout import significant
from twinkle_megatron.testing.distributed import run_distributed
from twinkle_megatron.tracker import MetricsTracker, TrackerConfig


def test_jsonl_round_trip(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    logger = MetricsLogger([JsonlBackend(str(path))])
    logger.log({"loss": 2.5, "tokens": 128, "mfu": 0.41, "histogram": [1, 2], "note": "x", "bad": float("nan")}, 1)
    logger.log({"loss": 2.25, "memory/peak_reserved_gib": 60.5, "train/loss_spike": True}, 10)
    logger.close()
    lines = path.read_text().splitlines()
    assert [json.loads(line) for line in lines] == read_jsonl(str(path)) == [
        {"step": 1, "loss": 2.5, "tokens": 128, "mfu": 0.41, "bad": None,  # numbers only; NaN is not JSON:
         "nonfinite": {"/bad": "NaN"}},  # null, and what it was
        {"step": 10, "loss": 2.25, "memory/peak_reserved_gib": 60.5, "train/loss_spike": 1},
    ]


def test_stdout_line(capsys):
    logger = MetricsLogger([StdoutBackend()])
    logger.log({"loss": 2.34567, "perf/tokens_per_second": 12345.6, "perf/mfu": 0.412, "perf/step_time": 1.5,
                "accuracy": 0.5, "train/nonfinite_loss_steps": 1, "train/loss_spike": 0, "learning rate": 3e-4,
                "train/consumed_tokens": 4096}, 7)
    line = capsys.readouterr().out.strip()
    assert line == ("step 7 | loss 2.3457 | lr 3.00e-04 | accuracy 0.5000 | mfu 41.2% | step_time 1.500s | "
                    "NONFINITE_LOSS_STEPS 1")  # compact: the global tokens/s and the token total are in the record


def test_stdout_full_line(capsys):
    logger = MetricsLogger([StdoutBackend(detail="full")])
    logger.log({"loss": 2.34567, "perf/tokens_per_second": 12345.6, "perf/mfu": 0.412, "perf/step_time": 1.5,
                "accuracy": 0.5, "train/nonfinite_loss_steps": 1, "learning rate": 3e-4, "entropy": 2.5}, 7)
    line = capsys.readouterr().out.strip()
    assert line == ("step 7 | loss 2.3457 | lr 3.00e-04 | accuracy 0.5000 | entropy 2.5000 | tokens/s 12,346 | "
                    "mfu 41.2% | step_time 1.500s | NONFINITE_LOSS_STEPS 1")
    with pytest.raises(ValueError, match=r"detail=.*one of \('compact', 'full'\), got 'short'"):
        StdoutBackend(detail="short")


@pytest.mark.parametrize("value, decimals, text", [
    (2.34567, 4, "2.3457"), (0.0031234, 1, "0.00312"), (41.25, 1, "41.2"), (12345.6, 0, "12346"),
    (0.5, 0, "0.500"), (0.00031, 3, "0.000310"), (3.2e-9, 2, "3.20e-09"), (0.0, 1, "0"), (-0.0123, 4, "-0.0123"),
    (float("nan"), 1, "nan"),
])
def test_stdout_numbers_keep_three_significant_digits(value, decimals, text):
    assert significant(value, decimals) == text


def test_stdout_on_a_cpu_shows_small_throughput_not_zero(capsys):
    StdoutBackend().write({"perf/tflops_per_gpu": 0.0031234, "perf/tokens_per_second_per_gpu": 0.75,
                           "perf/step_time": 0.00042}, 3)
    assert capsys.readouterr().out.strip() == "step 3 | tokens/s/gpu 0.750 | TFLOP/s/gpu 0.00312 | step_time 0.000420s"


def test_stdout_compact_line_with_extra_keys(capsys):
    StdoutBackend(extra_keys=("accuracy/easy", "loss/hard", "absent")).write(
        {"loss": 2.0, "accuracy": 0.5, "accuracy/easy": 1.0, "accuracy/hard": 0.25, "loss/hard": 3.339912}, 4)
    assert capsys.readouterr().out.strip() == "step 4 | loss 2.0000 | accuracy 0.5000 | accuracy/easy 1.0000 | " \
                                              "loss/hard 3.3399"
    with pytest.raises(TypeError, match="sequence of keys"):
        StdoutBackend(extra_keys="accuracy/easy")


def test_stdout_prints_per_dataset_keys_like_their_metric(capsys):
    logger = MetricsLogger([StdoutBackend(detail="full")])
    logger.log({"accuracy": 0.5, "accuracy/easy": 1.0, "correct_tokens/easy": 2480.0, "total_tokens/easy": 2480.0,
                "loss/hard": 3.339912, "eval/accuracy": 0.25, "rewards/margins": 0.123456789}, 3)
    line = capsys.readouterr().out.strip()
    assert line == ("step 3 | accuracy 0.5000 | accuracy/easy 1.0000 | loss/hard 3.3399 | eval/accuracy 0.2500 | "
                    "rewards/margins 0.123457")  # the token counts behind the accuracy stay in the record


def _every_documented_key() -> dict:
    """A record holding every key docs/tracker.md, docs/moe.md and docs/step-health.md name, each value distinct,
    with the metrics' keys, per-dataset and evaluation keys, and the per-layer keys (norms, MoE)."""
    from twinkle_megatron import keys
    from twinkle_megatron.tracker.layer_norms import compact_view

    names = [key for key, _ in keys.TRACKER_KEYS + keys.MOE_KEYS]
    names += ["accuracy", "correct_tokens", "total_tokens", "logprob", "entropy", "accuracy/easy",
              "correct_tokens/easy", "loss/hard", "rewards/margins", "eval/loss", "eval/accuracy", keys.GRAD_NORM_TOTAL]
    record = {key: 0.25 + index for index, key in enumerate(names)}
    for alarm in (keys.NONFINITE_TOKENS, keys.INVALID_LABELS, keys.METRIC_HOOK_FAILURES, keys.MISALIGNED_ARRAYS):
        record[alarm] = 2
    record.update(compact_view([0.5, 3.0, 1.0]))
    record.update({keys.layer_grad_norm_key(part): 1.5 for part in ("layer_00", "embedding", "output_layer",
                                                                    "final_norm", "other")})
    record.update({keys.layer_param_norm_key("layer_00"): 7.5, keys.moe_layer_key(0, "expert_1_utilization"): 0.5,
                   keys.moe_layer_key(3, "utilization_max"): 1.75})
    return record


LEFT_OUT = ("correct_tokens", "total_tokens", "correct_tokens/easy",  # the accuracy's counts
            "grad_norm/layer_00", "grad_norm/embedding", "grad_norm/output_layer", "grad_norm/final_norm",
            "grad_norm/other", "param_norm/layer_00", "moe/layer_0/expert_1_utilization",
            "moe/layer_3/utilization_max")  # per-layer keys


def test_stdout_full_line_prints_every_documented_key_but_the_per_layer_ones_and_the_token_counts():
    """docs/backends.md: the full line prints every numeric key except the keys that grow with the model and the
    token counts behind the accuracy. A key is on the line when taking it out of the record changes the line."""
    from twinkle_megatron import keys

    record = _every_documented_key()
    console = StdoutBackend(detail="full")
    line = console.line(record, 5)
    for key in record:
        without = console.line({k: v for k, v in record.items() if k != key}, 5)
        assert (without != line) == (key not in LEFT_OUT), f"{key}: {'left out of' if without == line else 'on'} " \
                                                              f"the full line {line!r}"
    assert line.count(" | ") == len(record) - len(LEFT_OUT)  # 'step 5', then one part per key: each key once
    assert f"LOSS_SPIKE {record[keys.LOSS_SPIKE]}" in line and "LOSS_SPIKE" not in console.line(
        {**record, keys.LOSS_SPIKE: 0}, 5)  # an anomaly count is shown when non-zero
    assert all(f" | {alarm} 2" in line for alarm in ("NONFINITE_TOKENS", "INVALID_LABELS", "METRIC_HOOK_FAILURES",
                                                     "MISALIGNED_ARRAYS"))
    assert "grad_norm/total 55.250 | max_layer 1 | max_layer_norm 3.000 | max_layer/median 3.00x" in line
    assert "eval/accuracy" in line and "accuracy/easy" in line


def test_stdout_compact_line_shows_the_total_gradient_norm_and_the_largest_layer(capsys):
    """docs/step-health.md: the console line shows grad_norm/total and the layer with the largest norm."""
    from twinkle_megatron.tracker.layer_norms import compact_view

    record = {"loss": 2.0, "grad_norm": 1.25, "grad_norm/total": 1.25, "grad_norm/layer_00": 0.5,
              "grad_norm/layer_01": 3.0, "grad_norm/embedding": 0.2, "param_norm/layer_00": 9.0,
              **compact_view([0.5, 3.0, 1.0])}
    StdoutBackend().write(record, 10)
    assert capsys.readouterr().out.strip() == ("step 10 | loss 2.0000 | grad_norm 1.250 | grad_norm/total 1.250 | "
                                               "max_layer 1 | max_layer/median 3.00x")


def test_stdout_compact_line_of_an_evaluation_step_shows_its_values(tmp_path, capsys):
    """An evaluation logged by the tracker (``log_eval``) reaches the compact line, each value formatted like the
    key it evaluates; a training step's compact line shows the evaluation values it holds as well."""
    from twinkle_megatron import Accuracy, LossMetric

    tracker = MetricsTracker(config=TrackerConfig(log_interval=10, backends=[StdoutBackend(), "jsonl"],
                                                  log_dir=str(tmp_path)))
    for step in range(1, 11):
        tracker.end_step(step, loss=2.0, lr=1e-3)
    capsys.readouterr()
    loss, accuracy = LossMetric(), Accuracy()
    loss.accumulate({}, {"loss": 1.5})
    logits = torch.tensor([[[0.0, 3.0, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, 1.0], [0.0, 5.0, 0.0]]])
    accuracy.accumulate({"labels": torch.tensor([[1, 0, 1, 1]])}, {"logits": logits})
    tracker.log_eval(metrics=[loss, accuracy], perplexity=torch.tensor(4.0))
    tracker.close()
    line = capsys.readouterr().out.strip()
    assert line == "step 10 | eval/loss 1.5000 | eval/accuracy 0.7500 | eval/perplexity 4", line
    StdoutBackend().write({"loss": 2.0, "eval/loss": 1.5}, 20)
    assert capsys.readouterr().out.strip() == "step 20 | loss 2.0000 | eval/loss 1.5000"


class ExplodingBackend(Backend):
    name = "exploding"

    def __init__(self):
        self.writes = 0

    def write(self, record, step):
        self.writes += 1
        raise OSError("disk full")


def test_a_failing_write_warns_once_and_training_continues(tmp_path):
    exploding, jsonl = ExplodingBackend(), JsonlBackend(str(tmp_path / "m.jsonl"))
    tracker = MetricsTracker(config=TrackerConfig(log_interval=1, backends=[exploding, jsonl]))
    with pytest.warns(RuntimeWarning, match=r"'exploding' failed and is disabled.*disk full") as caught:
        for _ in range(3):
            tracker.end_step(loss=1.0)
    tracker.close()
    assert len([w for w in caught if "exploding" in str(w.message)]) == 1
    assert exploding.writes == 1 and [r["step"] for r in read_jsonl(jsonl.path)] == [1, 2, 3]


def test_a_backend_that_cannot_be_imported_warns_once(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # "import wandb" raises ImportError
    jsonl = JsonlBackend(str(tmp_path / "m.jsonl"))
    tracker = MetricsTracker(config=TrackerConfig(log_interval=1, backends=["wandb", jsonl], log_dir=str(tmp_path)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            tracker.end_step(loss=1.0)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    tracker.close()
    assert len(messages) == 1 and "'wandb'" in messages[0] and "ModuleNotFoundError" in messages[0]
    assert len(read_jsonl(jsonl.path)) == 3


def test_backends_by_name(tmp_path):
    assert build_backend("jsonl", str(tmp_path)).path == os.path.join(str(tmp_path), "metrics.jsonl")
    assert build_backend("tensorboard", str(tmp_path)).log_dir == os.path.join(str(tmp_path), "tensorboard")
    with pytest.raises(ValueError, match="unknown logging backend"):
        build_backend("csv")


def _write_from(writer_rank: int, directory: str) -> bool:
    import torch.distributed as dist

    path = os.path.join(directory, f"rank{dist.get_rank()}.jsonl")
    tracker = MetricsTracker(config=TrackerConfig(log_interval=1, backends=[JsonlBackend(path)],
                                                  writer_rank=writer_rank))
    tracker.end_step(loss=torch.tensor(1.0))
    tracker.close()
    return os.path.exists(path)


def test_only_the_writer_rank_writes(tmp_path):
    assert run_distributed(_write_from, 3, args=(0, str(tmp_path / "a"))) == [True, False, False]
    assert run_distributed(_write_from, 3, args=(2, str(tmp_path / "b"))) == [False, False, True]


def test_resume_from_a_state_dict_continues_steps_without_duplicates(tmp_path):
    path = str(tmp_path / "metrics.jsonl")
    first = MetricsTracker(config=TrackerConfig(log_interval=2, backends=[JsonlBackend(path)]))
    for step in range(1, 11):
        first.end_step(step, loss=10.0, tokens=4)
        if step == 6:
            checkpoint = first.state_dict()  # saved with the model at step 6
    first.close()  # then the job dies at step 10
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 4, 6, 8, 10]
    resumed = MetricsTracker(config=TrackerConfig(log_interval=2, backends=[JsonlBackend(path)]))
    resumed.load_state_dict(checkpoint)
    for _ in range(6):
        resumed.end_step(loss=20.0, tokens=4)  # steps 7..12, numbered by the tracker
    resumed.close()
    records = read_jsonl(path)
    assert [r["step"] for r in records] == [1, 2, 4, 6, 8, 10, 12]
    assert [r["loss"] for r in records] == [10.0] * 4 + [20.0] * 3, "steps 8 and 10 are the resumed run's"
    assert records[-1]["train/consumed_tokens"] == 12 * 4


def test_log_eval_writes_eval_keys_at_the_training_step(tmp_path):
    from twinkle_megatron import LossMetric

    path = str(tmp_path / "metrics.jsonl")
    tracker = MetricsTracker(config=TrackerConfig(log_interval=1, backends=[JsonlBackend(path)]))
    tracker.end_step(loss=2.0)
    metric = LossMetric()
    metric.accumulate({}, {"loss": 1.5})
    record = tracker.log_eval(metrics=[metric], perplexity=torch.tensor(4.0))
    tracker.close()
    assert record == {"eval/loss": 1.5, "eval/perplexity": 4.0}
    assert read_jsonl(path)[-1] == {"step": 1, "eval/loss": 1.5, "eval/perplexity": 4.0}


# ---------------------------------------------------------------- restarts: the run's first step supersedes


def _steps(path) -> list[int]:
    return [record["step"] for record in read_jsonl(str(path))]


def test_a_run_appended_to_a_log_with_a_cut_last_line_starts_on_a_fresh_line(tmp_path):
    """A killed job left half a record; the next run's records are whole lines, the earlier ones untouched."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    saved = MetricsTracker(config=TrackerConfig(log_interval=1, backends=()))
    saved.end_step(1, loss=2.0)
    saved.end_step(2, loss=1.5)
    tracker = MetricsTracker(config=TrackerConfig(log_interval=1, backends=[JsonlBackend(str(path))]))
    tracker.load_state_dict(saved.state_dict())  # the job's checkpoint at step 2
    tracker.end_step(loss=1.25)
    tracker.close()
    lines = path.read_text().splitlines()
    assert [json.loads(line) for line in lines[:2]] == [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}]
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3] and json.loads(lines[2])["loss"] == 1.25
    assert path.read_text().endswith("\n")


def test_a_restart_without_a_checkpoint_supersedes_the_whole_log(tmp_path):
    """``train_gpt.py --resume`` before the first save: the run starts at step 1 again; no step is logged twice."""
    path = tmp_path / "metrics.jsonl"
    for attempt in (1, 2):
        tracker = MetricsTracker(config=TrackerConfig(log_interval=5, backends=[JsonlBackend(str(path))]))
        for step in range(1, 11):
            tracker.end_step(step, loss=float(attempt), tokens=2)
        tracker.close()
    records = read_jsonl(str(path))
    assert [r["step"] for r in records] == [1, 5, 10] and {r["loss"] for r in records} == {2.0}
    superseded = read_jsonl(str(tmp_path / "metrics.superseded.jsonl"))
    assert [r["step"] for r in superseded] == [1, 5, 10] and {r["loss"] for r in superseded} == {1.0}, \
        "nothing logged is lost: the earlier attempt's records are kept beside the log"


def test_the_first_step_is_known_before_the_first_log_step(tmp_path):
    """Resumed at 11 with log_interval 5, the first record is step 15: the old run's steps 11–14 go all the same."""
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": step, "loss": 1.0}) + "\n" for step in range(1, 21)))
    tracker = MetricsTracker(config=TrackerConfig(log_interval=5, backends=[JsonlBackend(str(path))]))
    for step in range(11, 16):  # no load_state_dict: the first end_step says where this run starts
        tracker.end_step(step, loss=2.0)
    tracker.close()
    assert _steps(path) == list(range(1, 11)) + [15]


def test_close_logs_the_last_partial_interval(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tracker = MetricsTracker(config=TrackerConfig(log_interval=5, backends=[JsonlBackend(str(path))]))
    for _ in range(7):
        tracker.end_step(loss=3.0, tokens=4)
    tracker.close()
    tracker.close()  # twice: harmless
    records = read_jsonl(str(path))
    assert [r["step"] for r in records] == [1, 5, 7]
    assert records[-1]["train/consumed_tokens"] == 28, "steps 6 and 7 are counted"
    exact = MetricsTracker(config=TrackerConfig(log_interval=5, backends=[JsonlBackend(str(tmp_path / "exact.jsonl"))]))
    for _ in range(10):
        exact.end_step(loss=3.0)
    exact.close()
    assert _steps(tmp_path / "exact.jsonl") == [1, 5, 10], "nothing pending: no extra record"


def _close_on_every_rank(directory: str) -> list:
    tracker = MetricsTracker(config=TrackerConfig(log_interval=4,
                                                  backends=[JsonlBackend(os.path.join(directory, "metrics.jsonl"))]))
    for step in range(1, 7):
        tracker.end_step(step, loss=torch.tensor([2.0, 1.0]), tokens=3)
    tracker.close()  # collective: steps 5 and 6 are reduced over the ranks
    return [tracker.last_record["train/consumed_tokens"], tracker.last_record["loss"]]


def test_close_reduces_the_last_interval_over_the_ranks(tmp_path):
    assert run_distributed(_close_on_every_rank, 2, args=(str(tmp_path),)) == [[36, 2.0], [36, 2.0]]
    assert _steps(tmp_path / "metrics.jsonl") == [1, 4, 6]


def test_starting_the_run_after_the_first_record_warns(tmp_path):
    logger = MetricsLogger([JsonlBackend(str(tmp_path / "m.jsonl"))])
    logger.log({"loss": 1.0}, 1)
    with pytest.warns(RuntimeWarning, match="after backends were opened"):
        logger.start(5)
    logger.close()


# ---------------------------------------------------------------- JSONL: streamed supersede, paths that are no log

_MEMORY_CHILD = r"""
import resource, sys
from twinkle_megatron.logging import JsonlBackend, RunStart

def virtual_bytes():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize")

path, first_step = sys.argv[1], int(sys.argv[2])
cap = virtual_bytes() + 64 * 2**20
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
backend = JsonlBackend(path)
backend.open(RunStart(first_step=first_step))
backend.write({"loss": 1.0}, first_step)
backend.close()
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def test_a_200_mb_log_resumes_within_64_mib_of_memory(tmp_path):
    """The supersede step streams: under an address-space cap of the process's size + 64 MiB, a 200 MB log resumes.

    (It read the whole log with ``readlines()`` before: a MemoryError under this cap.)
    """
    path = tmp_path / "metrics.jsonl"
    padding = "x" * 960
    steps = 200_000  # about 1 kB per record: 200 MB
    with open(path, "w") as file:
        for step in range(1, steps + 1):
            file.write(json.dumps({"step": step, "loss": 1.0, "note_padding": padding}) + "\n")
        file.write('{"step": 200001, "lo')  # a cut last line
    size = path.stat().st_size
    assert size > 200e6
    first_step = steps // 2 + 1
    done = subprocess.run([sys.executable, "-c", _MEMORY_CHILD, str(path), str(first_step)], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    kept = superseded = 0
    with open(path) as file:
        for number, line in enumerate(file, start=1):
            assert json.loads(line)["step"] == (number if number <= steps // 2 else first_step)
            kept += 1
    with open(tmp_path / "metrics.superseded.jsonl") as file:
        for number, line in enumerate(file, start=first_step):
            assert json.loads(line)["step"] == number
            superseded += 1
    assert (kept, superseded) == (steps // 2 + 1, steps // 2), "every record once, in one of the two files"
    assert not (tmp_path / "metrics.jsonl.tmp").exists()


@pytest.mark.parametrize("kind", ["device", "fifo", "directory"])
def test_a_log_path_that_is_not_a_regular_file_is_refused_once_and_training_goes_on(tmp_path, kind):
    if kind == "device":
        path = "/dev/full"  # reads zeros forever: it was read until the process was killed
    elif kind == "fifo":
        path = str(tmp_path / "fifo")
        os.mkfifo(path)  # opening it blocks until a reader comes
    else:
        path = str(tmp_path / "directory")
        os.mkdir(path)
    other = JsonlBackend(str(tmp_path / "other.jsonl"))
    tracker = MetricsTracker(config=TrackerConfig(log_interval=1, backends=[JsonlBackend(path), other]))
    tracker.load_state_dict({**MetricsTracker(config=TrackerConfig(backends=())).state_dict(), "step": 4})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            tracker.end_step(loss=1.0)
    tracker.close()
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "'jsonl' failed and is disabled" in messages[0]
    assert f"{path} is a {kind if kind != 'fifo' else 'FIFO'}, not a regular file" in messages[0]
    assert _steps(tmp_path / "other.jsonl") == [5, 6, 7], "training and the other backends went on"


def test_rewriting_a_log_keeps_lines_that_are_not_records_and_ends_every_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\nnot json\n[1, 2]\n{"step": 2, "loss": 1.5}\n{"step": 3, "loss": 1.0}')
    backend = JsonlBackend(str(path))
    backend.open(RunStart(first_step=3))
    backend.write({"loss": 0.5}, 3)
    backend.close()
    assert path.read_text() == ('{"step": 1, "loss": 2.0}\nnot json\n[1, 2]\n{"step": 2, "loss": 1.5}\n'
                                '{"step": 3, "loss": 0.5}\n')
    assert (tmp_path / "metrics.superseded.jsonl").read_text() == '{"step": 3, "loss": 1.0}\n'


def test_an_unchanged_log_is_not_rewritten(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n')
    before = path.stat().st_ino
    backend = JsonlBackend(str(path))
    backend.open(RunStart(first_step=2))
    backend.close()
    assert path.stat().st_ino == before and not (tmp_path / "metrics.superseded.jsonl").exists()


# ---------------------------------------------------------------- a checkpoint loaded after the tracker logged


def test_a_rollback_in_the_same_process_supersedes_from_the_loaded_step(tmp_path):
    """Steps 1..6 logged, the step-3 checkpoint loaded, 4..6 run again: the log holds each step once (it held
    4, 5, 6 twice, silently); the abandoned records are kept beside it; steps pending since the last log are
    dropped with the timeline they belong to."""
    path = tmp_path / "metrics.jsonl"
    tracker = MetricsTracker(config=TrackerConfig(log_interval=2, backends=[JsonlBackend(str(path))]))
    for step in range(1, 8):
        tracker.end_step(step, loss=float(step), tokens=1)
        if step == 4:
            checkpoint = tracker.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a rollback loses nothing: no warning
        tracker.load_state_dict(checkpoint)  # step 7 ended but not logged: it belongs to the abandoned timeline
    for step in range(5, 9):
        tracker.end_step(step, loss=10.0 + step, tokens=1)
    tracker.close()
    records = read_jsonl(str(path))
    assert [(r["step"], r["loss"]) for r in records] == [(1, 1.0), (2, 2.0), (4, 3.5), (6, 15.5), (8, 17.5)]
    assert records[-1]["train/consumed_tokens"] == 8
    assert [r["step"] for r in read_jsonl(str(tmp_path / "metrics.superseded.jsonl"))] == [6]


def test_a_checkpoint_loaded_after_an_early_record_supersedes_and_says_what_was_lost(tmp_path):
    """An evaluation logged at step 0 before the checkpoint is loaded: the log had superseded everything from
    step 0 when it opened; the load restarts it at 11 (nothing twice) and warns that steps 1..10 of the
    earlier run were moved aside then."""
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": step, "loss": 1.0}) + "\n" for step in range(1, 16)))
    saved = {**MetricsTracker(config=TrackerConfig(backends=())).state_dict(), "step": 10}
    tracker = MetricsTracker(config=TrackerConfig(log_interval=5, backends=[JsonlBackend(str(path))]))
    tracker.log_eval(0, loss=3.0)
    with pytest.warns(RuntimeWarning, match=r"restarts at step 11 after the backends opened at step 0.*steps 1\.\.10"):
        tracker.load_state_dict(saved)
    for step in range(11, 16):
        tracker.end_step(step, loss=2.0)
    tracker.close()
    assert _steps(path) == [0, 15]
    assert _steps(tmp_path / "metrics.superseded.jsonl") == list(range(1, 16))
