"""Build the ``torchrun`` command of one node of a Slurm job: ``python examples/slurm/launch.py``.

``examples/slurm/train.sbatch`` runs this once per node under ``srun``. It reads
the job from the ``SLURM_*`` variables, checks the parallel layout against the
number of GPUs, and replaces itself with::

    torchrun --nnodes=N --nproc-per-node=G --node-rank=R --rdzv-backend=c10d
             --rdzv-endpoint=HOST:PORT --rdzv-id=JOB_ID SCRIPT --tp T --pp P [--vpp V] [--cp C]
             --run-name NAME --log-dir DIR [--resume] SCRIPT_ARGS...

* HOST is the job's first node: ``$MASTER_ADDR`` if set, else the first name
  of ``scontrol show hostnames $SLURM_JOB_NODELIST``, else the nodelist parsed
  here (``node[01-04,07]``), so the command can be checked without Slurm.
* PORT is ``$MASTER_PORT`` if set, else derived from the job id: every node
  computes the same port without talking to the others, and two jobs sharing a
  node rarely collide.
* torchrun ignores SIGUSR1 (the launcher ignores it before the exec): Slurm sends
  the time-limit warning to every process of the step, and only the training
  processes should act on it (checkpoint and stop).
* ``--resume`` is added when Slurm restarted the job (``SLURM_RESTART_COUNT`` > 0:
  a requeue after preemption or the time limit) or when asked for. The run name
  defaults to ``JOBNAME-JOBID``; a requeued job keeps its id, hence its run
  directory, its checkpoint and its W&B run (whose id the W&B backend records
  in the run directory).

``--dry-run`` prints the command instead of running it, after checking (on node 0) that the
training script accepts its flags for the job's world: it runs the script once with
``--check-flags`` (``examples/train_gpt.py`` checks its model against the layout and exits),
so ``DRY_RUN=1`` catches what would otherwise fail only once the job has started. The training script
must accept ``--tp``, ``--pp``, ``--vpp`` (when given), ``--cp`` (when > 1),
``--run-name``, ``--log-dir`` and ``--resume``, as ``examples/train_gpt.py`` does.

Not part of the ``twinkle_megatron`` package: the flags above are the demo's
conventions, not the plugin's API; copy this file next to your own training
script and adapt them. Besides the standard library it imports only the
package's ``Layout`` (the same validation the training script and the tests
use), which loads torch: about 2 s once per node, before ``torchrun`` loads it
again. Unit-tested with fake ``SLURM_*`` variables in ``tests/test_slurm.py``.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import zlib
from dataclasses import dataclass
from typing import Callable, List, Mapping, Optional, Sequence

try:
    from twinkle_megatron.parallel import Layout
except ImportError as _missing:  # the job runs with the submitting shell's environment: say so in one line
    print(f"launch.py: error: {sys.executable} cannot import twinkle_megatron ({_missing}); activate the "
          "environment that has it installed (pip install -e .) before sbatch, or set PYTHON", file=sys.stderr)
    sys.exit(2)

# Below Linux's ephemeral port range (32768-60999), so an outgoing connection of
# another process cannot already hold the port we pick.
PORT_BASE = 20000
PORT_SPAN = 10000

# Flags the launcher sets itself; given again among the script's arguments they
# would silently override (or fight with) the layout that was checked.
_OWN_FLAGS = ("--tp", "--pp", "--vpp", "--cp", "--run-name", "--log-dir", "--resume")


class LaunchError(ValueError):
    """A job or layout that cannot be launched; the message says why and what to change."""


# ------------------------------------------------------------------ nodelists


def expand_nodelist(nodelist: str) -> List[str]:
    """Host names of a Slurm nodelist, in order, the way ``scontrol show hostnames`` lists them.

    Handles comma lists (``a,b``), bracket ranges with zero padding taken from
    the lower bound (``node[08-10]`` -> ``node08 node09 node10``), mixed ranges and
    single numbers (``gpu[1-3,7]``) and several brackets in one name
    (``rack[1-2]-n[1-2]`` -> ``rack1-n1 rack1-n2 rack2-n1 rack2-n2``).
    """
    hosts: List[str] = []
    for item in _split_top_level(nodelist.strip()):
        hosts.extend(_expand_host(item, nodelist))
    if not hosts:
        raise LaunchError(f"empty nodelist {nodelist!r}")
    return hosts


def _split_top_level(text: str) -> List[str]:
    """Split at the commas that are outside brackets (commas inside separate ranges)."""
    items, depth, start = [], 0, 0
    for index, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        elif char == "," and depth == 0:
            items.append(text[start:index])
            start = index + 1
    items.append(text[start:])
    return [item for item in items if item]


def _expand_host(pattern: str, nodelist: str) -> List[str]:
    match = re.search(r"\[([^\[\]]*)\]", pattern)
    if match is None:
        if "[" in pattern or "]" in pattern:
            raise LaunchError(f"unbalanced brackets in nodelist {nodelist!r}")
        return [pattern]
    head, tail = pattern[:match.start()], pattern[match.end():]
    hosts = []
    for number in _expand_ranges(match.group(1), nodelist):
        hosts.extend(_expand_host(head + number + tail, nodelist))  # later brackets of the same name
    return hosts


def _expand_ranges(ranges: str, nodelist: str) -> List[str]:
    numbers = []
    for part in ranges.split(","):
        bounds = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if bounds is None:
            raise LaunchError(f"cannot read the range {part!r} in nodelist {nodelist!r}")
        low, high = bounds.group(1), bounds.group(2) or bounds.group(1)
        if int(high) < int(low):
            raise LaunchError(f"range {part!r} in nodelist {nodelist!r} runs backwards")
        width = len(low)  # Slurm pads to the width of the lower bound: 08-10 -> 08 09 10
        numbers.extend(f"{value:0{width}d}" for value in range(int(low), int(high) + 1))
    return numbers


def slurm_hostnames(nodelist: str) -> List[str]:
    """``scontrol show hostnames`` when Slurm is installed (it knows every site's syntax), else our parser."""
    scontrol = shutil.which("scontrol")
    if scontrol is not None:
        try:
            result = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True, text=True,
                                    timeout=30)
        except (OSError, subprocess.TimeoutExpired):  # a broken or hung Slurm client: parse it ourselves
            result = None
        hosts = result.stdout.split() if result is not None and result.returncode == 0 else []
        if hosts:
            return hosts
    return expand_nodelist(nodelist)


