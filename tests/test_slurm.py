"""The Slurm recipe: the torchrun command built from fake SLURM_* variables, nodelists, layouts, the sbatch script."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from kit.fork_server import python_executable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLURM_DIR = os.path.join(ROOT, "examples", "slurm")
SBATCH = os.path.join(SLURM_DIR, "train.sbatch")


def _load_launcher():
    """examples/slurm/launch.py is a script, not a package module: load it from its path."""
    spec = importlib.util.spec_from_file_location("slurm_launch", os.path.join(SLURM_DIR, "launch.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


launch = _load_launcher()

# What Slurm sets on the second node of `sbatch --job-name=gpt --nodes=2 --gpus-per-node=4` (job 4242).
SLURM_ENV = {
    "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "gpt", "SLURM_NNODES": "2", "SLURM_NODEID": "1",
    "SLURM_JOB_NODELIST": "node[01-02]", "SLURM_GPUS_ON_NODE": "4", "SLURM_RESTART_COUNT": "0",
}
# The package under test, for the scripts a test runs in a process of their own (a checkout on PYTHONPATH).
PACKAGE_PATH = {name: os.environ[name] for name in ("PYTHONPATH",) if name in os.environ}
EXPECTED_2x4 = ("torchrun --nnodes=2 --nproc-per-node=4 --node-rank=1 --rdzv-backend=c10d "
                "--rdzv-endpoint=node01:24242 --rdzv-id=4242 examples/train_gpt.py --tp 2 --pp 2 "
                "--run-name gpt-4242 --log-dir runs --steps 100 --microbatches 8")


@pytest.fixture(autouse=True)
def no_scontrol(monkeypatch):
    """Parse nodelists here even on a machine with Slurm installed, so the expected commands are exact."""
    real_which = shutil.which
    monkeypatch.setattr(launch.shutil, "which", lambda name: None if name == "scontrol" else real_which(name))


def job(**overrides):
    return launch.SlurmJob.from_env({**SLURM_ENV, **overrides})


# ------------------------------------------------------------------ the command


def test_command_for_2_nodes_of_4_gpus(capsys):
    argv = ["--dry-run", "--tp", "2", "--pp", "2", "--", "examples/train_gpt.py", "--steps", "100",
            "--microbatches", "8"]
    assert launch.main(argv, env=SLURM_ENV) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == EXPECTED_2x4
    assert captured.err == ""  # the layout summary comes from node 0 only


def test_node_zero_prints_the_layout_once(capsys, monkeypatch):
    # The job's $PYTHON runs the launcher and so the check: here the fork server's (imports paid once per session).
    monkeypatch.setattr(launch.sys, "executable", python_executable())
    script = os.path.join(ROOT, "examples", "train_gpt.py")
    node_zero = {**SLURM_ENV, "SLURM_NODEID": "0", **PACKAGE_PATH}
    assert launch.main(["--dry-run", "--tp", "2", "--pp", "2", script], env=node_zero) == 0
    captured = capsys.readouterr()
    assert "--node-rank=0" in captured.out
    assert "2 nodes × 4 GPUs = 8 ranks, TP2 × PP2 × CP1 × DP2; rendezvous node01:24242" in captured.err
    assert f"{script} accepts its flags for 8 ranks" in captured.err  # node 0 checks the script's flags
    with pytest.raises(SystemExit):  # a dry run of a script that is not there fails before anything is submitted
        launch.main(["--dry-run", "train.py"], env={**SLURM_ENV, "SLURM_NODEID": "0"})
    assert "train.py refuses its flags for 8 ranks" in capsys.readouterr().err


def test_restart_resumes_and_options_are_passed_on():
    requeued = job(SLURM_RESTART_COUNT="2", SLURM_NNODES="4")  # 16 GPUs for TP4 × PP2 × CP2
    command = launch.build_command(requeued, launch.layout_for(requeued, tp=4, pp=2, vpp=3, cp=2), "t.py",
                                   ["--steps", "5"], run_name="mine", log_dir="/shared/runs")
    assert command[8:] == ["--tp", "4", "--pp", "2", "--vpp", "3", "--cp", "2", "--run-name", "mine",
                           "--log-dir", "/shared/runs", "--resume", "--steps", "5"]
    first_start = launch.build_command(job(), launch.layout_for(job()), "t.py")
    assert "--resume" not in first_start and "--vpp" not in first_start and "--cp" not in first_start
    assert "--resume" in launch.build_command(job(), launch.layout_for(job()), "t.py", resume=True)


def test_overrides_and_other_slurm_variables():
    env = {**SLURM_ENV, "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "6000", "GPUS_PER_NODE": "8"}
    overridden = launch.SlurmJob.from_env(env)
    assert (overridden.master_addr, overridden.master_port, overridden.gpus_per_node) == ("10.0.0.7", 6000, 8)
    del env["GPUS_PER_NODE"], env["SLURM_GPUS_ON_NODE"]
    assert launch.SlurmJob.from_env({**env, "SLURM_GPUS_PER_NODE": "a100:4"}).gpus_per_node == 4
    older = {"SLURM_JOBID": "7", "SLURM_JOB_NUM_NODES": "1", "SLURM_NODELIST": "gpu7", "SLURM_GPUS_ON_NODE": "2"}
    assert launch.SlurmJob.from_env(older) == launch.SlurmJob("7", "job", 1, 0, 2, "gpu7", 20007, 0)
    assert launch.job_port("4242") == launch.job_port("4242") == 24242
    assert launch.PORT_BASE <= launch.job_port("12345_6") < launch.PORT_BASE + launch.PORT_SPAN


# ------------------------------------------------------------------ nodelists


@pytest.mark.parametrize("nodelist, hosts", [
    ("node01", ["node01"]),
    ("node[01-02]", ["node01", "node02"]),
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("gpu[8-10]", ["gpu8", "gpu9", "gpu10"]),
    ("gpu[08-10]", ["gpu08", "gpu09", "gpu10"]),  # zero padding from the lower bound
    ("a1,b[2-3],c", ["a1", "b2", "b3", "c"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("dgx-h100-[001-002],login", ["dgx-h100-001", "dgx-h100-002", "login"]),
])
def test_nodelists(nodelist, hosts):
    assert launch.expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist, message", [
    ("", "empty nodelist"),
    ("node[01-02", "unbalanced brackets"),
    ("node[a-b]", "cannot read the range 'a-b'"),
    ("node[05-02]", "runs backwards"),
])
def test_bad_nodelists(nodelist, message):
    with pytest.raises(launch.LaunchError, match=message):
        launch.expand_nodelist(nodelist)


# ------------------------------------------------------------------ what cannot be launched


@pytest.mark.parametrize("layout, message", [
    (dict(tp=3), r"world size 8 \(2 nodes × 4 GPUs\) is not divisible by TP×PP×CP = 3×1×1 = 3"),
    (dict(tp=2, pp=2, cp=4), r"TP×PP×CP = 2×2×4 = 16"),
    (dict(tp=0), "TP must be an int of at least 1"),
    (dict(pp=1, vpp=2), r"need PP >= 2"),
])
def test_bad_layouts(layout, message):
    with pytest.raises(launch.LaunchError, match=message):
        launch.build_command(job(), launch.layout_for(job(), **layout), "t.py")


@pytest.mark.parametrize("env, message", [
    ({key: value for key, value in SLURM_ENV.items() if key != "SLURM_JOB_ID"}, "SLURM_JOB_ID is not set"),
    ({key: value for key, value in SLURM_ENV.items() if key != "SLURM_GPUS_ON_NODE"}, "set GPUS_PER_NODE"),
    ({**SLURM_ENV, "SLURM_NODEID": "2"}, "SLURM_NODEID=2 is not a node of a 2-node job"),
    ({**SLURM_ENV, "SLURM_NNODES": "two"}, "SLURM_NNODES='two' is not an integer"),
])
def test_bad_environments(env, message):
    with pytest.raises(launch.LaunchError, match=message):
        launch.SlurmJob.from_env(env)


def test_errors_exit_2_with_the_reason(capsys):
    with pytest.raises(SystemExit) as exit_:
        launch.main(["--dry-run", "--tp", "3", "train.py"], env=SLURM_ENV)
    assert exit_.value.code == 2
    assert "error: world size 8 (2 nodes × 4 GPUs) is not divisible" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # the launcher checks the layout; the script must not change it behind its back
        launch.main(["--dry-run", "train.py", "--tp=2"], env=SLURM_ENV)
    assert "pass ['--tp=2'] as launcher options" in capsys.readouterr().err


# ------------------------------------------------------------------ the sbatch script


def test_sbatch_script_is_valid_bash():
    result = subprocess.run(["bash", "-n", SBATCH], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    with open(SBATCH) as file:
        text = file.read()
    assert "#SBATCH --requeue" in text and "trap " in text


def test_sbatch_dry_run_end_to_end(tmp_path):
    """The whole script with stand-ins for srun and scontrol: knobs → launcher → the torchrun line."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # srun: drop its options, run the task once (as node 1 would). scontrol: names of its own, to see that
    # the launcher asks Slurm first when Slurm is there.
    (bin_dir / "srun").write_text('#!/bin/bash\nwhile [[ $1 == -* ]]; do shift; done\nexec "$@"\n')
    (bin_dir / "scontrol").write_text('#!/bin/bash\n[[ "$1 $2" == "show hostnames" ]] && printf "gpu-a\\ngpu-b\\n"\n')
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHON": python_executable(), "DRY_RUN": "1",
           "TP": "2", "PP": "2", "STEPS": "100", "MICROBATCHES": "8", "BACKENDS": "stdout jsonl wandb",
           **SLURM_ENV, "SLURM_RESTART_COUNT": "1"}
    result = subprocess.run(["bash", SBATCH], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    torchrun = [line for line in result.stdout.splitlines() if line.startswith("torchrun")]
    assert torchrun == ["torchrun --nnodes=2 --nproc-per-node=4 --node-rank=1 --rdzv-backend=c10d "
                        "--rdzv-endpoint=gpu-a:24242 --rdzv-id=4242 examples/train_gpt.py --tp 2 --pp 2 "
                        "--run-name gpt-4242 --log-dir runs --resume --steps 100 --micro-batch-size 4 "
                        "--microbatches 8 --log-interval 10 --save-interval 100 --backends stdout jsonl wandb"]


def test_sbatch_dry_run_without_an_allocation(tmp_path):
    """`DRY_RUN=1 bash train.sbatch` outside Slurm: no srun needed; one torchrun line per node of NODES."""
    env = {"PATH": os.environ["PATH"], "PYTHON": python_executable(), "DRY_RUN": "1", "NODES": "2",
           "GPUS_PER_NODE": "4", "HOME": str(tmp_path), **PACKAGE_PATH}
    result = subprocess.run(["bash", SBATCH], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "DRY_RUN outside an allocation: NODES=2 × GPUS_PER_NODE=4" in result.stdout
    torchrun = [line for line in result.stdout.splitlines() if line.startswith("torchrun")]
    assert [line.split()[3] for line in torchrun] == ["--node-rank=0", "--node-rank=1"]
    for line in torchrun:
        assert line.startswith("torchrun --nnodes=2 --nproc-per-node=4 ")
        assert "--rdzv-endpoint=node1:20000 --rdzv-id=0 examples/train_gpt.py --tp 2 --pp 2 --run-name twinkle-gpt-0" \
            in line


def test_sbatch_exports_cuda_device_max_connections():
    with open(SBATCH) as file:
        assert "export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}" in file.read()


def test_torchrun_is_started_ignoring_usr1(tmp_path):
    """Slurm signals every process of a step; USR1 must reach the training ranks without killing torchrun."""
    fake_torchrun = tmp_path / "torchrun"
    fake_torchrun.write_text(f"#!{sys.executable}\nimport signal\nprint(signal.getsignal(signal.SIGUSR1).name)\n")
    fake_torchrun.chmod(0o755)
    env = {**SLURM_ENV, "PATH": os.environ["PATH"]}
    result = subprocess.run([sys.executable, os.path.join(SLURM_DIR, "launch.py"), "--torchrun", str(fake_torchrun),
                             "train.py"], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "SIG_IGN"


# ------------------------------------------------------------------ DRY_RUN checks the model too; the documented lines


def _dry_run(tmp_path, **knobs):
    env = {"PATH": os.environ["PATH"], "PYTHON": python_executable(), "HOME": str(tmp_path), "DRY_RUN": "1",
           **PACKAGE_PATH, **knobs}
    return subprocess.run(["bash", SBATCH], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)


def test_dry_run_checks_the_model_flags_against_the_layout_before_anything_is_submitted(tmp_path):
    refused = _dry_run(tmp_path, NODES="2", GPUS_PER_NODE="4", TP="2", PP="4", VPP="2")
    assert refused.returncode == 2
    assert "train_gpt.py: error: --layers 4 is not divisible by --pp 4 × --vpp 2 = 8 pipeline stages" \
        in refused.stderr.splitlines()[-1]
    assert "torchrun" not in refused.stdout  # refused before any command is printed
    accepted = _dry_run(tmp_path, NODES="2", GPUS_PER_NODE="4", TP="2", PP="4", VPP="2", TRAIN_ARGS="--layers 8")
    assert accepted.returncode == 0, accepted.stderr
    assert "examples/train_gpt.py accepts its flags for 8 ranks" in accepted.stderr
    assert len([line for line in accepted.stdout.splitlines() if line.startswith("torchrun")]) == 2


def test_the_world_size_is_checked_with_the_script_as_torchrun_would_start_it(tmp_path):
    """The check runs as rank 0 of the job's world: the script's own torchrun checks apply (--dp against it)."""
    refused = _dry_run(tmp_path, NODES="1", GPUS_PER_NODE="4", TP="2", PP="2", TRAIN_ARGS="--dp 2")
    assert refused.returncode == 2
    assert "--dp 2 does not match torchrun's 4 ranks / 4 = 1" in refused.stderr


def test_dry_run_refuses_unknown_and_uninstalled_backends(tmp_path):
    """BACKENDS with a misspelt name and a backend whose package is missing fails the dry run, before any command
    is printed. The package is made missing in the job's Python by a ``sys.modules`` entry of None (planted by a
    sitecustomize), so this holds whether or not wandb is installed here."""
    planted = tmp_path / "planted"
    planted.mkdir()
    (planted / "sitecustomize.py").write_text("import sys\nsys.modules['wandb'] = None\n")
    python_path = os.pathsep.join(filter(None, [str(planted), os.environ.get("PYTHONPATH")]))
    # A real interpreter, not the fork server's: a sitecustomize runs only when an interpreter starts.
    refused = _dry_run(tmp_path, NODES="1", GPUS_PER_NODE="4", BACKENDS="stdout wandbb wandb", PYTHONPATH=python_path,
                       PYTHON=sys.executable)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert refused.stderr.splitlines()[-1] == (
        "launch.py: error: examples/train_gpt.py refuses its flags for 4 ranks: train_gpt.py: error: --backends "
        "wandbb: unknown (choose from stdout jsonl tensorboard wandb swanlab mlflow); --backends: logging backend "
        "'wandb' needs the package 'wandb', which is not installed: pip install 'twinkle-megatron[wandb]', or leave "
        "'wandb' out of the backends")
    assert "torchrun" not in refused.stdout


def test_a_script_without_check_flags_is_reported_unchecked(tmp_path):
    script = tmp_path / "mine.py"
    script.write_text("import argparse\nparser = argparse.ArgumentParser()\n"
                      "for flag in ('--tp', '--pp', '--run-name', '--log-dir', '--steps', '--micro-batch-size', "
                      "'--microbatches', '--log-interval', '--save-interval'):\n    parser.add_argument(flag)\n"
                      "parser.parse_args()\n")
    done = _dry_run(tmp_path, NODES="1", GPUS_PER_NODE="4", TRAIN_SCRIPT=str(script))
    assert done.returncode == 0, done.stderr
    assert f"note: {script} has no --check-flags: its own flags were not checked" in done.stderr


def test_a_missing_environment_is_one_line(tmp_path):
    """The job runs with the submitting shell's Python: without the package, one error line, status 2."""
    for script in (os.path.join(SLURM_DIR, "launch.py"), os.path.join(ROOT, "examples", "train_gpt.py")):
        done = subprocess.run([sys.executable, "-S", script, "--help"], env={**SLURM_ENV, "PATH": os.environ["PATH"]},
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "error:" in lines[0] and "cannot import" in lines[0], done.stderr


DOCUMENTED = [Path(ROOT) / "README.md", *sorted((Path(ROOT) / "docs").glob("*.md")), Path(SLURM_DIR) / "README.md"]


def _documented_submissions():
    """Every shell line of the docs that runs examples/slurm/train.sbatch, with the error a comment after it
    expects (``# launch.py: error: ...``), if any."""
    found = []
    for page in DOCUMENTED:
        if not page.exists():
            continue
        blocks = re.findall(r"^```(?:bash|sh|console|shell)\n(.*?)^```", page.read_text(), re.M | re.S)
        for block in blocks:
            lines = block.replace("\\\n", " ").splitlines()
            for index, line in enumerate(lines):
                command = line.split(" #", 1)[0].strip()
                if "examples/slurm/train.sbatch" not in command or command.startswith("#"):
                    continue
                expected = []
                for comment in lines[index + 1:]:
                    if not comment.startswith("#") or (expected == [] and "error:" not in comment):
                        break
                    expected.append(comment.lstrip("#").strip())
                found.append(pytest.param(command, " ".join(expected), id=f"{page.relative_to(ROOT)}: {command[:60]}"))
    return found


SUBMISSIONS = _documented_submissions()


def _knobs(command: str) -> dict[str, str]:
    """A documented `sbatch` line as the dry run's variables: its leading NAME=value words, and its
    --nodes/--gpus-per-node as NODES/GPUS_PER_NODE."""
    words = shlex.split(command)
    knobs = {}
    while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
        name, value = words.pop(0).split("=", 1)
        knobs[name] = value
    for word in words:
        option = re.fullmatch(r"--(nodes|gpus-per-node)=(\d+)", word)
        if option and not (option.group(1) == "gpus-per-node" and option.group(2) == "0"):  # CPU: GPUS_PER_NODE
            knobs.setdefault({"nodes": "NODES", "gpus-per-node": "GPUS_PER_NODE"}[option.group(1)], option.group(2))
    return knobs


@pytest.fixture(scope="module")
def documented_dry_runs(tmp_path_factory) -> dict:
    """The dry run of each distinct documented submission (pages repeat some), two at a time: each spends most
    of its ~10 s importing megatron-core in its own process (the flag check), and one by one they would leave
    a 2-core machine's second core idle."""
    distinct = {tuple(sorted(_knobs(submission.values[0]).items())) for submission in SUBMISSIONS}
    with ThreadPoolExecutor(max_workers=2) as pool:
        running = {knobs: pool.submit(_dry_run, tmp_path_factory.mktemp("home"), **dict(knobs)) for knobs in distinct}
    return {knobs: done.result() for knobs, done in running.items()}


def _uninstalled_backends(knobs: dict[str, str]) -> list[str]:
    """The backends of a submission's BACKENDS whose package (named as the backend) is not installed here."""
    return [name for name in knobs.get("BACKENDS", "").split()
            if name in ("tensorboard", "wandb", "swanlab", "mlflow") and importlib.util.find_spec(name) is None]


@pytest.mark.parametrize("command, expected_error", SUBMISSIONS)
def test_every_documented_submission_passes_its_dry_run(command, expected_error, documented_dry_runs):
    """Each documented `sbatch` line, as DRY_RUN=1 with its --nodes/--gpus-per-node as NODES/GPUS_PER_NODE.

    A line naming a logging backend that is not installed here (``BACKENDS="... wandb"`` without wandb) is
    refused by that dry run, as it would be before a submission: the test expects the refusal then."""
    knobs = _knobs(command)
    done = documented_dry_runs[tuple(sorted(knobs.items()))]
    uninstalled = _uninstalled_backends(knobs)
    if uninstalled and not expected_error:
        expected_error = (f"logging backend {uninstalled[0]!r} needs the package {uninstalled[0]!r}, which is not "
                          f"installed: pip install 'twinkle-megatron[{uninstalled[0]}]'")
    if expected_error:
        assert done.returncode == 2 and expected_error in " ".join(done.stderr.split()), done.stderr
    else:
        assert done.returncode == 0, done.stderr
        assert "torchrun" in done.stdout
