"""MLflow: metrics and params of one run, through ``MlflowClient`` (no process-global run of ours).

Keys: MLflow accepts only alphanumerics, ``_ - . /`` and spaces in a metric or
param name. Every other character becomes ``_``, one for one, so the mapping
is stable and documented: ``learning rate(param group 1)`` is logged as
``learning rate_param group 1_``, ``profiling/Time taken: generate`` as
``profiling/Time taken_ generate``. Two keys that would map to one name: the
second is left out with one warning. A bad key never disables the backend.

Which run:

* a run the user already started (``mlflow.active_run()``) is logged into; the
  tracker never ends it;
* ``run_id``, or (when the run continues: it starts after step 1, or
  ``SLURM_RESTART_COUNT`` > 0) the id recorded in ``LOG_DIR/run_ids.json``, is
  reopened;
* otherwise a new run in ``experiment`` (or ``$MLFLOW_EXPERIMENT_NAME``).

Resume: MLflow keeps every point it was given and has no way to delete some.
When the reopened run holds points at the restart step or later, it is
*superseded*: a new run in the same experiment with the same name, params and
tags receives the points before the restart step (copied with their
timestamps), the old run is tagged ``twinkle_megatron.superseded_by`` and
deleted (MLflow's soft delete: hidden from the UI and searches, restorable with
``mlflow runs restore``), and the new run id is recorded for the next restart
(an explicit ``run_id`` that was superseded is followed to its successor). A run
the user started cannot be superseded: its repeated steps are logged again
(one warning).

The run configuration is logged as params (flattened keys, ``parallel.tp``...);
params MLflow already holds with another value (a resume on another layout)
are kept and reported once, since MLflow params cannot change.
"""

from __future__ import annotations

import os
import re
import time
import warnings
from typing import Any, Mapping, Optional

from .base import Backend, RunStart, flatten_config
from .run_ids import recall_run_id, remember_run_id

_NOT_ALLOWED = re.compile(r"[^A-Za-z0-9_\-./ ]")
_METRICS_PER_BATCH, _PARAMS_PER_BATCH = 1000, 100  # MLflow's limits per log_batch call
_PARAM_VALUE_LIMIT = 6000
SUPERSEDED_BY_TAG = "twinkle_megatron.superseded_by"
CONTINUES_TAG = "twinkle_megatron.continues"


def mlflow_key(key: str) -> str:
    """The MLflow name of a metric or param key: characters MLflow refuses become ``_``."""
    return _NOT_ALLOWED.sub("_", key)


