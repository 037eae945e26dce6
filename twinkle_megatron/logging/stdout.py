"""One readable line per log step."""

from __future__ import annotations

import sys
from typing import Callable, Mapping, Optional, TextIO

from .base import Backend

# (key, label, format): the tracker's keys in reading order; other numeric keys follow as "key value".
_LINE: tuple[tuple[str, str, Callable[[float], str]], ...] = (
    ("loss", "loss", lambda v: f"{v:.4f}"),
    ("loss_ema", "loss_ema", lambda v: f"{v:.4f}"),
    ("grad_norm", "grad_norm", lambda v: f"{v:.3f}"),
    ("learning_rate", "lr", lambda v: f"{v:.2e}"),
    ("accuracy", "accuracy", lambda v: f"{v:.4f}"),
    ("logprob", "logprob", lambda v: f"{v:.4f}"),
    ("entropy", "entropy", lambda v: f"{v:.4f}"),
    ("tokens_per_second", "tokens/s", lambda v: f"{v:,.0f}"),
    ("tokens_per_second_per_gpu", "tokens/s/gpu", lambda v: f"{v:,.0f}"),
    ("tflops_per_gpu", "TFLOP/s/gpu", lambda v: f"{v:.1f}"),
    ("mfu", "mfu", lambda v: f"{v:.1%}"),
    ("step_time", "step_time", lambda v: f"{v:.3f}s"),
    ("step_time_min", "min", lambda v: f"{v:.3f}s"),
    ("slowest_rank", "slowest_rank", lambda v: f"{int(v)}"),
    ("memory/peak_reserved_gib", "peak_mem", lambda v: f"{v:.1f}GiB"),
    ("memory/utilization", "mem_util", lambda v: f"{v:.0%}"),
)
# Shown above, or only of interest in charts.
_SHOWN = {key for key, _, _ in _LINE} | {"tokens", "tokens_total", "steps", "tokens_per_second_ema", "mfu_ema",
                                        "step_time_ema", "correct_tokens", "total_tokens"}
_ALARMS = ("nonfinite_loss_steps", "nonfinite_grad_norm_steps", "loss_spike", "memory/ooms", "memory/alloc_retries")


class StdoutBackend(Backend):
    """``step 10 | loss 2.3456 | ... | mfu 41.2% | ...`` on ``stream`` (default stdout).

    Non-zero anomaly counts (non-finite values, a loss spike, OOMs, allocation
    retries) are appended in capitals so they stand out. With ``all_keys`` every
    other numeric key is appended too (metrics of the collection, ``eval/*``).
    """

    name = "stdout"

    def __init__(self, stream: Optional[TextIO] = None, all_keys: bool = True) -> None:
        self.stream = stream
        self.all_keys = all_keys

    def write(self, record: Mapping[str, float], step: int) -> None:
        parts = [f"step {step}"]
        parts += [f"{label} {fmt(record[key])}" for key, label, fmt in _LINE if key in record]
        if self.all_keys:
            parts += [f"{key} {_plain(value)}" for key, value in record.items()
                      if key not in _SHOWN and key not in _ALARMS and not key.startswith("memory/")]
        parts += [f"{key.upper()} {_plain(record[key])}" for key in _ALARMS if record.get(key)]
        print(" | ".join(parts), file=self.stream or sys.stdout, flush=True)


def _plain(value: float) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)
