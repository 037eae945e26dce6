"""Where tracker records go: stdout, JSONL, TensorBoard, W&B, SwanLab, MLflow.

Each backend imports its library lazily (when first written to), only one
rank writes, and a backend that fails warns once and is disabled;
:func:`check_backends` (``TrackerConfig(strict_backends=True)``) raises before
training instead when a backend's library is not installed. A run that
starts at step *s* makes every backend drop or supersede the points it holds
at steps ≥ *s* (see :class:`RunStart`), so a restarted job never shows a step
twice; each backend's module says how.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Any, Iterable, Optional, Union

from .base import Backend, RunStart, numeric_record
from .jsonl import JsonlBackend, read_jsonl
from .manager import MetricsLogger
from .mlflow import MlflowBackend
from .rank_hosts import read_rank_hosts, record_rank_hosts
from .stdout import StdoutBackend
from .swanlab import SwanLabBackend
from .tensorboard import TensorBoardBackend
from .wandb import WandbBackend

BACKEND_CLASSES: dict[str, type[Backend]] = {
    "stdout": StdoutBackend, "jsonl": JsonlBackend, "tensorboard": TensorBoardBackend, "wandb": WandbBackend,
    "swanlab": SwanLabBackend, "mlflow": MlflowBackend,
}
BACKENDS = tuple(BACKEND_CLASSES)


def build_backend(spec: Union[str, Backend], log_dir: str = "logs", **options: Any) -> Backend:
    """A backend from its name (files go under ``log_dir``), or ``spec`` itself if it is one.

    ``jsonl`` writes ``log_dir/metrics.jsonl``, ``tensorboard`` writes under
    ``log_dir/tensorboard``, ``wandb`` under ``log_dir/wandb``, ``swanlab``'s
    local store under ``log_dir/swanlog``; ``options`` go to the backend's constructor.
    """
    if isinstance(spec, Backend):
        return spec
    if spec == "stdout":
        return StdoutBackend(**options)
    if spec == "jsonl":
        return JsonlBackend(options.pop("path", os.path.join(log_dir, "metrics.jsonl")), **options)
    if spec == "tensorboard":
        return TensorBoardBackend(options.pop("log_dir", os.path.join(log_dir, "tensorboard")), **options)
    if spec == "wandb":
        return WandbBackend(**{"directory": log_dir, **options})
    if spec == "swanlab":
        return SwanLabBackend(**{"log_dir": os.path.join(log_dir, "swanlog"), **options})
    if spec == "mlflow":
        return MlflowBackend(**options)
    raise ValueError(f"unknown logging backend {spec!r}; expected one of {BACKENDS} or a Backend")


class BackendUnavailableError(ImportError):
    """A logging backend was asked for whose package is not installed, or fails to import."""


def check_backends(backends: Iterable[Union[str, Backend]], import_packages: bool = False) -> None:
    """Raise now, before training starts, when a backend of ``backends`` could not open for want of its package.

    Every name must be one of :data:`BACKENDS` (``ValueError`` otherwise, naming each unknown one), and
    every backend's packages (:attr:`Backend.requires <twinkle_megatron.logging.Backend.requires>`, for
    names and ``Backend`` objects alike; ``stdout`` and ``jsonl`` need none) must be installed. A package is
    looked up with ``importlib.util.find_spec``, which imports nothing: no run is started, nothing reaches
    the network, so the check is cheap (0.5 ms for all six here) and can run on every rank. ``import_packages=True``
    imports each package as well, which also finds one that is installed but fails on import (a broken
    dependency); that is what ``examples/train_gpt.py --check-flags`` does.

    Raises:
        ValueError: a name that is no backend.
        BackendUnavailableError: (an ``ImportError``) one sentence per missing package, naming the
            backend, the package and the pip extra that installs it.
    """
    backends = list(backends)
    unknown = [spec for spec in backends if not isinstance(spec, Backend) and spec not in BACKEND_CLASSES]
    if unknown:
        raise ValueError("; ".join(f"unknown logging backend {spec!r}" for spec in unknown)
                         + f"; expected one of {BACKENDS} or a Backend")
    problems: dict[tuple[str, str], str] = {}  # (backend, package) -> the sentence, each once
    for spec in backends:
        backend = spec if isinstance(spec, Backend) else BACKEND_CLASSES[spec]
        for package in backend.requires:
            if (backend.name, package) in problems:
                continue
            trouble = _package_trouble(package, import_packages)
            if trouble is not None:
                install = f"pip install 'twinkle-megatron[{backend.pip_extra}]'" if backend.pip_extra \
                    else f"install {package!r}"
                problems[backend.name, package] = (f"logging backend {backend.name!r} needs the package {package!r}, "
                                                   f"which {trouble}: {install}, or leave {backend.name!r} out "
                                                   "of the backends")
    if problems:
        raise BackendUnavailableError("; ".join(problems.values()))


def _package_trouble(package: str, import_package: bool) -> Optional[str]:
    """Why ``package`` cannot be imported (``"is not installed"``...), or None when it can."""
    try:
        found = importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a dotted name whose parent is missing; a module without a spec
        found = False
    if not found:
        return "is not installed"
    if import_package:
        try:
            importlib.import_module(package)
        except Exception as error:  # noqa: BLE001 - whatever stops the import is the answer asked for
            return f"is installed but fails to import ({type(error).__name__}: {error})"
    return None


__all__ = ["Backend", "RunStart", "MetricsLogger", "StdoutBackend", "JsonlBackend", "TensorBoardBackend",
           "WandbBackend", "SwanLabBackend", "MlflowBackend", "build_backend", "numeric_record", "read_jsonl",
           "record_rank_hosts", "read_rank_hosts", "BACKENDS", "BACKEND_CLASSES", "check_backends",
           "BackendUnavailableError"]
