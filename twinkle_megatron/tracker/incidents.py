"""Incidents: when a log step is flagged, which samples and which layers, and whether the data is to blame.

A log step is *flagged* when its record (the same on every rank: it comes from
the one sync) has ``train/loss_spike`` = 1, a non-finite loss or gradient norm
in the interval (``train/nonfinite_loss_steps``: a non-finite loss given to
``end_step`` or counted by a loss metric such as ``LossMetric``; ``train/nonfinite_grad_norm_steps``)
or a non-finite per-layer norm. Every rank therefore knows of the flag without
any communication; a flagged step then costs ONE all-gather (the top-k samples
of :class:`~twinkle_megatron.metric.SampleLosses`, when the tracker has one) and
a normal step nothing. Every flagged step prints its line, with or without
``SampleLosses`` and per-layer norms (then ``samples`` / ``layers`` are empty).

The incident, one JSON object per line of ``incidents.jsonl`` in the log
directory (the writer rank writes it, with the JSONL backend, and one line on
stdout), written by the JSONL log's rule (:func:`~twinkle_megatron.logging.jsonl.strict_json`:
a non-finite number is ``null``, named in ``"nonfinite"``)::

    {"step": 40, "reasons": ["loss_spike"], "loss": 1.31, "loss_ema": 0.52, "grad_norm": 3.2,
     "learning_rate": 0.003, "step_wide": false, "nonfinite_samples": 0,
     "samples": [{"sample_index": 1234, "dataset_id": 1, "dataset": "hard", "loss": 11.2,
                  "tokens": 15, "step": 40, "complete": true, "loss_over_step": 8.55}, ...],
     "dataset_losses": {"easy": 0.41, "hard": 2.7}, "position_losses": {"pos_0-7": 1.2},
     "layers": [{"part": "layer_03", "grad_norm": 12.5}, ...]}

``samples``: the interval's highest-loss samples, highest first (see
``SampleLosses``), each with ``loss_over_step`` = its loss / the typical loss of
its step (below); ``dataset_losses`` and ``position_losses``: the interval's
``loss/<name>`` values of the datasets and of the position buckets; ``layers``:
the parts with the largest gradient norms (with ``record_grad_norms``).

**Data or step.** A sample's reference is the median loss of the other listed
samples of its dataset when at least two are listed (a dataset whose samples
all run high, the harder corpus of a blend, is not blamed for being hard), else
the interval's loss over all samples (a dataset with one sample in the interval
is never its own reference). A sample is *typical of its step* when its loss is
below :data:`STEP_WIDE_RATIO` × its reference; a non-finite sample is typical
only when every listed sample is non-finite (at least two). ``step_wide`` is
true when every listed sample is typical: the whole step is high (the
optimizer, the learning rate), not a few samples. With ``log_interval`` > 1 the
references are the interval's (each sample names its step).
``nonfinite_samples`` counts the listed samples with a non-finite loss.
:func:`read_skip_list` turns the file into the sample indices to skip: never a
typical sample.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Iterable, Mapping, Optional

import torch.distributed as dist

from .. import keys
from ..logging.jsonl import restore_nonfinite, strict_json
from ..metric import SampleLosses

INCIDENTS_FILE = "incidents.jsonl"
STEP_WIDE_RATIO = 1.5  # a sample below this × its reference loss is typical of its step
_PEERS = 2  # listed samples of the same dataset needed to be a sample's reference
_LAYERS_REPORTED = 5


def flag_reasons(record: Mapping[str, Any], overflow_skips: bool = False) -> list[str]:
    """Why a log record is flagged (empty: it is not): ``loss_spike``, ``nonfinite_loss``,
    ``nonfinite_grad_norm``. ``overflow_skips``: the gradients are scaled by an fp16 loss scale and a non-finite
    one makes the optimizer skip the step (its grad scaler's overflow, routine while the scale settles): non-finite
    per-layer norms with a finite loss are then that skip, not an incident."""
    reasons = []
    if record.get(keys.LOSS_SPIKE):
        reasons.append("loss_spike")
    if record.get(keys.NONFINITE_LOSS_STEPS):
        reasons.append("nonfinite_loss")
    layer_norms = [layer["grad_norm"] for layer in largest_layers(record, count=None)]
    nonfinite_norms = any(not math.isfinite(v) for v in layer_norms) and not (overflow_skips and not reasons)
    if record.get(keys.NONFINITE_GRAD_NORM_STEPS) or nonfinite_norms:
        reasons.append("nonfinite_grad_norm")
    return reasons


# (record key, incident field): the step's numbers an incident repeats, when the record has them.
_FROM_RECORD = ((keys.LOSS, "loss"), (keys.LOSS_EMA, "loss_ema"), (keys.GRAD_NORM, "grad_norm"),
                (keys.LEARNING_RATE, "learning_rate"), (keys.SKIPPED_STEPS, "skipped_steps"),
                (keys.NONFINITE_LOSSES, "nonfinite_losses"), (keys.NONFINITE_TOKENS, "nonfinite_tokens"))


class IncidentReporter:
    """Writes an incident for every flagged log record (see the module docstring).

    Args:
        samples: the :class:`SampleLosses` metric that keeps each interval's top
            samples (None: incidents without samples).
        log_dir: where ``incidents.jsonl`` goes (None: no file, the line only).
        writer_rank: the global rank that writes and prints.
    """

    def __init__(self, samples: Optional[SampleLosses], log_dir: Optional[str], writer_rank: int = 0,
                 overflow_skips: bool = False) -> None:
        self.samples = samples
        self.overflow_skips = overflow_skips  # see flag_reasons
        self.path = os.path.join(log_dir, INCIDENTS_FILE) if log_dir else None
        self.writer_rank = writer_rank

    def report(self, record: Mapping[str, Any], step: int) -> Optional[dict[str, Any]]:
        """The incident of a flagged record (collective with ``SampleLosses``: every rank calls it with the same
        record), else None."""
        reasons = flag_reasons(record, self.overflow_skips)
        if not reasons:
            return None
        incident: dict[str, Any] = {"step": step, "reasons": reasons}
        for key, name in _FROM_RECORD:
            if key in record and (name not in ("skipped_steps", "nonfinite_losses", "nonfinite_tokens")
                                  or record[key]):
                incident[name] = record[key]
        incident["samples"] = self.samples.gather_top() if self.samples is not None else []
        slices = {key[len(keys.LOSS) + 1:]: value for key, value in record.items() if key.startswith(keys.LOSS + "/")}
        incident["dataset_losses"], incident["position_losses"] = split_slices(slices)
        incident["layers"] = largest_layers(record)
        assess(incident)
        if not dist.is_initialized() or dist.get_rank() == self.writer_rank:
            self._write(incident)
        return incident

    def _write(self, incident: dict[str, Any]) -> None:
        print(format_incident(incident), flush=True)
        if self.path is None:
            return
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with open(self.path, "a") as file:
            file.write(json.dumps(strict_json(incident), allow_nan=False) + "\n")


def assess(incident: dict[str, Any]) -> dict[str, Any]:
    """Add (in place) each sample's ``loss_over_step``, ``nonfinite_samples`` and ``step_wide`` (see the module
    docstring); ``step_wide`` is None when there is nothing to judge by (no samples, or no finite reference
    for finite samples). Returns ``incident``."""
    samples = incident.get("samples") or []
    step_loss = incident.get("loss")
    usable = _finite(step_loss) and step_loss > 0
    nonfinite = sum(1 for sample in samples if not _finite(sample.get("loss")))
    for position, sample in enumerate(samples):
        reference = _typical_loss(samples, position, step_loss if usable else None)
        sample["loss_over_step"] = sample["loss"] / reference if _finite(sample.get("loss")) and reference else None
    incident["nonfinite_samples"] = nonfinite
    if not samples:
        incident["step_wide"] = None
    elif nonfinite:
        incident["step_wide"] = nonfinite == len(samples) and nonfinite >= 2
    elif any(sample["loss_over_step"] is None for sample in samples):
        incident["step_wide"] = None
    else:
        incident["step_wide"] = all(sample["loss_over_step"] < STEP_WIDE_RATIO for sample in samples)
    return incident


def _typical_loss(samples: list[Mapping[str, Any]], position: int, step_loss: Optional[float]) -> Optional[float]:
    """What the sample at ``position`` is compared with: the median loss of the other listed samples of its
    dataset when there are at least :data:`_PEERS` of them (a dataset whose samples all run high, a harder
    corpus in a blend, is not blamed), else the interval's loss over all samples (a dataset with one sample in
    the interval is never its own reference)."""
    sample = samples[position]
    peers = sorted(other["loss"] for index, other in enumerate(samples)
                   if index != position and other.get("dataset_id") == sample.get("dataset_id")
                   and _finite(other.get("loss")))
    if len(peers) >= _PEERS:
        middle = len(peers) // 2
        median = peers[middle] if len(peers) % 2 else (peers[middle - 1] + peers[middle]) / 2
        return median if median > 0 else None
    return step_loss


def is_typical(sample: Mapping[str, Any], incident: Mapping[str, Any]) -> bool:
    """Whether ``sample`` (of an :func:`assess`-ed incident) is typical of its step: never put on a skip list."""
    if incident.get("step_wide"):
        return True
    ratio = sample.get("loss_over_step")
    return ratio is not None and ratio < STEP_WIDE_RATIO


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def largest_layers(record: Mapping[str, Any], count: Optional[int] = _LAYERS_REPORTED) -> list[dict[str, Any]]:
    """The parts with the largest gradient norms in ``record`` (non-finite ones first; ``count=None``: all)."""
    parts = [(key[len(keys.GRAD_NORM_PREFIX):], value) for key, value in record.items()
             if key.startswith(keys.GRAD_NORM_PREFIX) and key not in _COMPACT_KEYS]
    parts.sort(key=lambda item: -(item[1] if math.isfinite(item[1]) else math.inf))
    return [{"part": part, "grad_norm": value} for part, value in parts[:count]]


_COMPACT_KEYS = (keys.GRAD_NORM_TOTAL, keys.GRAD_NORM_LAYER_MAX, keys.GRAD_NORM_LAYER_MAX_INDEX,
                 keys.GRAD_NORM_LAYER_MAX_OVER_MEDIAN)


def format_incident(incident: Mapping[str, Any]) -> str:
    """One line: the step, why, its loss, learning rate and grad norm, then what is to blame: the top sample
    (index, dataset, loss, its ratio to its reference loss), the count of non-finite samples, or "step-wide";
    and the largest layer."""
    text = f"[incident] step {incident['step']}: {', '.join(incident['reasons'])}"
    numbers = [f"loss {_number(incident['loss'])}"] if "loss" in incident else []
    numbers += [f"EMA {_number(incident['loss_ema'])}"] if "loss_ema" in incident else []
    numbers += [f"lr {incident['learning_rate']:.2e}"] if _finite(incident.get("learning_rate")) else []
    numbers += [f"grad norm {_number(incident['grad_norm'])}"] if "grad_norm" in incident else []
    if incident.get("skipped_steps"):
        numbers.append(f"{incident['skipped_steps']} skipped step(s)")
    text += f" ({', '.join(numbers)})" if numbers else ""
    samples = incident.get("samples") or []
    nonfinite = incident.get("nonfinite_samples") or 0
    if incident.get("step_wide") and nonfinite:
        text += f"; {nonfinite} non-finite samples, every one listed: step-wide (the optimizer, not the data)"
    elif incident.get("step_wide"):
        text += f"; step-wide: every listed sample within {STEP_WIDE_RATIO}x its step's typical loss (the optimizer, " \
                "not the data)"
    elif samples:
        top = samples[0]
        dataset = top.get("dataset", top.get("dataset_id"))
        ratio = top.get("loss_over_step")
        named = f"dataset {dataset}, " if dataset is not None else ""  # no dataset ids: nothing to name
        text += f"; top sample {top.get('sample_index')} ({named}loss {_number(top['loss'])}, " \
                + (f"{ratio:.3g}x its step's typical loss, " if ratio is not None else "") + f"step {top['step']})"
        if nonfinite:
            text += f"; {nonfinite} non-finite sample{'s' if nonfinite > 1 else ''}"
    layers = incident.get("layers") or []
    if layers:
        text += f"; largest grad norm {layers[0]['part']} = {_number(layers[0]['grad_norm'])}"
    return text


def describe_incident(incident: Mapping[str, Any]) -> str:
    """Several lines: :func:`format_incident`, then every sample, the per-dataset and per-position losses and
    the layers."""
    lines = [format_incident(incident)]
    for sample in incident.get("samples") or []:
        dataset = sample.get("dataset", sample.get("dataset_id"))
        ratio = sample.get("loss_over_step")
        partial = "" if sample.get("complete", True) else "  (partial: some CP ranks' parts only)"
        typical = "  (typical of its step)" if is_typical(sample, incident) else ""
        lines.append(f"  sample {sample.get('sample_index')}  dataset {dataset}  loss {_number(sample['loss'])}"
                     + (f" ({ratio:.3g}x the step's)" if ratio is not None else "")
                     + f"  tokens {sample.get('tokens')}  step {sample['step']}{partial}{typical}")
    for field, label in (("dataset_losses", "dataset losses"), ("position_losses", "losses by position")):
        losses = incident.get(field) or {}
        if losses:
            lines.append(f"  {label}: " + ", ".join(f"{name} {_number(value)}" for name, value in losses.items()))
    layers = incident.get("layers") or []
    if layers:
        lines.append("  largest grad norms: " + ", ".join(f"{part['part']} {_number(part['grad_norm'])}"
                                                          for part in layers))
    return "\n".join(lines)


def _number(value: Any) -> str:
    """4 significant digits; NaN for a value that is missing or not finite (``null`` in an old file)."""
    return f"{value:.4g}" if isinstance(value, (int, float)) else "nan"


def load_incidents(path: str) -> list[dict[str, Any]]:
    """The incidents of a run: ``path`` is ``incidents.jsonl``, a run directory, or its ``metrics.jsonl``.

    Reads lines of either kind: strict JSON (non-finite numbers as marked ``null``, restored to floats) and
    lines with bare ``NaN`` / ``Infinity``. A line without ``position_losses`` has its position buckets moved
    out of ``dataset_losses``; every incident is (re)assessed (:func:`assess`). A step written twice (a
    restarted run) keeps its last incident; in step order.
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
                incident = restore_nonfinite(json.loads(line))
                if "position_losses" not in incident:
                    incident["dataset_losses"], incident["position_losses"] = split_slices(
                        incident.get("dataset_losses") or {})
                by_step[int(incident["step"])] = assess(incident)
    return [by_step[step] for step in sorted(by_step)]


def split_slices(slices: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``loss/<name>`` values by name, split into (per-dataset, per-position-bucket) values."""
    datasets = {name: value for name, value in slices.items() if keys.parse_position_bucket_key(name) is None}
    positions = {name: value for name, value in slices.items() if keys.parse_position_bucket_key(name) is not None}
    return datasets, positions


def read_skip_list(path: str, per_incident: int = 1) -> set[int]:
    """Sample indices to skip: the ``per_incident`` highest-loss samples of each incident in ``path`` that are
    not typical of their step (:func:`is_typical`: a step-wide incident gives none).

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
            if not is_typical(sample, incident):
                yield int(sample["sample_index"])
