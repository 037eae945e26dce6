"""Incidents on the charts: a dashed line at each incident's step, labelled with its top sample.

Read from the run's ``incidents.jsonl`` (beside the log, see
:mod:`twinkle_megatron.tracker.incidents`); a run without one draws nothing.
"""

from __future__ import annotations

from typing import Any, Optional

from ..tracker.incidents import load_incidents


def mark_incidents(axes: Any, log_path: str) -> Optional[Any]:
    """Draw the incidents of the run whose log is ``log_path`` on ``axes``; the legend handle, or None."""
    handle = None
    for incident in load_incidents(log_path):
        handle = axes.axvline(incident["step"], color="C3", linestyle="--", linewidth=1, alpha=0.7,
                              label="incident")
        samples = incident.get("samples") or []
        if samples and samples[0].get("sample_index") is not None:
            top = samples[0]
            dataset = top.get("dataset", top.get("dataset_id"))
            axes.annotate(f"#{top['sample_index']} ({dataset})", xy=(incident["step"], 1.0),
                          xycoords=("data", "axes fraction"), xytext=(2, -10), textcoords="offset points",
                          fontsize=7, color="C3", rotation=90, va="top")
    return handle
