"""What every logging backend is: open once for a run, write records, close."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from numbers import Real
from typing import Any, Mapping, Optional


@dataclass(frozen=True)
class RunStart:
    """What a backend needs to know when it opens.

    Attributes:
        first_step: the first step this run logs. Points a backend already holds
            at this step or later belong to a timeline that did not continue (the
            job was restarted at ``first_step``, from a checkpoint or from
            scratch): each backend drops or supersedes them, so every step is
            shown once, with the values of the run that continued.
        config: the run's configuration (nested mapping of plain values), logged once.
        log_dir: the run's directory (where backends that have run ids remember them).
        restart: the backend is opened again in the same process, at ``first_step``
            (the tracker loaded a checkpoint after it had logged): a backend with
            run ids continues the run it had open.
    """

    first_step: int = 1
    config: Mapping[str, Any] = field(default_factory=dict)
    log_dir: Optional[str] = None
    restart: bool = False

    @property
    def requeued(self) -> bool:
        """A Slurm job started again after a preemption or failure (``SLURM_RESTART_COUNT`` > 0)."""
        try:
            return int(os.environ.get("SLURM_RESTART_COUNT", "0")) > 0
        except ValueError:
            return False

    @property
    def continues(self) -> bool:
        """This run continues an earlier one: it starts after step 1 (a resume), is a requeued job, or a restart.

        Backends with run ids reopen the earlier run then; otherwise they start a new run.
        """
        return self.first_step > 1 or self.requeued or self.restart


class Backend:
    """One destination for metric records.

    The manager (:class:`~twinkle_megatron.logging.MetricsLogger`) calls
    :meth:`open` once, on the writing rank only, right before the first
    :meth:`write`; a backend's library is imported there, never at module import,
    so an uninstalled library costs nothing until it is asked for.
    :func:`~twinkle_megatron.logging.check_backends` (``TrackerConfig(strict_backends=True)``)
    finds that library before training instead, from :attr:`requires` and :attr:`pip_extra`.

    ``write`` gets numbers only (see :func:`numeric_record`). Any exception
    raised by ``open``, ``write`` or ``close`` disables the backend with one
    warning (after :meth:`abort`, which releases what ``open`` acquired);
    training goes on.
    """

    name = "backend"
    requires: tuple[str, ...] = ()
    """The Python packages (top-level import names) that ``open`` imports; empty: none beyond torch."""
    pip_extra: Optional[str] = None
    """The twinkle-megatron extra that installs them (``pip install 'twinkle-megatron[<extra>]'``), if any."""

    def open(self, run: RunStart) -> None:
        """Prepare to write (import the library, open files or runs); drop points at ``run.first_step`` or later."""

    def write(self, record: Mapping[str, float], step: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Flush and release what ``open`` acquired."""

    def abort(self) -> None:
        """Release what ``open`` acquired after a failure (default: :meth:`close`); must not raise."""
        try:
            self.close()
        except Exception:  # noqa: BLE001 - already failing; the first error is the one reported
            pass


class ExperimentBackend(Backend):
    """A backend that logs into one run object of a tracking service (W&B, SwanLab).

    ``open`` either :meth:`adopts <adopt>` a run the user already started
    (logged into, its config updated, never finished by the tracker) or
    :meth:`starts <start>` one of its own, which :meth:`close` finishes and
    :meth:`abort` finishes as failed (:meth:`finish_failed`).
    """

    def __init__(self, config: Optional[Mapping[str, Any]] = None) -> None:
        self.config = dict(config) if config is not None else {}
        self.run: Any = None
        self.owned = False  # whether the tracker started the run (and so finishes it)

    def adopt(self, run: Any) -> None:
        self.run, self.owned = run, False

    def start(self, run: Any) -> None:
        self.run, self.owned = run, True

    def write(self, record: Mapping[str, float], step: int) -> None:
        self.run.log(dict(record), step=step)

    def finish_failed(self) -> None:
        """Finish the backend's own run as failed (default: a plain finish)."""
        self.run.finish()

    def close(self) -> None:
        if self.run is not None and self.owned:
            self.run.finish()
        self.run = None

    def abort(self) -> None:
        if self.run is not None and self.owned:
            try:
                self.finish_failed()
            except Exception:  # noqa: BLE001 - already failing
                pass
        self.run = None


def numeric_record(record: Mapping[str, Any]) -> dict[str, float]:
    """The entries of ``record`` that are real numbers (bools as 0/1); lists, strings and None are left out."""
    numbers: dict[str, float] = {}
    for key, value in record.items():
        if isinstance(value, bool):
            numbers[key] = int(value)
        elif isinstance(value, Real):
            numbers[key] = value
    return numbers


def flatten_config(config: Mapping[str, Any], separator: str = ".") -> dict[str, Any]:
    """``{"parallel": {"tp": 2}}`` → ``{"parallel.tp": 2}``: for stores with flat keys (MLflow, TensorBoard)."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            for inner, item in flatten_config(value, separator).items():
                flat[f"{key}{separator}{inner}"] = item
        else:
            flat[str(key)] = value
    return flat
