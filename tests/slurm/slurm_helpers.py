"""What the two Slurm test modules share: submitting examples/slurm/train.sbatch, reading a job and its log.

``tests/slurm/test_cluster.py`` (one host) and ``tests/slurm/test_multinode.py`` (two hosts in network
namespaces) run the same recipe with the CPU switch and the same small model; they differ in the layout,
the nodes and the faults. Every wait is bounded and, when it times out, fails with the end of the job's output.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Mapping

import pytest

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "examples" / "slurm" / "train.sbatch"
MODEL = "--device cpu --layers 2 --hidden-size 32 --heads 2 --seq-length 16"
# Keys whose values depend on the machine's speed: everything else must match across runs.
TIMING = re.compile(r"time|per_second|tflops|mfu|memory|slowest|elapse|speed")
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")
STOPPED = re.compile(r"\[train\] SIG\w+ received: stopped after step (\d+)")


def run(*command: str, timeout: float = 30) -> str:
    """Run a command (a Slurm client, a cluster script); its stdout, failing the test on a non-zero exit."""
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(command)}: {done.stdout}{done.stderr}"
    return done.stdout


def recipe_environment(tmp: Path, *, ranks_per_node: int, tp: int, pp: int, steps: int, microbatches: int,
                       save_interval: int, base: Mapping[str, str] = os.environ) -> dict[str, str]:
    """``base`` with the recipe's settings: this environment's python and torchrun, the layout, micro batches
    of 2, a log line every step (stdout and JSONL under ``tmp/runs``), checkpoints every ``save_interval``."""
    bin_dir = Path(sys.executable).parent  # torchrun and python of this environment
    return {**base, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHON": sys.executable,
            "GPUS_PER_NODE": str(ranks_per_node), "TP": str(tp), "PP": str(pp), "STEPS": str(steps),
            "MICROBATCHES": str(microbatches), "MICRO_BATCH_SIZE": "2", "LOG_INTERVAL": "1",
            "SAVE_INTERVAL": str(save_interval), "LOG_DIR": str(tmp / "runs"), "BACKENDS": "stdout jsonl",
            "TRAIN_ARGS": MODEL}


def sbatch(tmp: Path, name: str, env: Mapping[str, str], *options: str) -> tuple[str, Path, Path]:
    """sbatch the recipe, no GPU, one CPU a task, with ``options`` besides; returns (job id, run directory,
    job output file)."""
    output = tmp / f"{name}.out"
    job_id = subprocess.run(
        ["sbatch", "--parsable", f"--job-name={name}", *options, "--gpus-per-node=0", "--cpus-per-task=1",
         f"--output={output}", str(SBATCH)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=30, check=True).stdout.strip().split(";")[0]
    return job_id, tmp / "runs" / f"{name}-{job_id}", output


def job(job_id: str) -> dict[str, str]:
    """``scontrol show job`` as a dict of its fields."""
    fields = run("scontrol", "show", "job", "--oneliner", job_id).split()
    return dict(field.split("=", 1) for field in fields if "=" in field)


def finished(job_id: str) -> dict[str, str] | None:
    """The job's fields once it has ended (whatever the outcome), else None."""
    fields = job(job_id)
    return fields if fields["JobState"] in ENDED else None


def records(run_dir: Path) -> list[dict]:
    """The complete lines of the JSONL log (a line still being written is left out)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().split("\n")[:-1] if line.strip()]


def running_past(job_id: str, run_dir: Path, restarts: int, step: int) -> bool:
    """The job runs its ``restarts``-th restart and has logged beyond ``step``."""
    fields = job(job_id)
    logged = records(run_dir)
    return bool(fields["JobState"] == "RUNNING" and int(fields["Restarts"]) == restarts and logged
                and logged[-1]["step"] > step)


def stopped_steps(output: Path) -> list[int]:
    """The steps after which the training stopped on a signal, in the job output's order."""
    text = output.read_text() if output.exists() else ""
    return [int(step) for step in STOPPED.findall(text)]


def wait(what: str, condition: Callable[[], object], output: Path, timeout: float, interval: float):
    """Poll ``condition`` every ``interval`` seconds until it returns a true value, and return that value; fail
    the test with the end of the job output after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    log = output.read_text()[-6000:] if output.exists() else "(no job output)"
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}; job output:\n{log}")


def deterministic(record: dict) -> dict:
    """The record without its timing and memory values (they depend on the machine's speed)."""
    return {key: value for key, value in record.items()
            if not (key.startswith(("perf/", "memory/")) or TIMING.search(key))}


def assert_same_metrics(mine: list[dict], reference: list[dict], steps: int, rel_tol: float) -> None:
    """Both logs hold steps 1..``steps`` once, in order, with the same deterministic values (to ``rel_tol``)."""
    assert [r["step"] for r in mine] == [r["step"] for r in reference] == list(range(1, steps + 1))
    for ours, theirs in zip(mine, reference):
        ours, theirs = deterministic(ours), deterministic(theirs)
        assert ours.keys() == theirs.keys()
        for key, value in theirs.items():
            assert math.isclose(ours[key], value, rel_tol=rel_tol, abs_tol=1e-6), (ours["step"], key, ours[key], value)
