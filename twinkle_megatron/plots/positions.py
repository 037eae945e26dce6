"""The loss-by-position chart of a run log (keys ``loss/pos_<first>-<last>``, see ``position_buckets``).

Long-context users read it to see whether late positions learn: x is the
position bucket (in order of its first position), y the loss; one line per
chosen step (the first, the middle and the last step that logged the buckets),
so the curve's fall from step to step shows where in the sequence the model
improves. Drawn on a matplotlib ``Axes`` given by :mod:`.plots`.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any, List, Tuple

if TYPE_CHECKING:
    from ..logging.runlog import RunLog

POSITION_KEY = re.compile(r"^loss/pos_(\d+)-(\d+)$")


def position_keys(log: RunLog) -> List[Tuple[int, int, str]]:
    """(first, last, key) of every ``loss/pos_<first>-<last>`` key of the log, by first position."""
    found = [(int(match.group(1)), int(match.group(2)), key) for key in log.keys
             if (match := POSITION_KEY.match(key))]
    return sorted(found)


def draw_loss_by_position(axes: Any, log: RunLog) -> None:
    """The loss per position bucket at the first, middle and last step that logged buckets."""
    buckets = position_keys(log)
    records = [record for record in log.records if any(key in record for _, _, key in buckets)]
    if not records:
        return
    chosen = sorted({0, len(records) // 2, len(records) - 1})
    for shade, index in enumerate(chosen):
        record = records[index]
        values = [record.get(key, math.nan) for _, _, key in buckets]
        axes.plot(range(len(buckets)), values, marker="o", markersize=3, color=f"C{shade}",
                  label=f"step {record['step']}")
    axes.set_xticks(range(len(buckets)))
    axes.set_xticklabels([f"{first}-{last}" for first, last, _ in buckets], rotation=30 if len(buckets) > 6 else 0)
    axes.set_xlabel("token position in its sequence")
    axes.set_ylabel("loss")
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small")
