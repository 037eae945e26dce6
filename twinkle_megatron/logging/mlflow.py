"""MLflow: metrics and params of one run, through ``MlflowClient`` (no process-global run of ours).

Keys (``mlflow_names.py``): every key MLflow accepts is logged unchanged
(``损失``, ``énergie``, ``profiling/Time taken: generate``); a key it refuses is
logged with the refused characters replaced by ``_`` (``learning rate(param
group 1)`` → ``learning rate_param group 1_``), and a deterministic suffix when
that name is another key's. No key is dropped and no two keys share a name.
The keys logged under another name are recorded in the run tag
``twinkle_megatron.key_names`` (JSON ``{"metrics": {name: key}, "params": {...}}``),
kept when the run is reopened or superseded.

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

import json
import os
import time
import warnings
from typing import Any, Mapping, Optional

from .base import Backend, RunStart, flatten_config
from .mlflow_names import MlflowNames
from .run_ids import recall_run_id, remember_run_id

_METRICS_PER_BATCH, _PARAMS_PER_BATCH = 1000, 100  # MLflow's limits per log_batch call
_PARAM_VALUE_LIMIT = 6000
SUPERSEDED_BY_TAG = "twinkle_megatron.superseded_by"
CONTINUES_TAG = "twinkle_megatron.continues"
KEY_NAMES_TAG = "twinkle_megatron.key_names"
_TAG_VALUE_LIMIT = 8000  # MLflow's MAX_TAG_VAL_LENGTH: longer values are cut


class MlflowBackend(Backend):
    """Logs to an MLflow run (see the module docstring for which one)."""

    name = "mlflow"
    requires = ("mlflow",)
    pip_extra = "mlflow"

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
        self.last_run_id: Optional[str] = None  # the run this backend opened last (a restart in-process continues it)
        self._owned = False
        self._metric_names = MlflowNames()
        self._param_names = MlflowNames()
        self._recorded: dict[str, dict[str, str]] = {}  # the key_names tag as last written

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
            run_id = (self.last_run_id if run.restart else None) or self.run_id or \
                (recall_run_id(run.log_dir, self.name) if run.continues else None)
            if run_id is not None and self.run_id is None and not self._exists(run_id):
                warnings.warn(f"MLflow run {run_id} recorded in {run.log_dir} is not in this tracking store; "
                              "starting a new run", RuntimeWarning, stacklevel=2)
                run_id = None
            if run_id is not None:
                run_id = self._reopen(self._follow(run_id), run.first_step)
            else:
                run_id = self._client.create_run(self._experiment_id(), run_name=self.run_name,
                                                 tags=self.tags).info.run_id
            self._active_run_id, self._owned, self.last_run_id = run_id, True, run_id
            remember_run_id(run.log_dir, self.name, run_id)
        self._load_names()
        self._log_params(flatten_config(run.config))
        self._record_names()

    def write(self, record: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        timestamp = int(time.time() * 1000)
        names = self._metric_names.names(record)
        metrics = [Metric(names[key], float(value), timestamp, step) for key, value in record.items()]
        self._record_names()  # before the points: a renamed key is findable as soon as it shows
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

    def _load_names(self) -> None:
        """The names the run holds (and the keys an earlier attempt renamed): a key keeps its name on resume."""
        data = self._client.get_run(self._active_run_id).data
        try:
            recorded = json.loads(data.tags.get(KEY_NAMES_TAG, "{}"))
        except ValueError:
            recorded = {}
        recorded = recorded if isinstance(recorded, dict) else {}
        self._recorded = {kind: dict(recorded.get(kind) or {}) for kind in ("metrics", "params")}
        self._metric_names = MlflowNames(data.metrics, self._recorded["metrics"])
        self._param_names = MlflowNames(data.params, self._recorded["params"])

    def _record_names(self) -> None:
        """Write the ``key_names`` tag when a key got a name of its own since it was last written."""
        renamed = {"metrics": self._metric_names.renamed, "params": self._param_names.renamed}
        if renamed == self._recorded:
            return
        text = json.dumps(renamed, ensure_ascii=False, sort_keys=True)
        if len(text) > _TAG_VALUE_LIMIT:
            warnings.warn(f"MLflow: the names of {sum(map(len, renamed.values()))} renamed keys exceed a tag's "
                          f"{_TAG_VALUE_LIMIT} characters; {KEY_NAMES_TAG} holds the first ones", RuntimeWarning,
                          stacklevel=3)
            text = json.dumps(_within(renamed, _TAG_VALUE_LIMIT), ensure_ascii=False, sort_keys=True)
        self._client.set_tag(self._active_run_id, KEY_NAMES_TAG, text)
        self._recorded = renamed

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
        names = self._param_names.names(config)
        for key, value in config.items():
            name, text = names[key], str(value)[:_PARAM_VALUE_LIMIT]
            if name not in held:
                params.append(Param(name, text))
            elif held[name] != text:
                changed.append(f"{name}: {held[name]} -> {text}")
        self._log_batches(self._active_run_id, params=params)
        if changed:
            warnings.warn(f"MLflow params cannot change; run {self._active_run_id} keeps its earlier values of "
                          f"{'; '.join(changed)}", RuntimeWarning, stacklevel=3)


def _within(renamed: dict[str, dict[str, str]], limit: int) -> dict[str, dict[str, str]]:
    """The first entries of ``renamed`` whose JSON fits in ``limit`` characters."""
    kept: dict[str, dict[str, str]] = {kind: {} for kind in renamed}
    size = len(json.dumps(kept))
    for kind, names in renamed.items():
        for name, key in sorted(names.items()):
            entry = len(json.dumps({name: key}, ensure_ascii=False))
            if size + entry > limit:
                return kept
            kept[kind][name], size = key, size + entry
    return kept
