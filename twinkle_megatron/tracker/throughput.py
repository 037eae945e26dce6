"""Step time, real-token throughput, FLOP rates and the running token total, as one metric.

:class:`Throughput` holds every state these numbers are made of, so its
``compute`` returns them all; it joins the collection's one sync like any
metric. Its states are counted two ways (see :meth:`Throughput.sync_states`):

* what the data says -- real tokens, packed sequence lengths, the running token
  total -- once per data-parallel × context-parallel coordinate (the last
  pipeline stage, TP rank 0), so TP duplicates and earlier stages never count twice;
* what each rank measures -- its steps and its seconds -- on every rank. The
  per-rank seconds travel as a vector with one slot per rank (a SUM of vectors
  that are zero except at their own rank's slot gives every rank's exact time,
  which min, max and the slowest rank are read from; 8 bytes per rank per log).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist

from .. import keys
from ..metric import Metric, Number, SyncedStates
from .flops import FlopsCoefficients
from .timer import StepTimer

Value = Union[torch.Tensor, float, int]
_EVERY_RANK = ("steps", "seconds_by_rank")  # measured by each rank: every rank counts
_ABSENT = float("-inf")  # a max state nobody set


class Throughput(Metric):
    """Step time, tokens/s, TFLOP/s, MFU and consumed tokens of a log interval.

    Formulas (Σ over the steps of the interval; "ranks" are those of the reduction group):

    * ``perf/step_time``: max over ranks of (a rank's seconds in the interval / steps):
      a synchronous step is as slow as its slowest rank. ``perf/step_time_min``: the min;
      ``perf/slowest_rank``: the global rank with the max (lowest rank on ties).
    * ``perf/tokens_per_second`` = real tokens (summed over steps and DP×CP ranks) /
      (step_time · steps); ``perf/tokens_per_second_per_gpu`` = that / world size.
    * ``perf/tflops_per_gpu`` = FLOPs / (step_time · steps) / world size / 1e12, where
      FLOPs = c₁·Σ sᵢ + c₂·Σ sᵢ² of the packed sequences passed, or
      steps · flops_per_step; ``perf/mfu`` = tflops_per_gpu / peak TFLOP/s per GPU.
    * ``train/consumed_tokens``: real tokens since step 1 (the loaded total + the
      tokens since then), when any.

    States: ``tokens``, ``sequence_tokens``, ``sequence_squares`` (sum, the
    interval's), ``consumed_tokens`` (sum, since the start or the last
    :meth:`restart`: never reset by a sync), ``steps`` (max) and
    ``seconds_by_rank`` (sum, one slot per rank).

    Args:
        timer: the tracker's step timer (read once per sync).
        flops_per_step: global FLOPs of one step, when known up front.
        flops_coefficients: for per-step packed sequence lengths.
        peak_tflops: the peak TFLOP/s per GPU at the log step (None: no MFU).
    """

    def __init__(self, timer: StepTimer, flops_per_step: Optional[float] = None,
                 flops_coefficients: Optional[FlopsCoefficients] = None,
                 peak_tflops: Callable[[], Optional[float]] = lambda: None,
                 device_mesh: Any = None, process_group: Any = None) -> None:
        super().__init__(device_mesh, process_group)
        self.timer = timer
        self.flops_per_step = flops_per_step
        self.flops_coefficients = flops_coefficients
        self.peak_tflops = peak_tflops
        self.world_size = self.context.reduce_size
        for name in ("tokens", "sequence_tokens", "sequence_squares", "consumed_tokens"):
            self.add_state(name, "sum")
        self.add_state("steps", "max")
        self.add_state("seconds_by_rank", "sum", shape=(self.world_size,))
        self._steps = 0  # host-side twin of ``steps``: counting on the host costs nothing
        self._consumed_before = 0  # the total a checkpoint started from

    def add_step(self, tokens: Optional[Value]) -> None:
        """One step ended, with this rank's real tokens (a device tensor or a number; None: not known)."""
        self._steps += 1
        if tokens is not None:
            self._add("tokens", tokens)
            self._add("consumed_tokens", tokens)

    def add_sequence_lengths(self, lengths: Union[torch.Tensor, Sequence[int]]) -> None:
        """Σ sᵢ and Σ sᵢ² of the packed sequences (CP rank 0 only: every CP rank shares whole sequences)."""
        if self.context.cp_rank != 0:
            return
        if isinstance(lengths, torch.Tensor):
            lengths = lengths.detach().to(torch.float64)
            self._add("sequence_tokens", lengths.sum())
            self._add("sequence_squares", (lengths * lengths).sum())
        else:
            self._add("sequence_tokens", float(sum(lengths)))
            self._add("sequence_squares", float(sum(int(length) ** 2 for length in lengths)))

    def before_sync(self) -> None:
        """The interval's host values: steps and this rank's seconds (one device sync on GPU)."""
        self._assign("steps", float(self._steps))
        by_rank = torch.zeros(self.world_size, dtype=torch.float64)
        context = self.context
        by_rank[dist.get_rank(context.reduce_group) if context.distributed else 0] = sum(self.timer.collect())
        self._assign("seconds_by_rank", by_rank)

    def sync_states(self) -> dict[str, torch.Tensor]:
        """The data's states where this rank's data counts (identities elsewhere); its own steps and seconds always."""
        local = super().sync_states()
        return {**local, **{name: self._states[name] for name in _EVERY_RANK}}

    def reset(self) -> None:
        """A new interval; the running token total carries on."""
        self._fold_pending(("consumed_tokens",))  # Python numbers since the last sync count too
        consumed = self._states.get("consumed_tokens")
        super().reset()
        self._steps = 0
        if consumed is not None:
            self._states["consumed_tokens"] = consumed

    def restart(self, consumed_tokens: int) -> None:
        """Continue from a checkpoint's total: this process's counts so far (and the steps not logged) are dropped."""
        super().reset()
        self._steps = 0
        self._consumed_before = int(consumed_tokens)

    def compute(self, states: SyncedStates) -> dict[str, Number]:
        results: dict[str, Number] = {}
        steps = int(states["steps"]) if states["steps"] != _ABSENT else 0
        if steps:
            results.update(self._rates(states, steps))
        consumed = self._consumed_before + int(states["consumed_tokens"])
        if consumed > 0:
            results[keys.CONSUMED_TOKENS] = consumed
        return results

    def _rates(self, states: SyncedStates, steps: int) -> dict[str, Number]:
        by_rank: torch.Tensor = states["seconds_by_rank"]
        slowest = int(torch.argmax(by_rank))  # first maximum: the lowest rank on ties
        seconds = float(by_rank[slowest])
        context = self.context
        results: dict[str, Number] = {
            keys.STEP_TIME: seconds / steps, keys.STEP_TIME_MIN: float(by_rank.min()) / steps,
            keys.SLOWEST_RANK: dist.get_global_rank(context.reduce_group, slowest)
            if context.distributed and context.reduce_group is not None else slowest}
        tokens = int(states["tokens"])
        if tokens > 0 and seconds > 0:
            results[keys.TOKENS_PER_SECOND] = tokens / seconds
            results[keys.TOKENS_PER_SECOND_PER_GPU] = results[keys.TOKENS_PER_SECOND] / self.world_size
        flops = self._flops(states, steps)
        if flops is not None and seconds > 0:
            results[keys.TFLOPS_PER_GPU] = flops / seconds / self.world_size / 1e12
            peak = self.peak_tflops()
            if peak:
                results[keys.MFU] = results[keys.TFLOPS_PER_GPU] / peak
        return results

    def _flops(self, states: SyncedStates, steps: int) -> Optional[float]:
        if states["sequence_tokens"] > 0 and self.flops_coefficients is not None:
            return self.flops_coefficients.flops(states["sequence_tokens"], states["sequence_squares"])
        if self.flops_per_step is not None:
            return self.flops_per_step * steps
        return None
