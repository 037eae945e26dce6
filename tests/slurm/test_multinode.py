"""examples/slurm/train.sbatch, unchanged, with ``--nodes=2`` on a real two-host Slurm (``make test-slurm-multinode``).

The cluster (``tests/slurm/multinode.sh start``, root): three network namespaces the script
creates — a hub holding a bridge and the controller's address (10.231.7.1), two hosts mn1 and
mn2 with one veth each (10.231.7.11, .12) and their own hostnames (UTS namespaces) and hosts
file (mount namespaces) — one ``slurmd`` per host, ``slurmctld`` in the hub, ``munged`` beside.
``make test-slurm-multinode`` runs this module inside the hub's network namespace (Slurm's
clients reach the controller there) with ``TWINKLE_SLURM_MULTINODE_TEST=1``, then stops the
cluster and checks that no daemon, namespace or interface is left, whatever the outcome.

Slurm options the distribution's build (Debian 12, slurm-wlm 22.05) needs here, and why:
``ProctrackType=proctrack/linuxproc`` and ``TaskPlugin=task/none`` with no ``cgroup.conf``
(a container has no writable cgroup hierarchy: processes are tracked by parent pid, nothing is
bound to cores); daemons entered with ``nsenter --net`` + ``unshare --uts --mount``, never
``ip netns exec``, which remounts /sys so that slurmd's cgroup plugin, loaded even with those
options, fails to start; ``SlurmdParameters=config_overrides`` (the two hosts share the
machine's cores); ``SlurmdTimeout=10`` (a lost host is declared down, and its job requeued,
within seconds); ``ReturnToService=2`` (a host that comes back is usable at once);
``cred_expire=5`` (a requeued job may start 5 s after it ended, not 120 s).

Jobs, all through ``sbatch examples/slurm/train.sbatch`` with the CPU switch (``--device cpu``,
gloo over the test's interfaces; rendezvous host and gloo addresses resolved from the hosts file;
no ``MASTER_ADDR``: the launcher takes the first node of ``SLURM_JOB_NODELIST``):

* ``one``: one node × 4 ranks, TP2 × DP2 — the one-node reference;
* ``two``: two nodes × 2 ranks, TP2 × DP2 — one ``torchrun`` per node, c10d rendezvous on mn1,
  data-parallel groups {0, 2}, {1, 3} across the hosts; its per-step metrics equal ``one``'s;
* ``tp-across``: two nodes × 1 rank, TP2 × DP1 with twice the microbatches (the same global
  batch) — the tensor-parallel group spans the hosts; its metrics equal ``one``'s (fp32 tolerance);
* ``faults``: ``two``'s job preempted (USR1 to the batch script, then ``scontrol requeue``: TERM),
  then a host lost mid-run (``multinode.sh lose-node``: its cable cut, every process on it killed):
  the host of rank 0, which also runs the batch script, the rendezvous store and the log writer.
  Each time it must stop within a bounded time, be requeued by Slurm and resume from the last
  checkpoint; its log holds every step once, in order, with ``two``'s numbers and totals.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest
import slurm_helpers as slurm

from twinkle_megatron import keys

CLUSTER = slurm.ROOT / "tests" / "slurm" / "multinode.sh"

pytestmark = pytest.mark.skipif(
    os.environ.get("TWINKLE_SLURM_MULTINODE_TEST") != "1" or not os.environ.get("SLURM_CONF"),
    reason="needs the two-host Slurm cluster: run `make test-slurm-multinode` (root)")

STEPS = 20
SAVE_INTERVAL = 4
NODE_TIMEOUT = 10  # SlurmdTimeout in multinode.sh
KILL_WAIT = 30  # KillWait in multinode.sh
GLOO_TIMEOUT = 300  # examples/train_gpt.py's process-group timeout: no rank may wait that long
JOB_TIMEOUT = 420  # seconds per wait (ranks import megatron on a shared CPU)


def _cluster(*command: str, timeout: float = 90) -> str:
    return slurm.run("bash", str(CLUSTER), *command, timeout=timeout)


def _submit(tmp: Path, name: str, nodes: int, ranks_per_node: int, microbatches: int) -> tuple[str, Path, Path]:
    """sbatch the recipe, TP2, with the CPU switch; returns (job id, run directory, job output file)."""
    # No MASTER_ADDR nor MASTER_PORT: the launcher takes the first node of SLURM_JOB_NODELIST.
    base = {key: value for key, value in os.environ.items() if key not in ("MASTER_ADDR", "MASTER_PORT")}
    env = slurm.recipe_environment(tmp, ranks_per_node=ranks_per_node, tp=2, pp=1, steps=STEPS,
                                   microbatches=microbatches, save_interval=SAVE_INTERVAL, base=base)
    return slurm.sbatch(tmp, name, env, f"--nodes={nodes}", "--time=00:20:00")


def _wait(what: str, condition, output: Path, timeout: float = JOB_TIMEOUT):
    return slurm.wait(what, condition, output, timeout, interval=0.5)


def _job_processes(node: str) -> dict[int, str]:
    """pid → command line of the processes on host ``node`` other than its slurmd (the job's, while it runs)."""
    pids = subprocess.run(["ip", "netns", "pids", f"twmn-{node}"], capture_output=True, text=True).stdout.split()
    processes = {}
    for pid in pids:
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except OSError:
            continue  # ended meanwhile
        if command and not command.startswith("slurmd"):
            processes[int(pid)] = command
    return processes


def _signal_job(nodes, signum: int) -> None:
    """``signum`` to the job's Python processes on ``nodes`` (torchrun and the ranks; Slurm's own daemons and
    the batch shell keep running, so that Slurm can still deliver its signals)."""
    for node in nodes:
        for pid, command in _job_processes(node).items():
            if "python" not in command and "torchrun" not in command:
                continue
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass  # ended meanwhile


def _freeze_past(run_dir: Path, nodes, step: int, output: Path) -> int:
    """Freeze the job's processes (SIGSTOP) as soon as a step past ``step`` is logged; returns the last step
    logged. A tiny model's steps take 0.1 s on an idle machine once a resumed run is going: the log is read
    every 10 ms (the file only, no Slurm command) and the job frozen at once, so that what the test does next
    lands at a known step however fast the steps come."""
    slurm.wait(f"a step past {step}", lambda: (records := slurm.records(run_dir)) and records[-1]["step"] > step,
               output, JOB_TIMEOUT, interval=0.01)
    _signal_job(nodes, signal.SIGSTOP)
    return slurm.records(run_dir)[-1]["step"]


@contextlib.contextmanager
def _frozen_past(run_dir: Path, nodes, step: int, output: Path) -> Iterator[int]:
    """:func:`_freeze_past`, then the processes go on (SIGCONT) after the block."""
    logged = _freeze_past(run_dir, nodes, step, output)
    try:
        yield logged
    finally:
        _signal_job(nodes, signal.SIGCONT)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The three uninterrupted jobs, submitted together (the cluster runs them side by side)."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    jobs = {"one": _submit(tmp, "one", nodes=1, ranks_per_node=4, microbatches=2),
            "two": _submit(tmp, "two", nodes=2, ranks_per_node=2, microbatches=2),
            "tp-across": _submit(tmp, "tp-across", nodes=2, ranks_per_node=1, microbatches=4)}
    started = time.monotonic()
    for name, (job_id, _, output) in jobs.items():
        job = _wait(f"job {name} to end", lambda job_id=job_id: slurm.finished(job_id), output)
        assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", output.read_text()[-6000:]
    print(f"uninterrupted jobs: {time.monotonic() - started:.0f}s")
    return jobs


