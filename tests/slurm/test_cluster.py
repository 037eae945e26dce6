"""examples/slurm/train.sbatch, unchanged, on a real one-host Slurm cluster (``make test-slurm``).

``tests/slurm/cluster.sh start`` brings up munged, slurmctld and two slurmd (nodes n1, n2) on
127.0.0.1; ``make test-slurm`` starts it, runs this module with ``TWINKLE_SLURM_TEST=1`` and
``SLURM_CONF`` set, and stops it. Without them (``make test``) the module is skipped.

The jobs run the CPU switch of the recipe: 2 nodes × 2 ranks (``GPUS_PER_NODE=2``,
``sbatch --gpus-per-node=0``), PP2 × DP2, ``--device cpu`` (gloo and the CPU shim under
torchrun), a small model. One job runs uninterrupted; a second job with the same seed is
preempted twice while it trains — USR1 to the batch script (what ``--signal=B:USR1@180``
sends before the time limit) and ``scontrol requeue`` (TERM to every process, as a
preemption) — and each time resumes from the checkpoint saved at the step it stopped after.
Its log must hold every step once, in order, with the uninterrupted run's numbers.
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

import pytest
import torch

from twinkle_megatron import keys

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "examples" / "slurm" / "train.sbatch"

pytestmark = pytest.mark.skipif(os.environ.get("TWINKLE_SLURM_TEST") != "1" or not os.environ.get("SLURM_CONF"),
                                reason="needs the one-host Slurm cluster: run `make test-slurm`")

STEPS = 64  # long enough that the requeue lands while the resumed run still trains (a step: ~0.05 s)
SAVE_INTERVAL = 8
NODES, RANKS_PER_NODE, PP, DP = 2, 2, 2, 2
JOB_TIMEOUT = 240  # seconds, per job (each start imports megatron on 4 ranks sharing 2 cores)
# Keys whose values depend on the machine's speed: everything else must match across runs.
TIMING = re.compile(r"time|per_second|tflops|mfu|memory|slowest|elapse|speed")


def _slurm(*command: str, timeout: float = 30) -> str:
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(command)}: {done.stdout}{done.stderr}"
    return done.stdout


def _submit(tmp: Path, name: str) -> tuple[str, Path, Path]:
    """sbatch the recipe with the CPU switch; returns (job id, run directory, job output file)."""
    bin_dir = Path(sys.executable).parent  # torchrun and python of this environment
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHON": sys.executable,
           "GPUS_PER_NODE": str(RANKS_PER_NODE), "MASTER_ADDR": "127.0.0.1",
           "TP": "1", "PP": str(PP), "STEPS": str(STEPS), "MICROBATCHES": "2", "MICRO_BATCH_SIZE": "2",
           "LOG_INTERVAL": "1", "SAVE_INTERVAL": str(SAVE_INTERVAL), "LOG_DIR": str(tmp / "runs"),
           "BACKENDS": "stdout jsonl",
           "TRAIN_ARGS": "--device cpu --layers 2 --hidden-size 32 --heads 2 --seq-length 16"}
    output = tmp / f"{name}.out"
    job_id = subprocess.run(
        ["sbatch", "--parsable", f"--job-name={name}", "--gpus-per-node=0", "--cpus-per-task=1",
         f"--output={output}", "--time=00:10:00", str(SBATCH)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=30, check=True).stdout.strip().split(";")[0]
    return job_id, tmp / "runs" / f"{name}-{job_id}", output


def _job(job_id: str) -> dict[str, str]:
    fields = _slurm("scontrol", "show", "job", "--oneliner", job_id).split()
    return dict(field.split("=", 1) for field in fields if "=" in field)


def _records(run_dir: Path) -> list[dict]:
    """The complete lines of the JSONL log (a line still being written is left out)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    text = path.read_text()
    return [json.loads(line) for line in text.split("\n")[:-1] if line.strip()]


def _wait(what: str, condition, output: Path, timeout: float = JOB_TIMEOUT):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    log = output.read_text()[-6000:] if output.exists() else "(no job output)"
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}; job output:\n{log}")


def _finished(job_id: str):
    job = _job(job_id)
    return job if job["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL") else None


