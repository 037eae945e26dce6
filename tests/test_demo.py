"""The demo (examples/train_gpt.py) end to end: a real Megatron run logs the plugin's metrics, resumes,
stops cleanly on a preemption signal, refuses impossible flags and loads only plain-data checkpoints."""

from __future__ import annotations

import json
import math
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from kit.example_script import load_train_gpt
from kit.fork_server import run_python

from twinkle_megatron import keys

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_gpt.py"


train_gpt = load_train_gpt("train_gpt")


def _command(tmp_path: Path, *flags: str) -> list[str]:
    return [sys.executable, str(SCRIPT), "--tp", "2", "--pp", "2", "--dp", "1", "--log-interval", "2",
            "--log-dir", str(tmp_path), "--run-name", "run", "--backends", "jsonl", *flags]


def _records(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


def _run(tmp_path: Path, *flags: str) -> list[dict]:
    done = run_python(_command(tmp_path, *flags)[1:], timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return _records(tmp_path)


def test_demo_trains_and_logs_the_plugin_metrics_then_resumes(tmp_path):
    # A Slurm requeue before the first checkpoint runs `--resume` with nothing to resume: it starts at step 1
    # again and supersedes what the killed attempt logged (it logged every step twice before), and the last
    # step is logged though it is not a multiple of the log interval.
    records = _run(tmp_path, "--steps", "3", "--resume")
    assert [r["step"] for r in records] == [1, 2, 3]
    records = _run(tmp_path, "--steps", "4", "--save-interval", "2", "--resume")
    assert [r["step"] for r in records] == [1, 2, 4]
    for record in records:
        for key in ("loss", "accuracy", "entropy", "logprob", "perf/tokens_per_second", "perf/step_time",
                    "perf/slowest_rank"):
            assert key in record, key
    assert records[0]["total_tokens"] == 4 * 4 * 31  # microbatches × micro batch × masked sequence
    assert records[-1]["loss"] < records[0]["loss"] and records[-1]["accuracy"] > records[0]["accuracy"], \
        "the model learns"
    # The blend's two corpora, per dataset (megatron-core's BlendedDataset gives each sample its dataset_id):
    # half the tokens each, and the global loss is their token-weighted mean (the global loss is Megatron's
    # float32 [sum, count] reports, the groups' float64 sums of the same per-token losses).
    last = records[-1]
    assert last["total_tokens/easy"] + last["total_tokens/hard"] == last["total_tokens"]
    # And by token position (four equal buckets over the 32 positions; the first has the unmasked tokens).
    buckets = ("pos_0-7", "pos_8-15", "pos_16-23", "pos_24-31")
    assert sum(last[f"total_tokens/{bucket}"] for bucket in buckets) == last["total_tokens"]
    assert all(f"loss/{bucket}" in last for bucket in buckets)
    assert last["loss"] == pytest.approx((last["loss/easy"] * last["total_tokens/easy"] + last["loss/hard"] *
                                          last["total_tokens/hard"]) / last["total_tokens"], rel=1e-6)
    # A requeued job: continue from the step-4 checkpoint to step 6, no step logged twice.
    records = _run(tmp_path, "--steps", "6", "--save-interval", "2", "--resume")
    assert [r["step"] for r in records] == [1, 2, 4, 6]
    assert records[-1]["train/consumed_tokens"] == 6 * 4 * 4 * 31


# ------------------------------------------------------------------ preemption: stop after the step, save, resume


def _interrupt(tmp_path: Path, signum: int, flags: tuple[str, ...], after_records: int) -> tuple[int, str]:
    """Start the demo, send ``signum`` to it once ``after_records`` records are logged; (exit status, stdout)."""
    proc = subprocess.Popen(_command(tmp_path, *flags), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT)
    log = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        if log.exists() and log.read_text().count("\n") >= after_records:
            proc.send_signal(signum)  # to the launching process: it passes the signal to every rank
            break
        time.sleep(0.1)
    try:
        output, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        pytest.fail(f"the demo did not stop after the signal:\n{output[-3000:]}")
    return proc.returncode, output


STOP_FLAGS = ("--steps", "16", "--log-interval", "1", "--tp", "1", "--pp", "1", "--dp", "2", "--layers", "2",
              "--hidden-size", "32", "--heads", "2", "--seq-length", "16", "--microbatches", "2")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("whole"), *STOP_FLAGS)


def _pooled(records: list[dict]) -> tuple[list[int], list[int], float]:
    """Per record: steps and tokens since the previous record; and the token-weighted loss of the run.

    Independent of where the records split the run (the log interval, a stop between log steps).
    """
    steps = [r["step"] - previous for r, previous in zip(records, [0] + [r["step"] for r in records])]
    consumed = [r[keys.CONSUMED_TOKENS] for r in records]
    tokens = [n - previous for n, previous in zip(consumed, [0] + consumed)]
    return steps, tokens, sum(r[keys.LOSS] * n for r, n in zip(records, tokens)) / sum(tokens)


def test_a_stop_signal_saves_after_the_current_step_and_the_resumed_run_loses_nothing(tmp_path, uninterrupted):
    """SIGUSR1 to the demo: every rank ends its step, the partial log interval is logged, all ranks save
    that step, exit 0; the resumed run logs every remaining step once; totals equal an uninterrupted run's.
    (Per-record equality with every step logged: tests/slurm, through Slurm's USR1 and TERM.)"""
    flags = (*STOP_FLAGS, "--log-interval", "4")
    status, output = _interrupt(tmp_path, signal.SIGUSR1, flags, after_records=2)
    assert status == 0, output[-3000:]
    stopped = re.search(r"\[train\] SIGUSR1 received: stopped after step (\d+) of 16", output)
    assert stopped, output[-3000:]
    step = int(stopped.group(1))
    assert 4 <= step < 16
    assert [r["step"] for r in _records(tmp_path)] == sorted({1, *range(4, step + 1, 4), step})
    for rank in range(2):  # every rank saved the step it stopped after, with the counts logged up to it
        state = torch.load(tmp_path / "run" / "checkpoint" / f"rank{rank:05d}.pt", weights_only=True)
        assert state["step"] == step == state["tracker"]["step"]
        assert state["tracker"]["consumed_tokens"] == _records(tmp_path)[-1][keys.CONSUMED_TOKENS]
    resumed = _run(tmp_path, *flags, "--resume")
    assert [r["step"] for r in resumed] == sorted({1, step, *range(4, 17, 4)}), "every record once, in order"
    steps, tokens, loss = _pooled(resumed)
    reference_steps, reference_tokens, reference_loss = _pooled(uninterrupted)
    assert sum(steps) == sum(reference_steps) == 16
    assert sum(tokens) == sum(reference_tokens) == resumed[-1][keys.CONSUMED_TOKENS]
    assert all(n == tokens[0] * s for n, s in zip(tokens, steps)), "every step's tokens counted once"
    assert math.isclose(loss, reference_loss, rel_tol=1e-6), "the resumed run trains as the uninterrupted one"


# ------------------------------------------------------------------ flags checked before any rank starts


@pytest.mark.parametrize("flags, message", [
    (["--steps", "0"], "--steps must be at least 1, got 0"),
    (["--dp", "0"], "--dp must be at least 1, got 0"),
    (["--tp", "0"], "--tp must be at least 1, got 0"),
    (["--tp", "3"], "--heads 4 is not divisible by --tp 3"),
    (["--layers", "3"], "--layers 3 is not divisible by --pp 2 = 2 pipeline stages"),
    (["--vpp", "2", "--layers", "6"], "--layers 6 is not divisible by --pp 2 × --vpp 2 = 4 pipeline stages"),
    (["--vpp", "2", "--pp", "1"], "--vpp needs --pp of at least 2"),
    (["--vpp", "2", "--microbatches", "3"], "needs --microbatches divisible by --pp 2, got 3"),
    (["--hidden-size", "30"], "--hidden-size 30 is not divisible by --heads 4"),
    (["--cp", "2"], "--cp > 1 needs Transformer Engine's attention"),
    (["--seq-length", "1"], "--seq-length must be at least 2"),
    (["--save-interval", "3"], "--save-interval 3 is not a multiple of --log-interval 5"),
    (["--lr", "nan"], "--lr must be a positive number"),
    (["--steps", "0", "--tp", "0"], "--steps must be at least 1, got 0; --tp must be at least 1, got 0"),
])
def test_impossible_flags_exit_2_with_one_message(flags, message, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as exit_:
        train_gpt.parse_args(flags)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_under_torchrun_the_world_must_fit_the_layout(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "6")
    with pytest.raises(SystemExit) as exit_:
        train_gpt.parse_args(["--tp", "2", "--pp", "2"])
    assert exit_.value.code == 2
    assert "torchrun started 6 ranks, not divisible by --tp 2 × --pp 2 × --cp 1 = 4" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "8")
    with pytest.raises(SystemExit):
        train_gpt.parse_args(["--tp", "2", "--pp", "2", "--dp", "4"])
    assert "--dp 4 does not match torchrun's 8 ranks / 4 = 2" in capsys.readouterr().err
    assert train_gpt.parse_args(["--tp", "2", "--pp", "2"]).dp == 2
    monkeypatch.setenv("RANK", "3")  # the other ranks exit quietly: one message per job
    with pytest.raises(SystemExit) as exit_:
        train_gpt.parse_args(["--tp", "3"])
    assert exit_.value.code == 2 and capsys.readouterr().err == ""


def test_bad_flags_stop_the_script_before_it_starts_ranks():
    started = time.monotonic()
    done = run_python([str(SCRIPT), "--tp", "3"], timeout=60, cwd=ROOT)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == "train_gpt.py: error: --heads 4 is not divisible by --tp 3"
    assert "CPU ranks" not in done.stdout and time.monotonic() - started < 30


# ------------------------------------------------------------------ checkpoints are data, not code


class _PlantedCode:
    """What a planted checkpoint could hold: unpickling it calls ``Path.touch(marker)``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


def test_resume_never_runs_code_from_a_planted_checkpoint(tmp_path):
    marker = tmp_path / "code-ran"
    checkpoint = tmp_path / "run" / "checkpoint" / "rank00000.pt"
    checkpoint.parent.mkdir(parents=True)
    torch.save({"step": 3, "model": _PlantedCode(marker)}, checkpoint)
    done = run_python([str(SCRIPT), "--tp", "1", "--pp", "1", "--dp", "1", "--steps", "4", "--log-dir", str(tmp_path),
                       "--run-name", "run", "--backends", "jsonl", "--resume"], timeout=120, cwd=ROOT)
    assert done.returncode != 0
    assert "Weights only load failed" in done.stderr
    assert not marker.exists(), "unpickling the planted checkpoint ran its code"


# ------------------------------------------------------------------ what the console shows


def test_every_flag_has_help_and_shows_its_default():
    parser = train_gpt.build_parser()
    flags = [action for action in parser._actions if action.option_strings and action.dest != "help"]
    assert len(flags) >= 25
    undocumented = [action.option_strings[0] for action in flags if not (action.help or "").strip()]
    assert undocumented == []
    text = " ".join(parser.format_help().split())
    for action in flags:  # ArgumentDefaultsHelpFormatter: "... (default: 40)" after each flag's help
        help_text = " ".join(action.help.split())
        assert f"{help_text} (default: {action.default})" in text, action.option_strings[0]


def test_the_console_shows_compact_step_lines_and_no_megatron_warnings(tmp_path):
    """Default console: one short line per log step with significant digits; megatron-core's warnings hidden
    (a library user's filters are never touched: only the script's main() sets them)."""
    command = [sys.executable, str(SCRIPT), "--tp", "2", "--pp", "2", "--dp", "1", "--steps", "2",
               "--log-interval", "1", "--log-dir", str(tmp_path), "--run-name", "run", "--backends", "stdout",
               "jsonl"]
    # A real interpreter (not kit/fork_server.py): the console must hold no warning, those of the imports included.
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    console = done.stdout + done.stderr
    assert "Warning" not in console and "warnings.warn" not in console and "path_to_cache" not in console, console
    steps = [line for line in done.stdout.splitlines() if line.startswith("step ")]
    assert [line.split(" | ")[0] for line in steps] == ["step 1", "step 2"]
    for line in steps:
        assert len(line) <= 200, line
        fields = dict(part.rsplit(" ", 1) for part in line.split(" | ")[1:])
        assert set(fields) >= {"loss", "accuracy", "accuracy/easy", "accuracy/hard", "TFLOP/s/gpu", "step_time"}
        assert "entropy" not in fields and "loss/easy" not in fields  # in the record, not on the console
        for label, text in fields.items():  # never a bare 0.0: at least 3 significant digits, or an exact 0
            digits = re.sub(r"[^0-9]", "", text).lstrip("0")
            assert text.rstrip("s%GiB") in ("0",) or len(digits) >= 3 or "e" in text, (label, text)
    record = _records(tmp_path)[-1]
    assert {"entropy", "loss/easy", "perf/tokens_per_second"} <= set(record)  # the full record in JSONL
    # megatron-core warns when it is imported: one step on one rank, a run of its own, shows it.
    shown = subprocess.run(command[:-2] + ["jsonl", "--megatron-warnings", "--steps", "1", "--tp", "1", "--pp", "1",
                                           "--run-name", "warnings"], capture_output=True, text=True, timeout=240,
                           cwd=ROOT)
    assert shown.returncode == 0 and "UserWarning" in shown.stderr
