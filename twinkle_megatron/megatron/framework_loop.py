"""Megatron's own training loop as the plugin meets it: its iteration, its intervals, its run folder, its writers.

Inside Megatron-LM's and Megatron-Bridge's ``pretrain()`` the framework owns the loop, so what the plugin reports
goes where the framework writes, at the framework's iteration. Both loops were read at the releases this project
supports (Megatron-LM ``megatron/training/training.py`` and ``global_vars.py`` at ``core_v0.13.0``,
``core_v0.16.1``, ``core_v0.19.0``; Megatron-Bridge 0.6.2 ``training/train.py``, ``utils/train_utils.py``,
``state.py``):

* **The iteration.** During a training step Megatron-LM holds the iteration before the step in
  ``args.curr_iteration`` and logs the step at ``iteration + 1`` (``iteration += 1`` follows ``train_step``);
  Bridge holds it in ``state.train_state.step`` and increments it after ``train_step``. Either way the step is
  logged at *the iteration before it + 1*. Samples consumed before the step: ``args.consumed_train_samples`` /
  ``state.train_state.consumed_train_samples`` (both incremented after ``train_step``).
* **The intervals.** ``training_log`` writes TensorBoard and W&B when ``iteration % tensorboard_log_interval == 0``
  and prints its console line when ``iteration % log_interval == 0`` (``args.*`` / ``state.cfg.logger.*``).
* **The writers.** Megatron-LM: ``megatron.training.get_tensorboard_writer()`` (a ``SummaryWriter``) and
  ``get_wandb_writer()`` (the ``wandb`` module), set on the last rank only. Bridge: ``state.tensorboard_logger``,
  ``state.wandb_logger``, ``state.mlflow_logger``, ``state.comet_logger``, likewise on the last rank.
* **The run folder** (where ``incidents.jsonl`` goes): the TensorBoard directory (``args.tensorboard_dir`` /
  ``state.cfg.logger.tensorboard_dir``), else the checkpoint directory (``args.save`` /
  ``state.cfg.checkpoint.save``), else the working directory.

:func:`find_framework_loop` finds the loop of a wrapped ``forward_step`` call: Bridge's when the step received
Bridge's ``GlobalState`` (Bridge binds it as the step's first argument), else Megatron-LM's when its global
arguments are set, else none (a loop the user owns: the tracker is the way there).
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional

import torch.distributed as dist

from ..logging.mlflow_names import mlflow_key


class FrameworkLoop:
    """What the plugin reads of a framework's loop and how it writes there (see the module docstring)."""

    def iteration_before_step(self) -> int:
        raise NotImplementedError

    def consumed_samples(self) -> int:
        """Training samples consumed before the current step (Megatron's sampler position)."""
        raise NotImplementedError

    def intervals(self) -> tuple[int, int]:
        """``(log_interval, tensorboard_log_interval)``."""
        raise NotImplementedError

    def run_dir(self) -> str:
        raise NotImplementedError

    def write(self, values: Mapping[str, float], iteration: int) -> None:
        """``values`` to the framework's writers on this rank (none: nothing)."""
        raise NotImplementedError

    def step_iteration(self) -> int:
        """The iteration the current training step is logged at."""
        return self.iteration_before_step() + 1


class MegatronLMLoop(FrameworkLoop):
    """Megatron-LM's ``pretrain()``: its global arguments and writers (``megatron.training``)."""

    def __init__(self, training: Any) -> None:
        self.training = training  # the megatron.training package: get_args, get_tensorboard_writer, get_wandb_writer

    def _args(self) -> Any:
        return self.training.get_args()

    def iteration_before_step(self) -> int:
        args = self._args()
        current = getattr(args, "curr_iteration", None)  # set by train() before each train_step
        return int(current if current is not None else getattr(args, "iteration", 0) or 0)

    def consumed_samples(self) -> int:
        return int(getattr(self._args(), "consumed_train_samples", 0) or 0)

    def intervals(self) -> tuple[int, int]:
        args = self._args()
        return int(getattr(args, "log_interval", 1) or 1), int(getattr(args, "tensorboard_log_interval", 1) or 1)

    def run_dir(self) -> str:
        args = self._args()
        return getattr(args, "tensorboard_dir", None) or getattr(args, "save", None) or os.getcwd()

    def write(self, values: Mapping[str, float], iteration: int) -> None:
        writer = self.training.get_tensorboard_writer()
        if writer is not None:
            for key, value in values.items():
                writer.add_scalar(key, value, iteration)
        wandb_writer = self.training.get_wandb_writer()
        if wandb_writer is not None:
            wandb_writer.log(dict(values), iteration)


class BridgeLoop(FrameworkLoop):
    """Megatron-Bridge's ``pretrain()``: its ``GlobalState`` (the step's bound ``state``) and its loggers."""

    def __init__(self, state: Any) -> None:
        self.state = state

    def iteration_before_step(self) -> int:
        return int(self.state.train_state.step)

    def consumed_samples(self) -> int:
        return int(self.state.train_state.consumed_train_samples)

    def intervals(self) -> tuple[int, int]:
        logger = self.state.cfg.logger
        return int(logger.log_interval or 1), int(getattr(logger, "tensorboard_log_interval", 1) or 1)

    def run_dir(self) -> str:
        logger_dir = getattr(self.state.cfg.logger, "tensorboard_dir", None)
        checkpoint = getattr(self.state.cfg, "checkpoint", None)
        return logger_dir or getattr(checkpoint, "save", None) or os.getcwd()

    def write(self, values: Mapping[str, float], iteration: int) -> None:
        state = self.state
        if state.tensorboard_logger is not None:
            for key, value in values.items():
                state.tensorboard_logger.add_scalar(key, value, iteration)
        if state.wandb_logger is not None:
            state.wandb_logger.log(dict(values), iteration)
        if state.mlflow_logger is not None:  # its names: MLflow's own rule (logging/mlflow_names.py)
            state.mlflow_logger.log_metrics({mlflow_key(key): value for key, value in values.items()},
                                            step=iteration)
        comet = getattr(state, "comet_logger", None)
        if comet is not None:
            comet.log_metrics(dict(values), step=iteration)


def is_bridge_state(value: Any) -> bool:
    """Whether ``value`` is Megatron-Bridge's ``GlobalState`` (read by what ``training_log`` reads of it)."""
    return hasattr(value, "train_state") and hasattr(value, "cfg") and hasattr(value, "tensorboard_logger")


def find_framework_loop(arguments: Optional[Mapping[str, Any]]) -> Optional[FrameworkLoop]:
    """The loop a wrapped ``forward_step`` runs in: Bridge's (a ``GlobalState`` among the call's ``arguments``),
    else Megatron-LM's (``megatron.training.get_args()`` set), else None."""
    for value in (arguments or {}).values():
        if is_bridge_state(value):
            return BridgeLoop(value)
    try:
        import megatron.training as training
    except (ImportError, RuntimeError, OSError):
        return None
    try:
        args = training.get_args()
    except Exception:  # noqa: BLE001 - its global arguments are not set outside pretrain()
        return None
    return MegatronLMLoop(training) if args is not None else None


def last_rank() -> int:
    """The rank that holds the framework's writers and prints its console line (both frameworks: the last)."""
    return dist.get_world_size() - 1 if dist.is_available() and dist.is_initialized() else 0
