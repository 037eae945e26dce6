"""Logging backends checked before training: unknown names and missing packages raise when asked
(``check_backends``, ``TrackerConfig(strict_backends=True)``, ``train_gpt.py --backends``), never at the
first log step; the default still warns and goes on (tests/test_logging.py).

Whether wandb, mlflow, swanlab or tensorboard are installed here does not matter: a package is made
missing with a ``None`` entry in ``sys.modules`` (what ``import`` and ``importlib.util.find_spec`` both
read as "not there"), or broken with a module of that name planted first on ``sys.path``. The DRY_RUN=1
path of the Slurm recipe is tested in tests/test_slurm.py.
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

import pytest
from kit.example_script import load_train_gpt

from twinkle_megatron.logging import (
    BACKEND_CLASSES,
    Backend,
    BackendUnavailableError,
    JsonlBackend,
    MlflowBackend,
    WandbBackend,
    check_backends,
    read_jsonl,
)
from twinkle_megatron.testing.distributed import run_distributed
from twinkle_megatron.tracker import MetricsTracker, TrackerConfig

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "train_gpt.py"


train_gpt = load_train_gpt("train_gpt_backends")


@pytest.fixture
def missing(monkeypatch):
    """Make packages missing for this test: ``missing("wandb", ...)``."""
    def make_missing(*packages: str) -> None:
        for package in packages:
            monkeypatch.setitem(sys.modules, package, None)
    return make_missing


@pytest.fixture
def broken_wandb(monkeypatch, tmp_path):
    """A ``wandb`` that is found but fails on import (a broken dependency), whether or not wandb is installed."""
    (tmp_path / "wandb.py").write_text("raise ImportError('planted: a dependency of wandb is broken')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "wandb", raising=False)  # a wandb imported earlier would be returned as is


class _Needs(Backend):
    """A user's backend that needs a package of its own and declares no twinkle-megatron extra."""

    name = "mine"
    requires = ("no_such_package_for_twinkle_tests",)

    def write(self, record, step):  # pragma: no cover - never opened here
        pass


def test_every_backend_declares_its_package_and_extra():
    needs = {name: (cls.requires, cls.pip_extra) for name, cls in BACKEND_CLASSES.items()}
    assert needs == {"stdout": ((), None), "jsonl": ((), None), "tensorboard": (("tensorboard",), "tensorboard"),
                     "wandb": (("wandb",), "wandb"), "swanlab": (("swanlab",), "swanlab"),
                     "mlflow": (("mlflow",), "mlflow")}
    with open(Path(__file__).resolve().parents[1] / "setup.py") as setup:  # the extras named exist
        text = setup.read()
    for _, extra in needs.values():
        assert extra is None or f'"{extra}": ["{extra}"]' in text


def test_missing_packages_are_named_with_their_backend_and_extra(missing):
    missing("wandb", "mlflow")
    with pytest.raises(BackendUnavailableError) as error:
        check_backends(["stdout", "jsonl", "wandb", MlflowBackend(experiment="x"), "wandb"])
    assert isinstance(error.value, ImportError)
    assert str(error.value) == (
        "logging backend 'wandb' needs the package 'wandb', which is not installed: "
        "pip install 'twinkle-megatron[wandb]', or leave 'wandb' out of the backends; "
        "logging backend 'mlflow' needs the package 'mlflow', which is not installed: "
        "pip install 'twinkle-megatron[mlflow]', or leave 'mlflow' out of the backends")  # each once
    with pytest.raises(BackendUnavailableError, match=r"backend 'mine' needs the package "
                                                      r"'no_such_package_for_twinkle_tests', which is not installed: "
                                                      r"install 'no_such_package_for_twinkle_tests'"):
        check_backends([_Needs()])
    check_backends(["stdout", "jsonl", JsonlBackend("unused.jsonl")])  # need nothing: no error


def test_unknown_names_are_a_value_error():
    with pytest.raises(ValueError, match=r"unknown logging backend 'wandbb'; unknown logging backend 'csv'; "
                                         r"expected one of \('stdout', 'jsonl'"):
        check_backends(["stdout", "wandbb", "csv"])


def test_the_check_imports_nothing_unless_asked(broken_wandb):
    """find_spec finds a package without running it; import_packages=True runs it and reports why it fails."""
    check_backends(["wandb"])
    assert "wandb" not in sys.modules
    with pytest.raises(BackendUnavailableError, match=r"logging backend 'wandb' needs the package 'wandb', which is "
                                                      r"installed but fails to import \(ImportError: planted: a "
                                                      r"dependency of wandb is broken\)"):
        check_backends(["wandb"], import_packages=True)


