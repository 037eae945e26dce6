"""The tracker's per-step device values, as two metrics that join the collection's one sync.

The tracker issues no collective of its own: at a log step its two metrics are
reduced together with the user's metrics by one ``calculate_metrics`` call
(one SUM and one MAX all-reduce in total).

* :class:`StepDataStates` -- what the data says (loss, real tokens, packed
  sequence lengths). Counted once per data-parallel × context-parallel
  coordinate: only the last pipeline stage and TP rank 0 contribute (the
  ``Metric`` default), so TP duplicates and earlier stages never count twice.
* :class:`RankStates` -- what each rank measures (its step time, its memory,
  the non-finite values it saw, the latest grad norm and learning rate).
  Every rank contributes; reduced by max, except the per-rank step times,
  which travel as a vector with one slot per rank (a SUM of vectors that are
  zero except at their own rank's slot gives every rank's exact time, which
  min, max and the slowest rank are read from; 8 bytes per rank per log).

Both keep their reduced states in ``reduced`` and return ``{}`` from
``compute``: the tracker composes the record (see ``record.py``).
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Optional, Sequence, Union

import torch

from ..metric.base import Metric, StateValues
from .memory import MemorySnapshot

Value = Union[torch.Tensor, float, int]


class StepDataStates(Metric):
    """Loss, real tokens and packed-sequence statistics, summed over steps and DP×CP ranks.

    States (all ``sum``):
        ``loss_sum``, ``loss_tokens``: Megatron-LM ``[sum, count]`` loss reports
            (finite ones only): loss = Σ loss_sum / Σ loss_tokens.
        ``loss_mean_sum``, ``loss_means``: losses passed as means (finite ones):
            loss = Σ means / number of means.
        ``tokens``: real (unpadded) tokens.
        ``sequence_tokens``, ``sequence_squares``: Σ sᵢ and Σ sᵢ² of packed
            sequence lengths, for FLOPs (added on CP rank 0 only: the lengths
            are of whole sequences, which every CP rank shares).
    """

    def __init__(self, device_mesh: Any = None, process_group: Any = None) -> None:
        super().__init__(device_mesh, process_group)
        for name in ("loss_sum", "loss_tokens", "loss_mean_sum", "loss_means", "tokens", "sequence_tokens",
                     "sequence_squares"):
            self.add_state(name, "sum")
        self.reduced: dict[str, Any] = {}

    def add_loss(self, reports: Sequence[Value]) -> tuple[Value, Optional[Value]]:
        """Add loss reports: 2-element ``[sum, count]`` tensors or scalar means.

        Returns (1.0 if any report was non-finite else 0.0, the total count of
        the ``[sum, count]`` reports or None), as device tensors or floats:
        never read on the host here.
        """
        nonfinite_flags: list[Union[torch.Tensor, bool]] = []
        count: Optional[Value] = None
        for report in reports:
            if isinstance(report, torch.Tensor) and report.numel() == 2:
                loss_sum, loss_count = report.detach().reshape(2).to(torch.float64).unbind()
                finite = torch.isfinite(loss_sum)
                self._add("loss_sum", torch.where(finite, loss_sum, torch.zeros_like(loss_sum)))
                self._add("loss_tokens", torch.where(finite, loss_count, torch.zeros_like(loss_count)))
                count = loss_count if count is None else count + loss_count
                nonfinite_flags.append(~finite)
            elif isinstance(report, torch.Tensor) and report.numel() == 1:
                mean = report.detach().reshape(()).to(torch.float64)
                finite = torch.isfinite(mean)
                self._add("loss_mean_sum", torch.where(finite, mean, torch.zeros_like(mean)))
                self._add("loss_means", finite)
                nonfinite_flags.append(~finite)
            elif isinstance(report, numbers.Real):
                finite = math.isfinite(report)
                self._add("loss_mean_sum", float(report) if finite else 0.0)
                self._add("loss_means", 1.0 if finite else 0.0)
                nonfinite_flags.append(not finite)
            else:
                raise ValueError(f"a loss must be a scalar mean or a [sum, count] pair, got "
                                 f"{type(report).__name__} of shape {tuple(getattr(report, 'shape', ()))}")
        return any_flag(nonfinite_flags), count

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

    def compute(self, states: StateValues) -> dict:
        self.reduced = dict(states)
        return {}


def any_flag(flags: Sequence[Union[torch.Tensor, bool]]) -> Value:
    """1.0 if any flag is set, else 0.0; a device tensor when any flag is one (never read here)."""
    host = 1.0 if any(flag is True for flag in flags) else 0.0
    tensors = [flag.reshape(()).to(torch.float64) for flag in flags if isinstance(flag, torch.Tensor)]
    if not tensors:
        return host
    return torch.stack([t.to(tensors[0].device) for t in tensors]).max().clamp(min=host)


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

    def __init__(self, world_size: int, device_mesh: Any = None, process_group: Any = None) -> None:
        super().__init__(device_mesh, process_group)
        self.add_state("steps", "max")
        self.add_state("interval_seconds_by_rank", "sum", shape=(world_size,))
        for name in ("nonfinite_loss_steps", "nonfinite_grad_norm_steps", "grad_norm", "learning_rate",
                     "num_zeros_in_grad", *(f"memory_{field}" for field in MEMORY_FIELDS)):
            self.add_state(name, "max")
        self.world_size = world_size
        self._steps = 0  # host-side twin of ``steps``: counting on the host costs nothing
        self.reduced: dict[str, Any] = {}

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

    def set_interval(self, rank_index: int, seconds: float, memory: Optional[MemorySnapshot]) -> None:
        """Host values of the interval, set just before the sync."""
        self._assign("steps", float(self._steps))
        by_rank = torch.zeros(self.world_size, dtype=torch.float64)
        by_rank[rank_index] = seconds
        self._assign("interval_seconds_by_rank", by_rank)
        if memory is not None:
            for field in MEMORY_FIELDS:
                self._assign(f"memory_{field}", float(getattr(memory, field)))

    def _local_states(self) -> dict[str, torch.Tensor]:
        return self._states  # timings and memory of every rank count

    def reset(self) -> None:
        super().reset()
        self._steps = 0

    def compute(self, states: StateValues) -> dict:
        self.reduced = dict(states)
        return {}
