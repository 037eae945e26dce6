"""From the reduced states of one log interval to the numbers the tracker reports.

A pure function of globally reduced values, so every rank computes the same
record. Keys appear only when their inputs exist (no loss given: no ``loss``;
no FLOPs or no known peak: no ``perf/mfu``; no GPU: no ``memory/*``); values are
Python numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch

from .. import keys
from ..metric.loss import LossMetric
from .flops import FlopsCoefficients
from .step_states import MEMORY_FIELDS

_ABSENT = float("-inf")  # a max state nobody set


@dataclass(frozen=True)
class ThroughputSetup:
    """What turns tokens and seconds into FLOP rates (fixed for a run)."""

    world_size: int  # GPUs (ranks of the reduction group)
    flops_per_step: Optional[float] = None  # global FLOPs of one step, when known up front
    flops_coefficients: Optional[FlopsCoefficients] = None  # for per-step packed sequence lengths
    peak_tflops: Optional[float] = None  # per GPU; None: MFU is not reported


def interval_record(data: Mapping[str, Any], ranks: Mapping[str, Any], setup: ThroughputSetup) -> dict[str, float]:
    """The interval's record (before smoothing) from :class:`StepDataStates` and :class:`RankStates`.

    Formulas (Σ over the steps of the interval; "ranks" are those of the reduction group;
    key names from :mod:`twinkle_megatron.keys`):

    * ``loss`` = Σ loss sums / Σ loss token counts (Megatron's ``[sum, count]``
      reports, summed over DP×CP), or the mean of the losses passed as means
      (:meth:`LossMetric.pooled_loss`); non-finite losses are left out and the
      steps that had one counted in ``train/nonfinite_loss_steps``.
    * ``train/nonfinite_loss_steps``, ``train/nonfinite_grad_norm_steps``: max over
      ranks of the steps in which a rank was given a non-finite value.
    * ``grad_norm``, ``train/num_zeros_in_grad``, ``learning rate``: latest value, max over ranks.
    * ``perf/step_time``: max over ranks of (a rank's seconds in the interval / steps):
      a synchronous step is as slow as its slowest rank. ``perf/step_time_min``: the min;
      ``perf/slowest_rank``: the rank with the max (lowest rank on ties).
    * ``perf/tokens_per_second`` = real tokens (summed over steps and DP×CP ranks) /
      (step_time · steps); ``perf/tokens_per_second_per_gpu`` = that / world size.
    * ``perf/tflops_per_gpu`` = FLOPs / (step_time · steps) / world size / 1e12, where
      FLOPs = c₁·Σ sᵢ + c₂·Σ sᵢ² of the packed sequences passed, or
      steps · flops_per_step; ``perf/mfu`` = tflops_per_gpu / peak TFLOP/s per GPU.
    * ``memory/*``: max over ranks (GiB; ``utilization`` = peak reserved / capacity;
      ``alloc_retries`` and ``ooms`` since the process started).

    The interval's step and token counts themselves are :func:`interval_steps`
    and :func:`interval_tokens` (the tracker logs the running token total).
    """
    record: dict[str, float] = {}
    _loss(data, ranks, record)
    for state, key in (("grad_norm", keys.GRAD_NORM), ("num_zeros_in_grad", keys.NUM_ZEROS_IN_GRAD),
                       ("learning_rate", keys.LEARNING_RATE)):
        if ranks[state] != _ABSENT:
            record[key] = ranks[state]
    steps = interval_steps(ranks)
    if steps == 0:
        return record
    by_rank: torch.Tensor = ranks["interval_seconds_by_rank"]
    slowest = int(torch.argmax(by_rank))  # first maximum: the lowest rank on ties
    seconds = float(by_rank[slowest])
    record[keys.STEP_TIME] = seconds / steps
    record[keys.STEP_TIME_MIN] = float(by_rank.min()) / steps
    record[keys.SLOWEST_RANK] = slowest
    tokens = interval_tokens(data)
    if tokens > 0 and seconds > 0:
        record[keys.TOKENS_PER_SECOND] = tokens / seconds
        record[keys.TOKENS_PER_SECOND_PER_GPU] = record[keys.TOKENS_PER_SECOND] / setup.world_size
    flops = _interval_flops(data, steps, setup)
    if flops is not None and seconds > 0:
        record[keys.TFLOPS_PER_GPU] = flops / seconds / setup.world_size / 1e12
        if setup.peak_tflops:
            record[keys.MFU] = record[keys.TFLOPS_PER_GPU] / setup.peak_tflops
    for field in MEMORY_FIELDS:
        value = ranks[f"memory_{field}"]
        if value != _ABSENT:
            record[keys.MEMORY_PREFIX + field] = int(value) if field in ("alloc_retries", "ooms") else value
    return record


def interval_steps(ranks: Mapping[str, Any]) -> int:
    """Steps ended in the interval (0 when none)."""
    return int(ranks["steps"]) if ranks["steps"] != _ABSENT else 0


def interval_tokens(data: Mapping[str, Any]) -> int:
    """Real tokens of the interval, summed over steps and DP×CP ranks."""
    return int(data["tokens"])


def _loss(data: Mapping[str, Any], ranks: Mapping[str, Any], record: dict[str, float]) -> None:
    loss = LossMetric.pooled_loss(data)
    if loss is not None:
        record[keys.LOSS] = loss
    for state, key in (("nonfinite_loss_steps", keys.NONFINITE_LOSS_STEPS),
                       ("nonfinite_grad_norm_steps", keys.NONFINITE_GRAD_NORM_STEPS)):
        value = ranks[state]
        record[key] = int(value) if value != _ABSENT and math.isfinite(value) else 0


def _interval_flops(data: Mapping[str, Any], steps: int, setup: ThroughputSetup) -> Optional[float]:
    if data["sequence_tokens"] > 0 and setup.flops_coefficients is not None:
        return setup.flops_coefficients.flops(data["sequence_tokens"], data["sequence_squares"])
    if setup.flops_per_step is not None:
        return setup.flops_per_step * steps
    return None
