"""Parallel layout (TP/PP/CP/DP) and the single reduction of metric states."""

from .context import ParallelContext
from .layout import Layout
from .reduce import all_gather_records, all_reduce_sum_and_max

__all__ = ["Layout", "ParallelContext", "all_gather_records", "all_reduce_sum_and_max"]