def _running_past(job_id: str, run_dir: Path, restarts: int, step: int):
    """The job runs its ``restarts``-th restart and has logged beyond ``step``."""
    job = _job(job_id)
    records = _records(run_dir)
    return (job["JobState"] == "RUNNING" and int(job["Restarts"]) == restarts and records
            and records[-1]["step"] > step)


def _deterministic(record: dict) -> dict:
    return {key: value for key, value in record.items()
            if not (key.startswith(("perf/", "memory/")) or TIMING.search(key))}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("uninterrupted")
    job_id, run_dir, output = _submit(tmp, "whole")
    started = time.monotonic()
    job = _wait("the uninterrupted job to end", lambda: _finished(job_id), output)
    print(f"uninterrupted job {job_id}: {time.monotonic() - started:.0f}s")
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", output.read_text()[-6000:]
    return job_id, run_dir, output


def test_job_trains_logs_checkpoints_and_summarises(uninterrupted):
    job_id, run_dir, output = uninterrupted
    text = output.read_text()
    records = _records(run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert f"[launch] job {job_id}: {NODES} nodes × {RANKS_PER_NODE} GPUs = 4 ranks, TP1 × PP2 × CP1 × DP{DP}" in text
    checkpoints = sorted((run_dir / "checkpoint").glob("rank*.pt"))
    assert [path.name for path in checkpoints] == [f"rank{rank:05d}.pt" for rank in range(4)]
    for path in checkpoints:  # plain data: loads without unpickling code
        state = torch.load(path, weights_only=True)
        assert state["step"] == STEPS and state["tracker"]["step"] == STEPS
    # steps × DP × microbatches × micro batch × (sequence − 1)
    assert records[-1][keys.CONSUMED_TOKENS] == STEPS * DP * 2 * 2 * 15, records[-1]
    assert f"records: {STEPS} (steps 1..{STEPS})" in text  # the summary the script prints at the end
    assert (run_dir / "plots" / "overview.png").stat().st_size > 0
    assert records[-1][keys.LOSS] < records[0][keys.LOSS], "the model learns"
    assert "[sbatch] done with exit status 0" in text


def test_preempted_twice_resumes_with_nothing_lost_and_nothing_twice(uninterrupted, tmp_path):
    job_id, run_dir, output = _submit(tmp_path, "preempted")
    started = time.monotonic()
    # 1. The time-limit warning: USR1 to the batch script, which passes it on and requeues after the save.
    _wait("the first steps", lambda: len(_records(run_dir)) >= 4, output)
    _slurm("scancel", "--batch", "--signal=USR1", job_id)
    first_stop = _wait("the resumed job (restart 1)", lambda: _running_past(job_id, run_dir, 1, 0) and
                       _stopped_steps(output), output)[0]
    # 2. Preemption: `scontrol requeue` signals every process with TERM; Slurm requeues the job itself.
    _wait("steps after the first resume", lambda: _running_past(job_id, run_dir, 1, first_stop + 3), output)
    _slurm("scontrol", "requeue", job_id)
    job = _wait("the job to end after its second restart", lambda: _finished(job_id), output)
    print(f"preempted job {job_id}: {time.monotonic() - started:.0f}s")
    text = output.read_text()
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0" and job["Restarts"] == "2", text[-6000:]

    stops = _stopped_steps(output)
    assert [signal for signal, _ in re.findall(r"\[train\] (SIG\w+) received: stopped after step (\d+)", text)] == \
        ["SIGUSR1", "SIGTERM"], text[-6000:]
    assert stops[0] < stops[1] < STEPS
    assert re.findall(r"resumed from step (\d+)", text) == [str(step) for step in stops]
    assert "requeueing job" in text and "TERM (preempted, requeued or cancelled)" in text

    records = _records(run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), "every step exactly once, in order"
    reference = _records(uninterrupted[1])
    for mine, theirs in zip(records, reference):
        mine, theirs = _deterministic(mine), _deterministic(theirs)
        assert mine.keys() == theirs.keys()
        for key, value in theirs.items():
            assert math.isclose(mine[key], value, rel_tol=1e-5, abs_tol=1e-6), (mine["step"], key, mine[key], value)


def _stopped_steps(output: Path) -> list[int]:
    text = output.read_text() if output.exists() else ""
    return [int(step) for step in re.findall(r"\[train\] SIG\w+ received: stopped after step (\d+)", text)]