def test_the_check_takes_milliseconds(missing):
    missing("wandb", "swanlab", "mlflow", "tensorboard")
    started = time.perf_counter()
    for _ in range(100):
        with pytest.raises(BackendUnavailableError):
            check_backends(list(BACKEND_CLASSES))
    assert (time.perf_counter() - started) / 100 < 0.01


# ------------------------------------------------------------------ TrackerConfig(strict_backends=True)


def test_strict_config_raises_at_construction_default_warns_at_the_first_log(missing, tmp_path):
    missing("wandb", "tensorboard")
    with pytest.raises(ImportError, match=r"backend 'tensorboard' needs the package 'tensorboard', which is not "
                                          r"installed: pip install 'twinkle-megatron\[tensorboard\]'.*backend "
                                          r"'wandb' needs the package 'wandb'"):
        TrackerConfig(backends=("tensorboard", "wandb"), strict_backends=True, log_dir=str(tmp_path))
    with pytest.raises(ImportError, match="backend 'wandb'"):  # a Backend object is checked as its name is
        TrackerConfig(backends=(WandbBackend(),), strict_backends=True)
    with pytest.raises(ValueError, match="TrackerConfig.strict_backends must be a bool, got 'yes'"):
        TrackerConfig(strict_backends="yes")
    strict = TrackerConfig(backends=("stdout", "jsonl"), strict_backends=True, log_dir=str(tmp_path), log_interval=1)
    assert strict.strict_backends  # installed backends build

    # The default: the same backends build, then each is disabled with one warning at the first log step.
    jsonl = JsonlBackend(str(tmp_path / "m.jsonl"))
    tracker = MetricsTracker(config=TrackerConfig(log_interval=1, backends=("tensorboard", "wandb", jsonl),
                                                  log_dir=str(tmp_path)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tracker.end_step(loss=1.0)
        tracker.end_step(loss=1.0)
    tracker.close()
    disabled = [str(w.message) for w in caught if "is disabled" in str(w.message)]
    assert len(disabled) == 2 and "'tensorboard'" in disabled[0] and "'wandb'" in disabled[1]
    assert [record["step"] for record in read_jsonl(jsonl.path)] == [1, 2]


def _strict_tracker_on_this_rank(log_dir: str) -> str:
    sys.modules["wandb"] = None  # every rank lacks it, as every rank of a job shares one environment
    try:
        MetricsTracker(config=TrackerConfig(backends=("stdout", "wandb"), strict_backends=True, log_dir=log_dir))
    except ImportError as error:
        return str(error).split(",")[0]
    return "built"


def test_strict_config_stops_every_rank_before_any_collective(tmp_path):
    """Each rank checks its own environment: all raise together, none waits for the writer in a collective."""
    assert run_distributed(_strict_tracker_on_this_rank, 2, args=(str(tmp_path),)) == \
        ["logging backend 'wandb' needs the package 'wandb'"] * 2


# ------------------------------------------------------------------ examples/train_gpt.py


def _refused(monkeypatch, capsys, *flags: str) -> str:
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as exit_:
        train_gpt.parse_args(list(flags))
    assert exit_.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1].split(" error: ", 1)[1]


def test_train_gpt_refuses_unknown_and_missing_backends(monkeypatch, capsys, missing):
    missing("wandb")
    for check in ((), ("--check-flags",)):
        line = _refused(monkeypatch, capsys, "--backends", "stdout", "wandbb", "wandb", *check)
        assert line == ("--backends wandbb: unknown (choose from stdout jsonl tensorboard wandb "
                        "swanlab mlflow); --backends: logging backend 'wandb' needs the package 'wandb', which is not "
                        "installed: pip install 'twinkle-megatron[wandb]', or leave 'wandb' out of the backends")
    assert train_gpt.parse_args(["--backends", "stdout", "jsonl", "--check-flags"]).backends == ["stdout", "jsonl"]


def test_train_gpt_check_flags_imports_the_packages(monkeypatch, capsys, broken_wandb):
    """--check-flags (what DRY_RUN=1 runs) imports each package; a training run only finds it, on every rank."""
    assert train_gpt.parse_args(["--backends", "stdout", "wandb"]).backends == ["stdout", "wandb"]
    line = _refused(monkeypatch, capsys, "--backends", "stdout", "wandb", "--check-flags")
    assert line == ("--backends: logging backend 'wandb' needs the package 'wandb', which is installed but "
                    "fails to import (ImportError: planted: a dependency of wandb is broken): pip install "
                    "'twinkle-megatron[wandb]', or leave 'wandb' out of the backends")
