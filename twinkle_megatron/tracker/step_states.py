"""The values ``end_step`` is given, as two metrics that join the collection's one sync.

The tracker issues no collective of its own: at a log step its metrics
(these two and :class:`~.throughput.Throughput`) are synced together with the
user's metrics (:func:`~twinkle_megatron.metric.state.sync.sync`: one MAX and one
SUM all-reduce in total), and each returns its part of the record from its own
``compute`` (keys in :mod:`twinkle_megatron.keys`).

* :class:`StepLoss` -- the loss (a :class:`~twinkle_megatron.LossMetric`, the
  one place losses are pooled). Counted once per data-parallel ×
  context-parallel coordinate: only the last pipeline stage and TP rank 0
  contribute, so TP duplicates and earlier stages never count twice.
* :class:`RankStates` -- what each rank was given or measures (the non-finite
  values it saw, the steps its optimizer skipped, the latest grad norm,
  learning rate and zeros in the gradients, its memory). Every rank
  contributes; reduced by max.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Optional, Sequence, Union

import torch

from .. import keys
from ..metric import LossMetric, Metric, Number, SyncedStates, common_device, to_device
from .memory import read_device_memory

Value = Union[torch.Tensor, float, int]

MEMORY_FIELDS = ("allocated_gib", "peak_allocated_gib", "reserved_gib", "peak_reserved_gib", "total_gib",
                 "utilization", "alloc_retries", "ooms")
_ABSENT = float("-inf")  # a max state nobody set


class StepLoss(LossMetric):
    """The interval's loss, from the :class:`~twinkle_megatron.LossMetric` states (fed by ``end_step``).

    ``loss`` = Σ loss sums / Σ loss token counts (Megatron's ``[sum, count]``
    reports, summed over DP×CP), or the mean of the losses passed as means
    (:meth:`LossMetric.pooled_loss`); non-finite losses are left out (counted by
    :class:`RankStates`). Nothing else: the grad norm is :class:`RankStates`'.
    """

    def compute(self, states: SyncedStates) -> dict[str, Number]:
        loss = self.pooled_loss(states)
        return {keys.LOSS: loss} if loss is not None else {}


class RankStates(Metric):
    """What each rank was given or measures; every rank counts.

    States (all ``max``):
        ``nonfinite_loss_steps``, ``nonfinite_grad_norm_steps``: steps of the
            interval in which this rank was given (or its metrics counted) a
            non-finite value.
        ``skipped_steps``: steps of the interval whose optimizer step was skipped
            (Megatron's ``update_successful`` False: an inf/NaN gradient under
            fp16/bf16 loss scaling).
        ``grad_norm``, ``learning_rate``, ``num_zeros_in_grad``: the latest value
            given (-inf: never given).
        ``memory_*``: this rank's memory at the log step (-inf: no device).

    ``compute``: ``train/nonfinite_loss_steps``, ``train/nonfinite_grad_norm_steps``,
    ``train/skipped_steps`` (max over ranks; 0 when none), ``grad_norm``, ``train/num_zeros_in_grad``,
    ``learning rate`` (latest value, max over ranks; only when given) and
    ``memory/*`` (max over ranks, GiB; ``utilization`` = peak reserved / capacity;
    ``alloc_retries`` and ``ooms`` since the process started; only with a device).
    """

    every_rank_counts = True  # values and memory of every rank count

    def __init__(self, device_mesh: Any = None, process_group: Any = None, device_memory: bool = True) -> None:
        super().__init__(device_mesh, process_group)
        self.device_memory = device_memory  # False: memory is not read (the states stay -inf: no memory keys)
        for name in ("nonfinite_loss_steps", "nonfinite_grad_norm_steps", "skipped_steps", "grad_norm", "learning_rate",
                     "num_zeros_in_grad", *(f"memory_{field}" for field in MEMORY_FIELDS)):
            self.add_state(name, "max")

    def add_step(self, nonfinite_loss: Value, grad_norm: Optional[Value], learning_rate: Optional[Value],
                 num_zeros_in_grad: Optional[Value], skipped: Value = 0.0) -> None:
        """One step: ``nonfinite_loss`` and ``skipped`` are 0/1 flags (device tensors or numbers)."""
        self._count("nonfinite_loss_steps", nonfinite_loss)
        self._count("skipped_steps", skipped)
        if grad_norm is not None:
            if isinstance(grad_norm, torch.Tensor):
                grad_norm = grad_norm.detach().reshape(()).to(torch.float64)
                self._count("nonfinite_grad_norm_steps", ~torch.isfinite(grad_norm))
            else:
                self._count("nonfinite_grad_norm_steps", 0.0 if math.isfinite(grad_norm) else 1.0)
            self._assign("grad_norm", grad_norm)
        if learning_rate is not None:
            self._assign("learning_rate", learning_rate)
        if num_zeros_in_grad is not None:
            self._assign("num_zeros_in_grad", num_zeros_in_grad)

    def _count(self, name: str, flag: Value) -> None:
        """Add a 0/1 flag to a counter kept in a max state (which starts at -inf, not 0)."""
        self._maximum(name, 0.0)
        self._add(name, flag)

    def before_sync(self) -> None:
        """This rank's memory at the log step."""
        memory = read_device_memory() if self.device_memory else None
        if memory is not None:
            for field in MEMORY_FIELDS:
                self._assign(f"memory_{field}", float(getattr(memory, field)))

    def compute(self, states: SyncedStates) -> dict[str, Number]:
        results: dict[str, Number] = {}
        for state, key in (("nonfinite_loss_steps", keys.NONFINITE_LOSS_STEPS),
                           ("nonfinite_grad_norm_steps", keys.NONFINITE_GRAD_NORM_STEPS),
                           ("skipped_steps", keys.SKIPPED_STEPS)):
            value = states[state]
            results[key] = int(value) if value != _ABSENT and math.isfinite(value) else 0
        for state, key in (("grad_norm", keys.GRAD_NORM), ("num_zeros_in_grad", keys.NUM_ZEROS_IN_GRAD),
                           ("learning_rate", keys.LEARNING_RATE)):
            if states[state] != _ABSENT:
                results[key] = states[state]
        for field in MEMORY_FIELDS:
            value = states[f"memory_{field}"]
            if value != _ABSENT:
                results[keys.MEMORY_PREFIX + field] = int(value) if field in ("alloc_retries", "ooms") else value
        return results


class NonfiniteLossCounts:
    """Per step, whether a loss metric among the tracker's metrics (``LossMetric``, ``EmbeddingMetric``: those
    with a ``nonfinite_loss_state``) counted a non-finite loss: 1 when its
    :meth:`~twinkle_megatron.Metric.nonfinite_loss_count` grew since the previous step end.

    The count is this rank's (the identity 0 where the rank's data does not count): a device tensor, compared on
    the device (no host sync). The same flag as a non-finite loss given to ``end_step``, so
    ``train/nonfinite_loss_steps`` counts divergence one way.
    """

    def __init__(self, metrics: Iterable[Metric]) -> None:
        self.metrics = [m for m in metrics if m.nonfinite_loss_state is not None]
        self._counted: list[Optional[torch.Tensor]] = [None] * len(self.metrics)  # each count at the last step end

    def step_flags(self) -> list[torch.Tensor]:
        flags = []
        for position, metric in enumerate(self.metrics):
            count, previous = metric.nonfinite_loss_count(), self._counted[position]
            flags.append((count > 0) if previous is None else (count > previous.to(count.device)))
            self._counted[position] = count
        return flags

    def reset(self) -> None:
        """The metrics were reset (synced) or reloaded: their counts start again."""
        self._counted = [None] * len(self.metrics)


def any_flag(flags: Sequence[Any]) -> Any:
    """The max of 0/1 flags (numbers or device tensors): a number when all are numbers, else a float64 tensor on
    the accelerator any of them is on. Numbers are maxed on the host, tensors on the device (CPU tensors are
    copied up without a host wait, never device values down)."""
    tensors = [flag for flag in flags if isinstance(flag, torch.Tensor)]
    on_host = max((float(flag) for flag in flags if not isinstance(flag, torch.Tensor)), default=0.0)
    if not tensors:
        return on_host
    device = common_device(tensors)
    flag = torch.stack([to_device(t.detach().reshape(()), device).to(torch.float64) for t in tensors]).amax()
    return flag.clamp_min(on_host) if on_host else flag


def skipped_flag(update_successful: Any) -> Any:
    """1 when the optimizer skipped the step (``update_successful`` False), 0 when it did not or it is unknown."""
    if update_successful is None:
        return 0.0
    if isinstance(update_successful, torch.Tensor):
        return (~update_successful.detach().reshape(()).bool()).to(torch.float64)
    return 0.0 if update_successful else 1.0
