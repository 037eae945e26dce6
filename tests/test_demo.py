"""The demo (examples/train_gpt.py) end to end: a real Megatron run logs the plugin's metrics, and resumes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path: Path, *flags: str) -> list[dict]:
    command = [sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--tp", "2", "--pp", "2", "--dp", "1",
               "--log-interval", "2", "--log-dir", str(tmp_path), "--run-name", "run", "--backends", "jsonl",
               *flags]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    path = tmp_path / "run" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


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
    # A requeued job: continue from the step-4 checkpoint to step 6, no step logged twice.
    records = _run(tmp_path, "--steps", "6", "--save-interval", "2", "--resume")
    assert [r["step"] for r in records] == [1, 2, 4, 6]
    assert records[-1]["train/consumed_tokens"] == 6 * 4 * 4 * 31