def test_two_nodes_one_torchrun_each_rendezvous_across_hosts(uninterrupted):
    job_id, run_dir, output = uninterrupted["two"]
    text = output.read_text()
    assert f"[sbatch] job {job_id} (restart 0) on mn[1-2]" in text
    assert f"[launch] job {job_id}: 2 nodes × 2 GPUs = 4 ranks, TP2 × PP1 × CP1 × DP2; rendezvous mn1:" in text
    assert text.count("[launch] job") == 1, "one summary per job: only node 0 prints it"
    hosts = json.loads((run_dir / "hosts.json").read_text())["hosts"]
    assert sorted(hosts) == ["mn1", "mn1", "mn2", "mn2"] and hosts[0] == hosts[1] and hosts[2] == hosts[3], hosts
    # DP groups are {0, 2} and {1, 3}: across the hosts; TP groups {0, 1}, {2, 3} within one.
    assert hosts[0] != hosts[2]
    tp_hosts = json.loads((uninterrupted["tp-across"][1] / "hosts.json").read_text())["hosts"]
    assert sorted(tp_hosts) == ["mn1", "mn2"], "the TP2 group of the tp-across job spans the hosts"
    assert "TP=2 > 1 GPUs per node: tensor-parallel collectives will cross nodes" in \
        uninterrupted["tp-across"][2].read_text()


