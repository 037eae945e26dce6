"""Which metrics ``instrument()`` feeds: the defaults, and the one true vocabulary size they share."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from ..metric import Accuracy, LogitsMetric, LossMetric, Metric, TokenStatsMetric


def default_metrics(vocab_size: Optional[int] = None, ignore_index: int = -100,
                    group_names: Optional[Sequence[str]] = None, position_buckets: Any = None,
                    seq_length: Optional[int] = None) -> list[Metric]:
    """Token accuracy, label log-prob, entropy, non-finite counts and the per-token loss (per group and position
    bucket too)."""
    groups: dict[str, Any] = {"group_names": group_names} if group_names else {}
    if position_buckets is not None:
        groups.update(position_buckets=position_buckets, seq_length=seq_length)
    return [Accuracy(vocab_size=vocab_size, ignore_index=ignore_index, **groups),
            TokenStatsMetric(vocab_size=vocab_size, ignore_index=ignore_index, **groups),
            LossMetric(**groups)]


def shared_vocab_size(vocab_size: Optional[int], metrics: Sequence[Metric]) -> Optional[int]:
    """The true vocabulary size the hook computes statistics for: one value for all metrics.

    The hook computes the statistics once for every metric, so metrics asking
    for different vocabulary sizes cannot all be served: that is an error, not
    a silent choice.
    """
    sizes = {m.vocab_size for m in metrics if isinstance(m, LogitsMetric) and m.vocab_size is not None}
    if vocab_size is not None:
        sizes.add(vocab_size)
    if len(sizes) > 1:
        raise ValueError(f"instrument(): the metrics and vocab_size ask for different vocabulary sizes "
                         f"{sorted(sizes)}; the statistics are computed once for all of them")
    return sizes.pop() if sizes else None
