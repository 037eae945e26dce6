"""Where tracker records go: stdout, JSONL, TensorBoard, W&B, SwanLab, MLflow.

Each backend imports its library lazily (when first written to), only one
rank writes, and a backend that fails warns once and is disabled. A run that
starts at step *s* makes every backend drop or supersede the points it holds
at steps ≥ *s* (see :class:`RunStart`), so a restarted job never shows a step
twice; each backend's module says how.
"""

from __future__ import annotations

import os
from typing import Any, Union

from .base import Backend, RunStart, numeric_record
from .jsonl import JsonlBackend, read_jsonl
from .manager import MetricsLogger
from .mlflow import MlflowBackend
from .rank_hosts import read_rank_hosts, record_rank_hosts
from .stdout import StdoutBackend
from .swanlab import SwanLabBackend
from .tensorboard import TensorBoardBackend
from .wandb import WandbBackend

BACKENDS = ("stdout", "jsonl", "tensorboard", "wandb", "swanlab", "mlflow")


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


__all__ = ["Backend", "RunStart", "MetricsLogger", "StdoutBackend", "JsonlBackend", "TensorBoardBackend",
           "WandbBackend", "SwanLabBackend", "MlflowBackend", "build_backend", "numeric_record", "read_jsonl",
           "record_rank_hosts", "read_rank_hosts", "BACKENDS"]
