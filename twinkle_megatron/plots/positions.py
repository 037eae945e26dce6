"""The loss-by-position chart of a run log (keys ``loss/pos_<first>-<last>``, see ``position_buckets``).

Long-context users read it to see whether late positions learn: x is the
position bucket (in order of its first position), y the loss; one line per
chosen step (the first, the middle and the last step that logged the buckets),
so the curve's fall from step to step shows where in the sequence the model
improves. Drawn on a matplotlib ``Axes`` given by :mod:`.run`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, List, Tuple

from .. import keys
from .axes_style import BELOW_X_LABEL_POINTS, legend_below

if TYPE_CHECKING:
    from ..logging.runlog import RunLog


def position_keys(log: RunLog) -> List[Tuple[int, int, str]]:
    """(first, end, key) of every ``loss/pos_<first>-<end - 1>`` key of the log, by first position (the bucket
    name read by :func:`twinkle_megatron.keys.parse_position_bucket_key`, the reader of what the metrics write)."""
    found = []
    for key in log.keys:
        statistic, _, name = key.partition("/")
        bucket = keys.parse_position_bucket_key(name) if statistic == keys.LOSS else None
        if bucket is not None:
            found.append((*bucket, key))
    return sorted(found)


def draw_loss_by_position(axes: Any, log: RunLog) -> None:
    """The loss per position bucket at the first, middle and last step that logged buckets."""
    buckets = position_keys(log)
    records = [record for record in log.records if any(key in record for _, _, key in buckets)]
    if not records:
        return
    chosen = sorted({0, len(records) // 2, len(records) - 1})
    handles = []
    for shade, index in enumerate(chosen):
        record = records[index]
        values = [record.get(key, math.nan) for _, _, key in buckets]
        handles += axes.plot(range(len(buckets)), values, marker="o", markersize=3, color=f"C{shade}",
                             label=f"step {record['step']}")
    rotated = len(buckets) > 6
    axes.set_xticks(range(len(buckets)))
    axes.set_xticklabels([f"{first}-{end - 1}" for first, end, _ in buckets], rotation=30 if rotated else 0)
    axes.set_xlabel("token position in its sequence")
    axes.set_ylabel("loss")
    axes.grid(alpha=0.3)
    # Labels turned by 30 degrees stand taller: about half their width more ("4096-8191" is ~45 points wide).
    longest = max(len(f"{first}-{end - 1}") for first, end, _ in buckets)
    legend_below(axes, handles, BELOW_X_LABEL_POINTS + (longest * 5.5 * 0.5 if rotated else 0))
