"""Parallel layout (TP/PP/CP/DP) and the single reduction of metric states."""

from .context import ParallelContext
from .reduce import all_reduce_sum_and_max

__all__ = ["ParallelContext", "all_reduce_sum_and_max"]
