"""Megatron-Bridge's own training code, downloaded at test time and imported unmodified behind the smallest stubs.

``load_bridge()`` brings ``megatron-bridge==0.6.2`` from the package index
(``pip download --no-deps`` into ``.cache/megatron-bridge/``, outside git; its
metadata asks for Python ≥ 3.12, its code runs on 3.11), unpacks the wheel and
imports, unmodified:

* ``megatron.bridge.training.gpt_step``: ``forward_step(state, data_iterator, model)``,
  its batch fetching (``get_batch``), context-parallel split and loss function;
* ``megatron.bridge.training.losses``: ``masked_next_token_loss``;
* ``megatron.bridge.training.utils.train_utils``: ``prepare_forward_step_func``
  (the state injection) and ``training_log`` (the console line and the loggers' values);
* ``megatron.bridge.training.train``: ``train_step``, which pools the loss reports;
* ``megatron.bridge.training.eval``: ``evaluate`` and ``evaluate_and_print_results``;
* ``megatron.bridge.training.state``: ``GlobalState`` with its loggers (TensorBoard's
  ``SummaryWriter``, W&B, MLflow, Comet, made on the last rank from the configuration);
* ``megatron.bridge.training.callbacks``: ``CallbackManager`` and ``normalize_callbacks``;
* ``megatron.bridge.training.utils.mlflow_utils``: the MLflow key sanitiser.

Bridge needs megatron-core ≥ 0.18 (``make test-bridge`` puts 0.19.2 first on the
path). What is stubbed is what these modules import and the tests never compute:

* the packages ``megatron.bridge`` and ``megatron.bridge.data`` are entered without
  running their ``__init__`` (it registers every Hugging Face model bridge and dataset
  builder: transformers, datasets...);
* ``megatron.bridge.training.config``: ``kit.bridge_config.ConfigContainer`` (Bridge's
  own imports every model provider; the stand-in holds Megatron's own logger, training
  and validation dataclasses with Bridge's added fields, and the fields read elsewhere);
* placeholders (:class:`_Placeholder`: any attribute is a class that refuses to be
  built) for heavy optional dependencies and for what only checkpoints or
  initialises: NVIDIA ModelOpt (distillation), Megatron-LM's ``megatron.training``
  (shipped in megatron-core's wheel, needs Python 3.12 and Megatron-LM's global
  arguments), ``tqdm``, Bridge's PEFT adapters (flop counting's ``isinstance``), its
  checkpoint utilities (they import transformers), checkpointing and initialisation.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import types
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

BRIDGE_VERSION = "0.6.2"
CACHE = Path(__file__).resolve().parents[2] / ".cache" / "megatron-bridge" / BRIDGE_VERSION

# Imported without their __init__ (see the module docstring).
SHELL_PACKAGES = ("megatron.bridge", "megatron.bridge.data")
# Placeholders: heavy optional dependencies, and what only logs, checkpoints or initialises.
PLACEHOLDERS = ("modelopt", "megatron.training", "tqdm", "megatron.bridge.peft",
                "megatron.bridge.training.utils.checkpoint_utils", "megatron.bridge.training.checkpointing",
                "megatron.bridge.training.initialize")


class BridgeUnavailable(RuntimeError):
    """The wheel could not be downloaded (the package index is unreachable), or a package its state needs is
    missing."""


def bridge_path() -> Path:
    """The unpacked wheel (downloaded on first use)."""
    unpacked = CACHE / "site"
    if (unpacked / "megatron" / "bridge" / "training" / "train.py").exists():
        return unpacked
    CACHE.mkdir(parents=True, exist_ok=True)
    wheels = sorted(CACHE.glob(f"megatron_bridge-{BRIDGE_VERSION}-*.whl"))
    if not wheels:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--ignore-requires-python", "-q",
                   "-d", str(CACHE), f"megatron-bridge=={BRIDGE_VERSION}"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        wheels = sorted(CACHE.glob(f"megatron_bridge-{BRIDGE_VERSION}-*.whl"))
        if done.returncode or not wheels:
            raise BridgeUnavailable(f"pip download megatron-bridge=={BRIDGE_VERSION} failed (package index "
                                    f"unreachable?): {(done.stderr or done.stdout).strip()[-500:]}")
    with zipfile.ZipFile(wheels[0]) as wheel:
        wheel.extractall(unpacked)
    return unpacked


# ------------------------------------------------------------------ the stubs


class _Placeholder(types.ModuleType):
    """A module whose every attribute is one class that refuses to be built (isinstance checks still work)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)

        def refuse(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError(f"{self.__name__}.{name} is stubbed in the tests (kit/megatron_bridge.py)")

        value = type(name, (), {"__init__": refuse, "__module__": self.__name__})
        setattr(self, name, value)
        return value


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves the placeholders and the shell packages; everything else imports as usual."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Optional[importlib.machinery.ModuleSpec]:
        if any(name == stub or name.startswith(stub + ".") for stub in PLACEHOLDERS):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        if name in SHELL_PACKAGES:
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is not None:
                spec.loader = self
            return spec
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        if spec.name in SHELL_PACKAGES:
            module = types.ModuleType(spec.name)
            module.__path__ = list(spec.submodule_search_locations)
        else:
            module = _Placeholder(spec.name)
            module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def _config_module() -> None:
    """Bridge's ``training.config``: the stand-in of ``kit.bridge_config`` (see its docstring); any other name it
    is asked for (``NVRxStragglerDetectionConfig``...) is a placeholder class."""
    from kit.bridge_config import ConfigContainer  # megatron-core >= 0.18 only: imported once Bridge is loaded

    module = _Placeholder("megatron.bridge.training.config")
    module.ConfigContainer = ConfigContainer
    sys.modules[module.__name__] = module


@dataclass(frozen=True)
class Bridge:
    """Megatron-Bridge's modules the tests call."""

    gpt_step: types.ModuleType
    losses: types.ModuleType
    train_utils: types.ModuleType
    train: types.ModuleType
    eval: types.ModuleType
    state: types.ModuleType
    callbacks: types.ModuleType


def load_bridge() -> Bridge:
    """Download (once), stub and import Megatron-Bridge (``BridgeUnavailable`` when the index is unreachable)."""
    path = bridge_path()
    if str(path) not in sys.path:
        sys.path.append(str(path))
    if not any(isinstance(finder, _StubFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _StubFinder())
        _config_module()
    if importlib.util.find_spec("tensorboard") is None:  # Bridge's state.py imports torch's SummaryWriter
        raise BridgeUnavailable("Megatron-Bridge's GlobalState imports TensorBoard, which is not installed "
                                "(make test-bridge installs it with the other logging packages)")
    load = importlib.import_module
    training = "megatron.bridge.training"
    return Bridge(*(load(f"{training}.{name}") for name in ("gpt_step", "losses", "utils.train_utils", "train",
                                                            "eval", "state", "callbacks")))


def global_state(bridge: Bridge, cfg: Any) -> Any:
    """Bridge's own ``GlobalState`` holding ``cfg`` (a ``kit.bridge_config.ConfigContainer``): its loggers
    (``tensorboard_logger``, ``wandb_logger``, ``mlflow_logger``, ``comet_logger``) are made on the last rank
    from ``cfg.logger``, as in a Bridge run."""
    state = bridge.state.GlobalState()
    state.cfg = cfg
    return state


# ------------------------------------------------------------------ for the test modules

TEST_ENABLED = os.environ.get("TWINKLE_BRIDGE_TEST") == "1"
SKIP_REASON = "Megatron-Bridge's own code (needs megatron-core >= 0.18): run by `make test-bridge`"


def bridge_for_tests() -> Optional[Bridge]:
    """What a test module of tests/bridge calls at import: None unless ``make test-bridge`` runs it
    (``TWINKLE_BRIDGE_TEST=1``; the module is then skipped by ``pytest.mark.skipif(not TEST_ENABLED, ...)``);
    ``RuntimeError`` on a megatron-core older than Bridge needs; the module skipped when the wheel cannot be
    downloaded; else Bridge, loaded in the parent so that the forked ranks inherit the imports."""
    if not TEST_ENABLED:
        return None
    import megatron.core
    import pytest
    from packaging.version import Version

    if Version(megatron.core.__version__) < Version("0.18"):
        raise RuntimeError(f"Megatron-Bridge 0.6.2 needs megatron-core >= 0.18, got {megatron.core.__version__}: "
                           "run `make test-bridge`")
    try:
        return load_bridge()
    except BridgeUnavailable as error:
        pytest.skip(str(error), allow_module_level=True)
