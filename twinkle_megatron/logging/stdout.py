"""One readable line per log step."""

from __future__ import annotations

import sys
from typing import Callable, Mapping, Optional, TextIO

from .. import keys
from .base import Backend

# (key, label, format): the tracker's keys in reading order; other numeric keys follow as "key value".
_LINE: tuple[tuple[str, str, Callable[[float], str]], ...] = (
    (keys.LOSS, "loss", lambda v: f"{v:.4f}"),
    (keys.LOSS_EMA, "loss_ema", lambda v: f"{v:.4f}"),
    (keys.GRAD_NORM, "grad_norm", lambda v: f"{v:.3f}"),
    (keys.LEARNING_RATE, "lr", lambda v: f"{v:.2e}"),
    ("accuracy", "accuracy", lambda v: f"{v:.4f}"),
    ("logprob", "logprob", lambda v: f"{v:.4f}"),
    ("entropy", "entropy", lambda v: f"{v:.4f}"),
    (keys.TOKENS_PER_SECOND, "tokens/s", lambda v: f"{v:,.0f}"),
    (keys.TOKENS_PER_SECOND_PER_GPU, "tokens/s/gpu", lambda v: f"{v:,.0f}"),
    (keys.TFLOPS_PER_GPU, "TFLOP/s/gpu", lambda v: f"{v:.1f}"),
    (keys.MFU, "mfu", lambda v: f"{v:.1%}"),
    (keys.STEP_TIME, "step_time", lambda v: f"{v:.3f}s"),
    (keys.STEP_TIME_MIN, "min", lambda v: f"{v:.3f}s"),
    (keys.SLOWEST_RANK, "slowest_rank", lambda v: f"{int(v)}"),
    (keys.MEMORY_PEAK_RESERVED, "peak_mem", lambda v: f"{v:.1f}GiB"),
    (keys.MEMORY_UTILIZATION, "mem_util", lambda v: f"{v:.0%}"),
)
# Shown above, or only of interest in charts.
_COUNTS = {"correct_tokens", "total_tokens"}
_SHOWN = {key for key, _, _ in _LINE} | _COUNTS | {keys.CONSUMED_TOKENS, keys.TOKENS_PER_SECOND_EMA,
                                                  keys.MFU_EMA, keys.STEP_TIME_EMA}
# A per-dataset key ``accuracy/<dataset>`` is printed like ``accuracy`` (and hidden like
# ``correct_tokens``), so the line reads the same with and without ``group_names``.
_FORMAT_OF = {key: fmt for key, _, fmt in _LINE}
_ALARMS = (keys.NONFINITE_LOSS_STEPS, keys.NONFINITE_GRAD_NORM_STEPS, keys.LOSS_SPIKE, keys.MEMORY_OOMS,
           keys.MEMORY_ALLOC_RETRIES, keys.METRIC_HOOK_FAILURES)


_LEFT_OUT = (keys.MEMORY_PREFIX, keys.MOE_LAYER_PREFIX, *keys.LAYER_NORM_DETAIL_PREFIXES)  # for files and charts


class StdoutBackend(Backend):
    """``step 10 | loss 2.3456 | ... | mfu 41.2% | ...`` on ``stream`` (default stdout).

    Non-zero anomaly counts (non-finite values, a loss spike, OOMs, allocation
    retries) are appended in capitals so they stand out. With ``all_keys`` every
    other numeric key is appended too (metrics of the collection, ``eval/*``), except
    per-layer MoE keys (``moe/layer_*``: layers × experts, for files and charts) and per-layer norms
    (``grad_norm/layer_*``, ``param_norm/*``: their compact view is shown).
    """

    name = "stdout"

    def __init__(self, stream: Optional[TextIO] = None, all_keys: bool = True) -> None:
        self.stream = stream
        self.all_keys = all_keys

    def write(self, record: Mapping[str, float], step: int) -> None:
        parts = [f"step {step}"]
        parts += [f"{label} {fmt(record[key])}" for key, label, fmt in _LINE if key in record]
        if self.all_keys:
            parts += [f"{key} {_format(key, value)}" for key, value in record.items()
                      if key not in _SHOWN and _base(key) not in _COUNTS and key not in _ALARMS
                      and not key.startswith(_LEFT_OUT)]
        parts += [f"{_alarm(key)} {_plain(record[key])}" for key in _ALARMS if record.get(key)]
        print(" | ".join(parts), file=self.stream or sys.stdout, flush=True)


def _base(key: str) -> str:
    """``accuracy/easy`` → ``accuracy``; a key without ``/`` is its own base."""
    return key.rsplit("/", 1)[0]


def _format(key: str, value: float) -> str:
    fmt = _FORMAT_OF.get(_base(key))
    return fmt(value) if fmt is not None and isinstance(value, float) else _plain(value)


def _plain(value: float) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def _alarm(key: str) -> str:
    """``train/loss_spike`` → ``LOSS_SPIKE``: the quantity, in capitals so it stands out."""
    return key.rsplit("/", 1)[-1].upper()
