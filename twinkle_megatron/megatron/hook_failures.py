"""Hook failures as data: counted on every rank, raised by ``calculate()`` on every rank.

A failure inside a hook must not escape mid-schedule (the other pipeline stages
would wait in a p2p call forever), so it is recorded here and joins the
metrics' one sync.
"""

from __future__ import annotations

import traceback
from typing import Any, Optional

from .. import keys
from ..metric import Metric, Number, SyncedStates


class MetricHookError(RuntimeError):
    """A metric hook failed during the step on some rank; raised by ``calculate()`` on every rank."""


class HookFailures(Metric):
    """Counts hook failures on every rank, so that every rank learns of them in the one sync.

    Reports them as data, ``train/metric_hook_failures`` (when > 0), on every
    rank; :meth:`MegatronInstrumentation.calculate` raises :class:`MetricHookError`
    for them, a :class:`~twinkle_megatron.MetricsTracker` logs them as an alarm.
    :meth:`first_failure` is this rank's first message of the interval (until
    the sync resets the interval), read before the sync: ``compute`` only reports.
    """

    every_rank_counts = True  # a failure on any rank counts, whatever its stage

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("failures", "sum")
        self.messages: list[str] = []  # this rank's, of the current interval

    def record(self, where: str, error: BaseException) -> None:
        self.messages.append(f"{where}: {type(error).__name__}: {error}\n{traceback.format_exc()}")
        self._add("failures", 1.0)

    def accumulate(self, inputs: Any, outputs: Any, **kwargs: Any) -> None:
        pass

    def first_failure(self) -> Optional[str]:
        """This rank's first failure message of the current interval (None: none here)."""
        return self.messages[0] if self.messages else None

    def reset(self) -> None:
        """A new interval: no failure yet (the states and this rank's messages)."""
        super().reset()
        self.messages = []

    def compute(self, states: SyncedStates) -> dict[str, Number]:
        return {keys.METRIC_HOOK_FAILURES: int(states["failures"])} if states["failures"] else {}
