"""MLflow: metrics of one run, reopened by id on resume."""

from __future__ import annotations

from typing import Any, Mapping, Optional

from .base import Backend


class MlflowBackend(Backend):
    """Logs to an MLflow run; ``run_id`` reopens an existing run (a resume)."""

    name = "mlflow"

    def __init__(self, experiment: Optional[str] = None, run_name: Optional[str] = None,
                 run_id: Optional[str] = None, tracking_uri: Optional[str] = None) -> None:
        self.experiment = experiment
        self.run_name = run_name
        self.run_id = run_id
        self.tracking_uri = tracking_uri
        self._mlflow: Any = None

    def open(self, resume_step: Optional[int]) -> None:
        import mlflow

        if self.tracking_uri is not None:
            mlflow.set_tracking_uri(self.tracking_uri)
        if self.experiment is not None and self.run_id is None:
            mlflow.set_experiment(self.experiment)
        mlflow.start_run(run_id=self.run_id, run_name=None if self.run_id else self.run_name)
        self._mlflow = mlflow

    def write(self, record: Mapping[str, float], step: int) -> None:
        self._mlflow.log_metrics(dict(record), step=step)

    def close(self) -> None:
        if self._mlflow is not None:
            self._mlflow.end_run()
            self._mlflow = None