# ------------------------------------------------------------------ the job and the layout


@dataclass(frozen=True)
class SlurmJob:
    """What one node of the job needs to know to join the rendezvous."""

    job_id: str
    job_name: str
    nnodes: int
    node_rank: int
    gpus_per_node: int
    master_addr: str
    master_port: int
    restart_count: int = 0

    @property
    def world_size(self) -> int:
        return self.nnodes * self.gpus_per_node

    @classmethod
    def from_env(cls, env: Mapping[str, str],
                 hostnames: Callable[[str], List[str]] = slurm_hostnames) -> SlurmJob:
        """Read the job from ``SLURM_*`` variables (and the ``GPUS_PER_NODE``, ``MASTER_ADDR``,
        ``MASTER_PORT`` overrides); ``hostnames`` expands the nodelist."""
        job_id = _first(env, "SLURM_JOB_ID", "SLURM_JOBID")
        if job_id is None:
            raise LaunchError("SLURM_JOB_ID is not set: run inside a Slurm job (sbatch/srun), "
                              "or set the SLURM_* variables by hand for a --dry-run")
        nnodes = _int_var(env, "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
        node_rank = _int_var(env, "SLURM_NODEID", default=0)
        gpus = _gpus_per_node(env)
        master_addr = env.get("MASTER_ADDR")
        if not master_addr:
            nodelist = _first(env, "SLURM_JOB_NODELIST", "SLURM_NODELIST")
            if nodelist is None:
                raise LaunchError("SLURM_JOB_NODELIST is not set, so the first node (the rendezvous host) "
                                  "is unknown; set MASTER_ADDR")
            master_addr = hostnames(nodelist)[0]
        port = env.get("MASTER_PORT")
        master_port = _int_text(port, "MASTER_PORT") if port else job_port(job_id)
        if not 0 <= node_rank < nnodes:
            raise LaunchError(f"SLURM_NODEID={node_rank} is not a node of a {nnodes}-node job")
        return cls(job_id=job_id, job_name=env.get("SLURM_JOB_NAME", "job"), nnodes=nnodes, node_rank=node_rank,
                   gpus_per_node=gpus, master_addr=master_addr, master_port=master_port,
                   restart_count=_int_var(env, "SLURM_RESTART_COUNT", default=0))


def job_port(job_id: str) -> int:
    """The rendezvous port of a job: the same on every node, different for consecutive job ids."""
    number = int(job_id) if job_id.isdigit() else zlib.crc32(job_id.encode())  # crc32: stable across processes
    return PORT_BASE + number % PORT_SPAN


def layout_for(job: SlurmJob, tp: int = 1, pp: int = 1, cp: int = 1, vpp: Optional[int] = None) -> Layout:
    """The job's layout: data parallelism takes the GPUs TP×PP×CP leaves; a :class:`LaunchError` when it cannot."""
    try:
        return Layout.for_world(job.world_size, tp=tp, pp=pp, cp=cp, vpp=vpp)
    except ValueError as error:
        where = f" ({job.nnodes} nodes × {job.gpus_per_node} GPUs)"
        message = str(error).replace(f"world size {job.world_size}", f"world size {job.world_size}{where}")
        raise LaunchError(f"{message}; change the layout or the number of nodes/GPUs") from error


# ------------------------------------------------------------------ the command


def build_command(job: SlurmJob, layout: Layout, script: str, script_args: Sequence[str] = (), *,
                  run_name: Optional[str] = None, log_dir: str = "runs", resume: bool = False,
                  torchrun: str = "torchrun") -> List[str]:
    """The ``torchrun`` command (as a list) for this node of ``job`` (``layout``: see :func:`layout_for`).

    ``run_name`` defaults to ``JOBNAME-JOBID``. ``--resume`` is passed when
    ``resume`` is true or Slurm restarted the job.
    """
    if layout.world_size != job.world_size:
        raise LaunchError(f"the layout {layout} needs {layout.world_size} ranks, the job has {job.world_size}")
    clashes = [arg for arg in script_args if arg.split("=", 1)[0] in _OWN_FLAGS]
    if clashes:
        raise LaunchError(f"the launcher sets {', '.join(_OWN_FLAGS)} itself (it checks the layout); "
                          f"pass {clashes} as launcher options instead of script arguments")
    command = [torchrun, f"--nnodes={job.nnodes}", f"--nproc-per-node={job.gpus_per_node}",
               f"--node-rank={job.node_rank}", "--rdzv-backend=c10d",
               f"--rdzv-endpoint={job.master_addr}:{job.master_port}", f"--rdzv-id={job.job_id}"]
    return command + script_command(job, layout, script, script_args, run_name=run_name, log_dir=log_dir,
                                    resume=resume)


def script_command(job: SlurmJob, layout: Layout, script: str, script_args: Sequence[str] = (), *,
                   run_name: Optional[str] = None, log_dir: str = "runs", resume: bool = False) -> List[str]:
    """The training script and its arguments, as torchrun starts it on every rank (see :func:`build_command`)."""
    command = [script, "--tp", str(layout.tp), "--pp", str(layout.pp)]
    if layout.vpp is not None:
        command += ["--vpp", str(layout.vpp)]
    if layout.cp > 1:  # only when used: a script without context parallelism need not know the flag
        command += ["--cp", str(layout.cp)]
    command += ["--run-name", run_name or f"{job.job_name}-{job.job_id}", "--log-dir", log_dir]
    if resume or job.restart_count > 0:
        command.append("--resume")
    return command + list(script_args)


CHECK_FLAG = "--check-flags"


def check_script_flags(job: SlurmJob, script: Sequence[str], env: Mapping[str, str],
                       python: Optional[str] = None) -> str:
    """Run ``script`` (the script and its arguments) with ``--check-flags`` as rank 0 of the job's world.

    ``examples/train_gpt.py --check-flags`` checks its model flags against the layout and the
    world size (heads by TP, layers by PP × VPP, ...) and exits: 0 when they work, 2 with one
    ``error:`` line. Returns a line for the job output; raises :class:`LaunchError` with the
    script's error. A script without the flag is reported as unchecked, not refused. ``python``: the
    interpreter that runs the check (default: the one running this launcher, the job's ``$PYTHON``).
    """
    rank_env = {**env, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(job.world_size)}
    try:
        done = subprocess.run([python or sys.executable, *script, CHECK_FLAG], env=rank_env, capture_output=True,
                              text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise LaunchError(f"cannot check the flags of {script[0]}: {error}") from None
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    if done.returncode == 0:
        return f"{script[0]} accepts its flags for {job.world_size} ranks"
    if any(f"unrecognized arguments: {CHECK_FLAG}" in line for line in errors):
        return f"note: {script[0]} has no {CHECK_FLAG}: its own flags were not checked"
    reason = errors[-1] if errors else f"exit status {done.returncode}"
    raise LaunchError(f"{script[0]} refuses its flags for {job.world_size} ranks: {reason}")


# ------------------------------------------------------------------ command line


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="launch.py",
        description="Run (or print, with --dry-run) this node's torchrun command of a Slurm job.",
        epilog="example (one task per node):\n  srun --ntasks-per-node=1 python examples/slurm/launch.py "
               "--tp 2 --pp 2 -- examples/train_gpt.py --steps 1000",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default 1)")
    parser.add_argument("--vpp", type=int, default=None, help="virtual pipeline stages per rank (default none)")
    parser.add_argument("--cp", type=int, default=1, help="context-parallel size (default 1; passed on when > 1)")
    parser.add_argument("--run-name", default=None, help="default: $SLURM_JOB_NAME-$SLURM_JOB_ID")
    parser.add_argument("--log-dir", default="runs", help="root of the run directories: LOG_DIR/RUN_NAME")
    parser.add_argument("--resume", action="store_true",
                        help="pass --resume even on the first start (always passed after a Slurm restart)")
    parser.add_argument("--torchrun", default="torchrun", help="the torchrun executable (default: torchrun)")
    parser.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    parser.add_argument("script", help="the training script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments (after the script)")
    return parser


def main(argv: Optional[Sequence[str]] = None, env: Optional[Mapping[str, str]] = None) -> int:
    """Build this node's command; print it (``--dry-run``) or replace this process with it."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.script_args[:1] == ["--"]:  # `launch script -- args`: some Python versions keep the separator
        args.script_args = args.script_args[1:]
    env = os.environ if env is None else env
    try:
        job = SlurmJob.from_env(env)
        layout = layout_for(job, tp=args.tp, pp=args.pp, cp=args.cp, vpp=args.vpp)
        command = build_command(job, layout, args.script, args.script_args, run_name=args.run_name,
                                log_dir=args.log_dir, resume=args.resume, torchrun=args.torchrun)
    except LaunchError as error:
        parser.error(str(error))  # "error: ..." on stderr, exit 2
    data_parallel = layout.dp
    if job.node_rank == 0:  # one summary per job in the Slurm output, not one per node
        print(f"[launch] job {job.job_id}: {job.nnodes} nodes × {job.gpus_per_node} GPUs = {job.world_size} ranks, "
              f"TP{layout.tp} × PP{layout.pp} × CP{layout.cp} × DP{data_parallel}; rendezvous "
              f"{job.master_addr}:{job.master_port}; restart {job.restart_count}", file=sys.stderr, flush=True)
    if layout.tp > job.gpus_per_node:
        print(f"[launch] warning: TP={layout.tp} > {job.gpus_per_node} GPUs per node: tensor-parallel "
              "collectives will cross nodes (slow)", file=sys.stderr, flush=True)
    if args.dry_run:
        if job.node_rank == 0:  # the flags are the same on every node: check them once, before anything runs
            script = script_command(job, layout, args.script, args.script_args, run_name=args.run_name,
                                    log_dir=args.log_dir, resume=args.resume)
            try:
                print(f"[launch] {check_script_flags(job, script, env)}", file=sys.stderr, flush=True)
            except LaunchError as error:
                parser.error(str(error))
        print(shlex.join(command), flush=True)
        return 0
    try:
        # Slurm signals every process of the job step. torchrun passes TERM on to its workers
        # and stops them, but USR1 would kill torchrun itself: it ignores USR1 from here on
        # (ignored signals stay ignored across exec), and the training processes, which set
        # their own USR1 handler, checkpoint and exit.
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        # exec, not a child: Slurm's signals (preemption, time limit) then reach torchrun directly.
        os.execvp(command[0], command)
    except OSError as error:
        parser.error(f"cannot run {command[0]!r}: {error}")
    return 0  # not reached


# ------------------------------------------------------------------ helpers


def _first(env: Mapping[str, str], *names: str) -> Optional[str]:
    for name in names:
        if env.get(name):
            return env[name]
    return None


def _int_text(text: str, name: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise LaunchError(f"{name}={text!r} is not an integer") from None


def _int_var(env: Mapping[str, str], *names: str, default: Optional[int] = None) -> int:
    text = _first(env, *names)
    if text is None:
        if default is None:
            raise LaunchError(f"{' or '.join(names)} is not set")
        return default
    return _int_text(text, names[0])


def _gpus_per_node(env: Mapping[str, str]) -> int:
    """``$GPUS_PER_NODE`` (an explicit override), else what Slurm allocated on this node."""
    text = _first(env, "GPUS_PER_NODE", "SLURM_GPUS_ON_NODE")
    if text is None:
        # --gpus-per-node=4 or =a100:4 sets SLURM_GPUS_PER_NODE: the count is the last number.
        gres = _first(env, "SLURM_GPUS_PER_NODE")
        found = re.search(r"(\d+)(?:\(x\d+\))?$", gres or "")
        if found is None:
            raise LaunchError("cannot tell how many GPUs a node has: request them with --gpus-per-node, "
                              "or set GPUS_PER_NODE")
        text = found.group(1)
    gpus = _int_text(text, "GPUS_PER_NODE")
    if gpus < 1:
        raise LaunchError(f"GPUs per node must be at least 1, got {gpus}")
    return gpus


if __name__ == "__main__":
    sys.exit(main())
