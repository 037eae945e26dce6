"""Device memory of this rank: current, per-interval peaks, capacity, allocator trouble.

Read from the caching allocator's counters on the host (no device sync), once
per log interval. Peaks are reset after each read, so they are the peaks of
the interval just logged. Nothing is reported without a CUDA (or ROCm) device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

GIB = 1024 ** 3


@dataclass(frozen=True)
class MemorySnapshot:
    """One rank's device memory, in GiB, and its allocator's cumulative trouble counters."""

    allocated_gib: float
    peak_allocated_gib: float
    reserved_gib: float
    peak_reserved_gib: float
    total_gib: float
    alloc_retries: int  # cudaMalloc failed, cache flushed and retried (since the process started)
    ooms: int  # out-of-memory errors raised (since the process started)

    @property
    def utilization(self) -> float:
        """Peak reserved memory of the interval as a fraction of the device's capacity.

        Reserved rather than allocated: the allocator's reserve is what runs out.
        """
        return self.peak_reserved_gib / self.total_gib if self.total_gib > 0 else 0.0


def read_device_memory(device: Optional[torch.device] = None) -> Optional[MemorySnapshot]:
    """This rank's memory on ``device`` (default: the current CUDA device), or ``None`` on CPU."""
    if not torch.cuda.is_available() or (device is not None and device.type != "cuda"):
        return None
    device = device if device is not None else torch.device("cuda", torch.cuda.current_device())
    stats = torch.cuda.memory_stats(device)
    return MemorySnapshot(
        allocated_gib=stats.get("allocated_bytes.all.current", 0) / GIB,
        peak_allocated_gib=stats.get("allocated_bytes.all.peak", 0) / GIB,
        reserved_gib=stats.get("reserved_bytes.all.current", 0) / GIB,
        peak_reserved_gib=stats.get("reserved_bytes.all.peak", 0) / GIB,
        total_gib=torch.cuda.get_device_properties(device).total_memory / GIB,
        alloc_retries=int(stats.get("num_alloc_retries", 0)),
        ooms=int(stats.get("num_ooms", 0)),
    )


def reset_peak_memory(device: Optional[torch.device] = None) -> None:
    """Start a new interval: the next peaks are measured from now."""
    if torch.cuda.is_available() and (device is None or device.type == "cuda"):
        torch.cuda.reset_peak_memory_stats(device)
