"""The tracker's per-step device values, as two metrics that join the collection's one sync.

The tracker issues no collective of its own: at a log step its two metrics are
synced together with the user's metrics (:func:`~twinkle_megatron.metric.sync.sync`:
one MAX and one SUM all-reduce in total), and the tracker builds its record from
their synced states (``record.py``).

* :class:`StepDataStates` -- what the data says: the loss (a
  :class:`~twinkle_megatron.LossMetric`, the one place losses are pooled),
  real tokens, packed sequence lengths. Counted once per data-parallel ×
  context-parallel coordinate: only the last pipeline stage and TP rank 0
  contribute, so TP duplicates and earlier stages never count twice.
* :class:`RankStates` -- what each rank measures (its step time, its memory,
  the non-finite values it saw, the latest grad norm and learning rate).
  Every rank contributes; reduced by max, except the per-rank step times,
  which travel as a vector with one slot per rank (a SUM of vectors that are
  zero except at their own rank's slot gives every rank's exact time, which
  min, max and the slowest rank are read from; 8 bytes per rank per log).

Both report nothing from ``compute``: the tracker composes the record.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence, Union

import torch
import torch.distributed as dist

from ..metric.base import Metric, SyncedStates
from ..metric.loss import LossMetric
from .memory import read_device_memory
from .timer import StepTimer

Value = Union[torch.Tensor, float, int]


class StepDataStates(LossMetric):
    """Loss, real tokens and packed-sequence statistics, summed over steps and DP×CP ranks.

    States: the :class:`~twinkle_megatron.LossMetric` ones (the loss: Megatron's
    ``[sum, count]`` reports pooled by tokens, means with equal weight), and (all ``sum``)
        ``tokens``: real (unpadded) tokens.
        ``sequence_tokens``, ``sequence_squares``: Σ sᵢ and Σ sᵢ² of packed
            sequence lengths, for FLOPs (added on CP rank 0 only: the lengths
            are of whole sequences, which every CP rank shares).
    """

    def __init__(self, device_mesh: Any = None, process_group: Any = None) -> None:
        super().__init__(device_mesh, process_group)
        for name in ("tokens", "sequence_tokens", "sequence_squares"):
            self.add_state(name, "sum")

    def add_tokens(self, tokens: Value) -> None:
        self._add("tokens", tokens)

    def add_sequence_lengths(self, lengths: Union[torch.Tensor, Sequence[int]]) -> None:
        if self.context.cp_rank != 0:
            return
        if isinstance(lengths, torch.Tensor):
            lengths = lengths.detach().to(torch.float64)
            self._add("sequence_tokens", lengths.sum())
            self._add("sequence_squares", (lengths * lengths).sum())
        else:
            self._add("sequence_tokens", float(sum(lengths)))
            self._add("sequence_squares", float(sum(int(length) ** 2 for length in lengths)))

    def compute(self, states: SyncedStates) -> dict:
        return {}


MEMORY_FIELDS = ("allocated_gib", "peak_allocated_gib", "reserved_gib", "peak_reserved_gib", "total_gib",
                 "utilization", "alloc_retries", "ooms")


class RankStates(Metric):
    """What each rank measures; every rank counts.

    States:
        ``steps`` (max): steps ended in the interval.
        ``interval_seconds_by_rank`` (sum, one slot per rank of the reduction
            group): the seconds this rank's steps of the interval took.
        ``nonfinite_loss_steps``, ``nonfinite_grad_norm_steps`` (max): steps of
            the interval in which this rank was given a non-finite value.
        ``grad_norm``, ``learning_rate``, ``num_zeros_in_grad`` (max): the
            latest value given (-inf: never given).
        ``memory_*`` (max): this rank's memory at the log step (-inf: no device).
    """

    every_rank_counts = True  # timings and memory of every rank count

    def __init__(self, world_size: int, timer: StepTimer, device_mesh: Any = None, process_group: Any = None) -> None:
        super().__init__(device_mesh, process_group)
        self.timer = timer
        self.add_state("steps", "max")
        self.add_state("interval_seconds_by_rank", "sum", shape=(world_size,))
        for name in ("nonfinite_loss_steps", "nonfinite_grad_norm_steps", "grad_norm", "learning_rate",
                     "num_zeros_in_grad", *(f"memory_{field}" for field in MEMORY_FIELDS)):
            self.add_state(name, "max")
        self.world_size = world_size
        self._steps = 0  # host-side twin of ``steps``: counting on the host costs nothing

    def add_step(self, nonfinite_loss: Value, grad_norm: Optional[Value], learning_rate: Optional[Value],
                 num_zeros_in_grad: Optional[Value]) -> None:
        self._steps += 1
        self._count("nonfinite_loss_steps", nonfinite_loss)
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
        """The interval's host values: steps, this rank's step time (one device sync on GPU), its memory."""
        self._assign("steps", float(self._steps))
        by_rank = torch.zeros(self.world_size, dtype=torch.float64)
        context = self.context
        by_rank[dist.get_rank(context.reduce_group) if context.distributed else 0] = sum(self.timer.collect())
        self._assign("interval_seconds_by_rank", by_rank)
        memory = read_device_memory()
        if memory is not None:
            for field in MEMORY_FIELDS:
                self._assign(f"memory_{field}", float(getattr(memory, field)))

    def reset(self) -> None:
        super().reset()
        self._steps = 0

    def compute(self, states: SyncedStates) -> dict:
        return {}