def test_the_log_is_written_once_by_the_designated_rank(uninterrupted):
    _, run_dir, output = uninterrupted["two"]
    text = output.read_text()
    records = slurm.records(run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert len(re.findall(r"^step (\d+) \|", text, flags=re.M)) == STEPS, "stdout lines: one rank prints"
    assert records[-1][keys.CONSUMED_TOKENS] == STEPS * 2 * 2 * 2 * 15  # steps × DP × microbatches × mbs × (seq − 1)
    assert f"records: {STEPS} (steps 1..{STEPS})" in text
    assert "[sbatch] done with exit status 0" in text


def test_the_straggler_view_names_the_node_of_the_slowest_rank(uninterrupted):
    _, run_dir, output = uninterrupted["two"]
    hosts = json.loads((run_dir / "hosts.json").read_text())["hosts"]
    last = slurm.records(run_dir)[-1][keys.SLOWEST_RANK]
    found = re.search(r"^slowest node: (.*); last: rank (\d+) on (\w+)$", output.read_text(), flags=re.M)
    assert found, output.read_text()[-3000:]
    assert int(found.group(2)) == last and found.group(3) == hosts[last]


def test_two_nodes_equal_one_node_on_the_same_global_batch(uninterrupted):
    one = slurm.records(uninterrupted["one"][1])
    slurm.assert_same_metrics(slurm.records(uninterrupted["two"][1]), one, STEPS, rel_tol=1e-5)
    slurm.assert_same_metrics(slurm.records(uninterrupted["tp-across"][1]), one, STEPS, rel_tol=1e-5)


def test_preempted_then_a_node_lost_resumes_with_nothing_lost_and_nothing_twice(uninterrupted, tmp_path):
    job_id, run_dir, output = _submit(tmp_path, "faults", nodes=2, ranks_per_node=2, microbatches=2)
    started = time.monotonic()
    # 1. The time-limit warning: USR1 to the batch script, which passes it on and requeues after the save.
    _wait("the first steps", lambda: len(slurm.records(run_dir)) >= 2, output)
    nodes = set(json.loads((run_dir / "hosts.json").read_text())["hosts"])
    slurm.run("scancel", "--batch", "--signal=USR1", job_id)
    _wait("the resumed job (restart 1)",
          lambda: slurm.running_past(job_id, run_dir, 1, 0) and slurm.stopped_steps(output), output)
    first_stop = slurm.stopped_steps(output)[0]
    # 2. Preemption: `scontrol requeue` sends TERM to every process; Slurm requeues the job itself. Sent while
    #    the resumed run is frozen one step in: it cannot have ended before the signal lands.
    with _frozen_past(run_dir, nodes, first_stop + 1, output):
        slurm.run("scontrol", "requeue", job_id)
    _wait("the resumed job (restart 2)",
          lambda: slurm.running_past(job_id, run_dir, 2, 0) and len(slurm.stopped_steps(output)) == 2, output)
    second_stop = slurm.stopped_steps(output)[1]
    # 3. A host lost mid-run, one step past a checkpoint (SAVE_INTERVAL - 1 steps before the next): the host of
    #    rank 0 (the batch script, the rendezvous store, the log writer) vanishes: its cable is cut, every
    #    process on it killed. The run is frozen from the first step past the checkpoint to the cut.
    checkpoint = (second_stop // SAVE_INTERVAL + 1) * SAVE_INTERVAL
    assert checkpoint + SAVE_INTERVAL <= STEPS, (second_stop, "the run is too short for a loss between checkpoints")
    logged_before_loss = _freeze_past(run_dir, nodes, checkpoint, output)
    assert logged_before_loss < checkpoint + SAVE_INTERVAL, (checkpoint, logged_before_loss)
    hosts = json.loads((run_dir / "hosts.json").read_text())["hosts"]  # this start's (it logged a step)
    lost_node = hosts[0]
    survivor = next(host for host in hosts if host != lost_node)
    _cluster("lose-node", lost_node)
    lost = time.monotonic()
    _signal_job([survivor], signal.SIGCONT)
    # The survivors wait in gloo for a peer that never answers: Slurm must end them, well before gloo would.
    bound = 2 * NODE_TIMEOUT + KILL_WAIT + 60  # detection, KillWait, and slack for a loaded machine
    _wait("the job to be requeued after the node loss", lambda: int(slurm.job(job_id)["Restarts"]) == 3, output,
          timeout=bound)
    requeued = time.monotonic() - lost
    _wait(f"every process of the job on {survivor} to end", lambda: not _job_processes(survivor), output,
          timeout=bound - (time.monotonic() - lost))
    ended = time.monotonic() - lost
    print(f"{lost_node} lost: job requeued after {requeued:.0f}s, every process on {survivor} ended after "
          f"{ended:.0f}s (SlurmdTimeout {NODE_TIMEOUT}s, KillWait {KILL_WAIT}s, gloo timeout {GLOO_TIMEOUT}s)")
    assert ended < GLOO_TIMEOUT
    _cluster("restore-node", lost_node)
    job = _wait("the job to end after its third restart", lambda: slurm.finished(job_id), output)
    print(f"faults job {job_id}: {time.monotonic() - started:.0f}s")
    text = output.read_text()
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0" and job["Restarts"] == "3", text[-6000:]
    assert [s for s, _ in re.findall(r"\[train\] (SIG\w+) received: stopped after step (\d+)", text)] == \
        ["SIGUSR1", "SIGTERM"], text[-6000:]
    resumed = [int(step) for step in re.findall(r"resumed from step (\d+)", text)]
    assert resumed[:2] == [first_stop, second_stop] and len(resumed) == 3, (resumed, text[-6000:])
    assert second_stop < resumed[2] < STEPS and resumed[2] % SAVE_INTERVAL == 0, resumed
    assert checkpoint <= resumed[2] <= logged_before_loss, "the last checkpoint saved before the loss"
    assert logged_before_loss > resumed[2], "steps logged after the last checkpoint were run and logged again"
    records = slurm.records(run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), "every step exactly once, in order"
    reference = slurm.records(uninterrupted["two"][1])
    slurm.assert_same_metrics(records, reference, STEPS, rel_tol=1e-5)
    assert records[-1][keys.CONSUMED_TOKENS] == reference[-1][keys.CONSUMED_TOKENS]
