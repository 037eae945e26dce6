"""Incidents: when a log step is flagged, which samples and which layers.

A log step is *flagged* when its record (the same on every rank: it comes from
the one sync) has ``train/loss_spike`` = 1, a non-finite loss or gradient norm
in the interval (``train/nonfinite_loss_steps``, ``train/nonfinite_grad_norm_steps``)
or a non-finite per-layer norm. Every rank therefore knows of the flag without
any communication; a flagged step then costs ONE all-gather (the top-k samples
of :class:`~twinkle_megatron.metric.SampleLosses`) and a normal step nothing.

The incident, one JSON object per line of ``incidents.jsonl`` in the log
directory (the writer rank writes it, and one line on stdout)::

    {"step": 40, "reasons": ["loss_spike"], "loss": 1.31, "loss_ema": 0.52,
     "samples": [{"sample_index": 1234, "dataset_id": 1, "dataset": "hard", "loss": 11.2,
                  "tokens": 15, "step": 40, "complete": true}, ...],
     "dataset_losses": {"easy": 0.41, "hard": 2.7},
     "layers": [{"part": "layer_03", "grad_norm": 12.5}, ...]}

``samples``: the interval's highest-loss samples, highest first (see
``SampleLosses``); ``dataset_losses``: the interval's ``loss/<name>`` values;
``layers``: the parts with the largest gradient norms (with
``record_grad_norms``). :func:`read_skip_list` turns the file into the sample
indices to skip.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Iterable, Mapping, Optional

import torch.distributed as dist

from .. import keys
from ..metric.sample_losses import SampleLosses

INCIDENTS_FILE = "incidents.jsonl"
_LAYERS_REPORTED = 5


def flag_reasons(record: Mapping[str, Any]) -> list[str]:
    """Why a log record is flagged (empty: it is not): ``loss_spike``, ``nonfinite_loss``,
    ``nonfinite_grad_norm``."""
    reasons = []
    if record.get(keys.LOSS_SPIKE):
        reasons.append("loss_spike")
    if record.get(keys.NONFINITE_LOSS_STEPS):
        reasons.append("nonfinite_loss")
    layer_norms = [layer["grad_norm"] for layer in largest_layers(record, count=None)]
    if record.get(keys.NONFINITE_GRAD_NORM_STEPS) or any(not math.isfinite(v) for v in layer_norms):
        reasons.append("nonfinite_grad_norm")
    return reasons


class IncidentReporter:
    """Writes an incident for every flagged log record (see the module docstring).

    Args:
        samples: the :class:`SampleLosses` metric that keeps each interval's top
            samples (None: incidents without samples).
        log_dir: where ``incidents.jsonl`` goes (None: no file).
        writer_rank: the global rank that writes and prints.
    """

    def __init__(self, samples: Optional[SampleLosses], log_dir: Optional[str], writer_rank: int = 0) -> None:
        self.samples = samples
        self.path = os.path.join(log_dir, INCIDENTS_FILE) if log_dir else None
        self.writer_rank = writer_rank

    def report(self, record: Mapping[str, Any], step: int) -> Optional[dict[str, Any]]:
        """The incident of a flagged record (collective then: every rank calls it with the same record), else None."""
        reasons = flag_reasons(record)
        if not reasons:
            return None
        incident: dict[str, Any] = {"step": step, "reasons": reasons}
        for key, name in ((keys.LOSS, "loss"), (keys.LOSS_EMA, "loss_ema"), (keys.GRAD_NORM, "grad_norm")):
            if key in record:
                incident[name] = record[key]
        incident["samples"] = self.samples.gather_top() if self.samples is not None else []
        incident["dataset_losses"] = {key[len(keys.LOSS) + 1:]: value for key, value in record.items()
                                      if key.startswith(keys.LOSS + "/")}
        incident["layers"] = largest_layers(record)
        if not dist.is_initialized() or dist.get_rank() == self.writer_rank:
            self._write(incident)
        return incident

    def _write(self, incident: dict[str, Any]) -> None:
        print(format_incident(incident), flush=True)
        if self.path is None:
            return
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with open(self.path, "a") as file:
            file.write(json.dumps(incident, allow_nan=True) + "\n")


def largest_layers(record: Mapping[str, Any], count: Optional[int] = _LAYERS_REPORTED) -> list[dict[str, Any]]:
    """The parts with the largest gradient norms in ``record`` (non-finite ones first; ``count=None``: all)."""
    parts = [(key[len(keys.GRAD_NORM_PREFIX):], value) for key, value in record.items()
             if key.startswith(keys.GRAD_NORM_PREFIX) and key not in _COMPACT_KEYS]
    parts.sort(key=lambda item: -(item[1] if math.isfinite(item[1]) else math.inf))
    return [{"part": part, "grad_norm": value} for part, value in parts[:count]]


_COMPACT_KEYS = (keys.GRAD_NORM_TOTAL, keys.GRAD_NORM_LAYER_MAX, keys.GRAD_NORM_LAYER_MAX_INDEX,
                 keys.GRAD_NORM_LAYER_MAX_OVER_MEDIAN)


def format_incident(incident: Mapping[str, Any]) -> str:
    """One line: the step, why, the top sample (index, dataset, loss) and the largest layer."""
    text = f"[incident] step {incident['step']}: {', '.join(incident['reasons'])}"
    if "loss" in incident:
        text += f" (loss {incident['loss']:.4g}"
        text += f", EMA {incident['loss_ema']:.4g})" if "loss_ema" in incident else ")"
    samples = incident.get("samples") or []
    if samples:
        top = samples[0]
        dataset = top.get("dataset", top.get("dataset_id"))
        text += f"; top sample {top.get('sample_index')} (dataset {dataset}, loss {top['loss']:.4g}, " \
                f"step {top['step']})"
    layers = incident.get("layers") or []
    if layers:
        text += f"; largest grad norm {layers[0]['part']} = {layers[0]['grad_norm']:.4g}"
    return text


def describe_incident(incident: Mapping[str, Any]) -> str:
    """Several lines: :func:`format_incident`, then every sample, the per-dataset losses and the layers."""
    lines = [format_incident(incident)]
    for sample in incident.get("samples") or []:
        dataset = sample.get("dataset", sample.get("dataset_id"))
        partial = "" if sample.get("complete", True) else "  (partial: some CP ranks' parts only)"
        lines.append(f"  sample {sample.get('sample_index')}  dataset {dataset}  loss {sample['loss']:.4g}  "
                     f"tokens {sample.get('tokens')}  step {sample['step']}{partial}")
    losses = incident.get("dataset_losses") or {}
    if losses:
        lines.append("  dataset losses: " + ", ".join(f"{name} {value:.4g}" for name, value in losses.items()))
    layers = incident.get("layers") or []
    if layers:
        lines.append("  largest grad norms: " + ", ".join(f"{part['part']} {part['grad_norm']:.4g}" for part in layers))
    return "\n".join(lines)


def load_incidents(path: str) -> list[dict[str, Any]]:
    """The incidents of a run: ``path`` is ``incidents.jsonl``, a run directory, or its ``metrics.jsonl``.

    A step written twice (a restarted run) keeps its last incident; in step order.
    """
    if os.path.isdir(path):
        path = os.path.join(path, INCIDENTS_FILE)
    elif os.path.basename(path) != INCIDENTS_FILE:
        path = os.path.join(os.path.dirname(path), INCIDENTS_FILE)
    if not os.path.exists(path):
        return []
    by_step: dict[int, dict[str, Any]] = {}
    with open(path) as file:
        for line in file:
            if line.strip():
                incident = json.loads(line)
                by_step[int(incident["step"])] = incident
    return [by_step[step] for step in sorted(by_step)]


def read_skip_list(path: str, per_incident: int = 1) -> set[int]:
    """Sample indices to skip: the ``per_incident`` highest-loss samples of each incident in ``path``.

    ``path`` is an ``incidents.jsonl`` (or a run directory), or a text file with one
    sample index per line (``#`` starts a comment). Samples without an index are left out.
    """
    if os.path.isdir(path) or path.endswith(".jsonl"):
        return set(_skipped(load_incidents(path), per_incident))
    skipped = set()
    with open(path) as file:
        for line in file:
            line = line.split("#", 1)[0].strip()
            if line:
                skipped.add(int(line))
    return skipped


def _skipped(incidents: Iterable[Mapping[str, Any]], per_incident: int) -> Iterable[int]:
    for incident in incidents:
        indexed = [s for s in incident.get("samples", []) if s.get("sample_index") is not None]
        for sample in indexed[:per_incident]:
            yield int(sample["sample_index"])