class MlflowBackend(Backend):
    """Logs to an MLflow run (see the module docstring for which one)."""

    name = "mlflow"

    def __init__(self, experiment: Optional[str] = None, run_name: Optional[str] = None,
                 run_id: Optional[str] = None, tracking_uri: Optional[str] = None,
                 tags: Optional[Mapping[str, str]] = None) -> None:
        self.experiment = experiment
        self.run_name = run_name
        self.run_id = run_id
        self.tracking_uri = tracking_uri
        self.tags = dict(tags or {})
        self._client: Any = None
        self._active_run_id: Optional[str] = None
        self._owned = False
        self._names: dict[str, str] = {}  # our key -> MLflow name
        self._taken: dict[str, str] = {}  # MLflow name -> our key

    def open(self, run: RunStart) -> None:
        import mlflow
        from mlflow import MlflowClient

        active = mlflow.active_run()
        if active is not None:  # the user's run, in the user's tracking store
            self._client = MlflowClient(tracking_uri=mlflow.get_tracking_uri())
            self._active_run_id, self._owned = active.info.run_id, False
            if self._has_points_from(self._client.get_run(self._active_run_id), run.first_step):
                warnings.warn(f"MLflow run {self._active_run_id} (started by you) already holds points at step "
                              f"{run.first_step} or later; MLflow cannot delete points of a run the tracker did not "
                              "open, so the repeated steps are logged again", RuntimeWarning, stacklevel=2)
        else:
            self._client = MlflowClient(tracking_uri=self.tracking_uri)
            run_id = self.run_id or (recall_run_id(run.log_dir, self.name) if run.continues else None)
            if run_id is not None and self.run_id is None and not self._exists(run_id):
                warnings.warn(f"MLflow run {run_id} recorded in {run.log_dir} is not in this tracking store; "
                              "starting a new run", RuntimeWarning, stacklevel=2)
                run_id = None
            if run_id is not None:
                run_id = self._reopen(self._follow(run_id), run.first_step)
            else:
                run_id = self._client.create_run(self._experiment_id(), run_name=self.run_name,
                                                 tags=self.tags).info.run_id
            self._active_run_id, self._owned = run_id, True
            remember_run_id(run.log_dir, self.name, run_id)
        self._log_params(flatten_config(run.config))

    def write(self, record: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        timestamp = int(time.time() * 1000)
        metrics = [Metric(name, float(value), timestamp, step)
                   for name, value in ((self._name(key), value) for key, value in record.items()) if name is not None]
        self._log_batches(self._active_run_id, metrics=metrics)

    def close(self) -> None:
        if self._active_run_id is not None and self._owned:
            self._client.set_terminated(self._active_run_id, status="FINISHED")
        self._active_run_id = None

    def abort(self) -> None:
        try:
            if self._active_run_id is not None and self._owned:
                self._client.set_terminated(self._active_run_id, status="FAILED")
        except Exception:  # noqa: BLE001 - already failing
            pass
        self._active_run_id = None

    # ------------------------------------------------------------ helpers

    def _log_batches(self, run_id: str, metrics: list = (), params: list = ()) -> None:
        """``log_batch`` within MLflow's limits (1000 metrics, 100 params per call)."""
        for start in range(0, len(metrics), _METRICS_PER_BATCH):
            self._client.log_batch(run_id, metrics=metrics[start:start + _METRICS_PER_BATCH])
        for start in range(0, len(params), _PARAMS_PER_BATCH):
            self._client.log_batch(run_id, params=params[start:start + _PARAMS_PER_BATCH])

    def _name(self, key: str) -> Optional[str]:
        """The MLflow name of ``key``; None (with one warning) when another key already maps to it."""
        name = self._names.get(key)
        if name is None:
            name = mlflow_key(key)
            if self._taken.get(name, key) != key:
                warnings.warn(f"MLflow: {key!r} and {self._taken[name]!r} both become {name!r}; {key!r} is not "
                              "logged to MLflow", RuntimeWarning, stacklevel=3)
                self._names[key] = ""
                return None
            self._names[key], self._taken[name] = name, key
        return name or None

    def _experiment_id(self) -> str:
        name = self.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME")
        if name is None:
            return os.environ.get("MLFLOW_EXPERIMENT_ID", "0")
        experiment = self._client.get_experiment_by_name(name)
        return experiment.experiment_id if experiment is not None else self._client.create_experiment(name)

    def _exists(self, run_id: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            self._client.get_run(run_id)
        except MlflowException:
            return False
        return True

    def _follow(self, run_id: str) -> str:
        """A run superseded by an earlier resume is followed to the run that replaced it."""
        for _ in range(1000):
            found = self._client.get_run(run_id)
            successor = found.data.tags.get(SUPERSEDED_BY_TAG)
            if found.info.lifecycle_stage != "deleted" or not successor:
                return run_id
            run_id = successor
        return run_id

    def _has_points_from(self, found: Any, first_step: int) -> bool:
        return any(metric.step >= first_step for key in found.data.metrics
                   for metric in self._client.get_metric_history(found.info.run_id, key))

    def _reopen(self, run_id: str, first_step: int) -> str:
        """``run_id`` running again, or its successor when it holds points at ``first_step`` or later."""
        from mlflow.entities import Metric, Param

        old = self._client.get_run(run_id)
        histories = {key: self._client.get_metric_history(run_id, key) for key in old.data.metrics}
        if not any(metric.step >= first_step for history in histories.values() for metric in history):
            self._client.update_run(run_id, status="RUNNING")
            return run_id
        tags = {key: value for key, value in old.data.tags.items() if not key.startswith("mlflow.")}
        tags[CONTINUES_TAG] = run_id
        new_id = self._client.create_run(old.info.experiment_id, run_name=old.info.run_name,
                                         tags=tags).info.run_id
        params = [Param(key, value) for key, value in old.data.params.items()]
        kept = [Metric(key, metric.value, metric.timestamp, metric.step)
                for key, history in histories.items() for metric in history if metric.step < first_step]
        self._log_batches(new_id, metrics=kept, params=params)
        self._client.set_tag(run_id, SUPERSEDED_BY_TAG, new_id)
        self._client.set_terminated(run_id, status="KILLED")
        self._client.delete_run(run_id)
        return new_id

    def _log_params(self, config: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        held = self._client.get_run(self._active_run_id).data.params
        params, changed = [], []
        for key, value in config.items():
            name, text = mlflow_key(key), str(value)[:_PARAM_VALUE_LIMIT]
            if name not in held:
                params.append(Param(name, text))
            elif held[name] != text:
                changed.append(f"{name}: {held[name]} -> {text}")
        self._log_batches(self._active_run_id, params=params)
        if changed:
            warnings.warn(f"MLflow params cannot change; run {self._active_run_id} keeps its earlier values of "
                          f"{'; '.join(changed)}", RuntimeWarning, stacklevel=3)
