"""Read back what a run wrote to TensorBoard, MLflow and W&B, each with the tool's own reader (test support).

Every reader returns a timeline ``{key: {step: value}}``:

* :func:`tensorboard_scalars`: TensorBoard's ``EventAccumulator`` over a log directory (every scalar tag);
* :func:`mlflow_metrics`: ``MlflowClient.get_metric_history`` of every metric of the runs of one experiment;
* :func:`wandb_history`: ``wandb leet inspect --json`` (W&B's reader of its offline transaction log) over the
  offline runs of a directory; W&B's own keys (``_step``, ``_runtime``...) left out.

A key written twice at one step is an error (``ValueError``): the tests check each value once.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

Timeline = dict  # {key: {step: value}}

__all__ = ["Timeline", "mlflow_metrics", "tensorboard_scalars", "wandb_history"]


def _put(timeline: Timeline, key: str, step: int, value: float) -> None:
    points = timeline.setdefault(key, {})
    if step in points:
        raise ValueError(f"{key!r} written twice at step {step}: {points[step]} and {value}")
    points[step] = value


def tensorboard_scalars(log_dir: str) -> Timeline:
    """Every scalar of the event files under ``log_dir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    events.Reload()
    timeline: Timeline = {}
    for tag in events.Tags()["scalars"]:
        for event in events.Scalars(tag):
            _put(timeline, tag, event.step, event.value)
    return timeline


def mlflow_metrics(tracking_uri: str, experiment: str) -> Timeline:
    """Every metric of every run of ``experiment`` at ``tracking_uri``."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return {}
    timeline: Timeline = {}
    for run in client.search_runs([found.experiment_id]):
        for key in run.data.metrics:
            for metric in client.get_metric_history(run.info.run_id, key):
                _put(timeline, key, metric.step, metric.value)
    return timeline


def wandb_history(directory: str) -> Timeline:
    """The logged history of every offline run under ``directory/wandb``."""
    wandb = os.path.join(os.path.dirname(sys.executable), "wandb")
    timeline: Timeline = {}
    for run_dir in sorted(glob.glob(os.path.join(directory, "wandb", "offline-run-*"))):
        done = subprocess.run([wandb, "leet", "inspect", "--json", run_dir], capture_output=True, text=True,
                              timeout=120, check=True)
        for line in done.stdout.splitlines():
            record = json.loads(line) if line.strip() else {}
            if record.get("type") != "history":
                continue
            step = int(record["history"]["step"]["num"])
            for key, value in record["history"]["item"].items():
                if not key.startswith("_"):
                    _put(timeline, key, step, float(value))
    return timeline
