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

import os
import re
import time
from pathlib import Path

import pytest
import slurm_helpers as slurm
import torch

from twinkle_megatron import keys

pytestmark = pytest.mark.skipif(os.environ.get("TWINKLE_SLURM_TEST") != "1" or not os.environ.get("SLURM_CONF"),
                                reason="needs the one-host Slurm cluster: run `make test-slurm`")

STEPS = 64  # long enough that the requeue lands while the resumed run still trains (a step: ~0.05 s)
SAVE_INTERVAL = 8
NODES, RANKS_PER_NODE, PP, DP = 2, 2, 2, 2
JOB_TIMEOUT = 240  # seconds, per job (each start imports megatron on 4 ranks sharing 2 cores)


def _submit(tmp: Path, name: str) -> tuple[str, Path, Path]:
    """sbatch the recipe with the CPU switch, PP2 x DP2 on 2 nodes; returns (job id, run directory, job output)."""
    env = {**slurm.recipe_environment(tmp, ranks_per_node=RANKS_PER_NODE, tp=1, pp=PP, steps=STEPS, microbatches=2,
                                      save_interval=SAVE_INTERVAL), "MASTER_ADDR": "127.0.0.1"}
    return slurm.sbatch(tmp, name, env, "--time=00:10:00")


def _wait(what: str, condition, output: Path, timeout: float = JOB_TIMEOUT):
    return slurm.wait(what, condition, output, timeout, interval=0.2)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("uninterrupted")
    job_id, run_dir, output = _submit(tmp, "whole")
    started = time.monotonic()
    job = _wait("the uninterrupted job to end", lambda: slurm.finished(job_id), output)
    print(f"uninterrupted job {job_id}: {time.monotonic() - started:.0f}s")
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", output.read_text()[-6000:]
    return job_id, run_dir, output


def test_job_trains_logs_checkpoints_and_summarises(uninterrupted):
    job_id, run_dir, output = uninterrupted
    text = output.read_text()
    records = slurm.records(run_dir)
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
    _wait("the first steps", lambda: len(slurm.records(run_dir)) >= 4, output)
    slurm.run("scancel", "--batch", "--signal=USR1", job_id)
    first_stop = _wait("the resumed job (restart 1)", lambda: slurm.running_past(job_id, run_dir, 1, 0) and
                       slurm.stopped_steps(output), output)[0]
    # 2. Preemption: `scontrol requeue` signals every process with TERM; Slurm requeues the job itself.
    _wait("steps after the first resume", lambda: slurm.running_past(job_id, run_dir, 1, first_stop + 3), output)
    slurm.run("scontrol", "requeue", job_id)
    job = _wait("the job to end after its second restart", lambda: slurm.finished(job_id), output)
    print(f"preempted job {job_id}: {time.monotonic() - started:.0f}s")
    text = output.read_text()
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0" and job["Restarts"] == "2", text[-6000:]

    stops = slurm.stopped_steps(output)
    assert [signal for signal, _ in re.findall(r"\[train\] (SIG\w+) received: stopped after step (\d+)", text)] == \
        ["SIGUSR1", "SIGTERM"], text[-6000:]
    assert stops[0] < stops[1] < STEPS
    assert re.findall(r"resumed from step (\d+)", text) == [str(step) for step in stops]
    assert "requeueing job" in text and "TERM (preempted, requeued or cancelled)" in text

    records = slurm.records(run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), "every step exactly once, in order"
    slurm.assert_same_metrics(records, slurm.records(uninterrupted[1]), STEPS, rel_tol=1e-5)

