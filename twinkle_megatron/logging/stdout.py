"""One readable line per log step: compact by default, every numeric key on request."""

from __future__ import annotations

import math
import sys
from typing import Callable, Mapping, Optional, Sequence, TextIO

from .. import keys
from .base import Backend

# The fewest significant digits a number is printed with: a fixed format that would round a small
# value to fewer (``TFLOP/s/gpu 0.0`` on a CPU) switches to significant digits (``0.00312``).
SIGNIFICANT = 3


def significant(value: float, decimals: int, grouping: bool = False) -> str:
    """``value`` with ``decimals`` decimals, or more where that would show fewer than 3 significant digits.

    ``significant(2.34567, 4) == '2.3457'``, ``significant(0.0031234, 1) == '0.00312'``,
    ``significant(3.2e-9, 2) == '3.20e-09'``; zero is ``'0'`` and NaN/inf print as Python does.
    """
    if value == 0 or not math.isfinite(value):
        return "0" if value == 0 else str(value)
    magnitude = math.floor(math.log10(abs(value)))  # 0 for 1.x, -3 for 0.00x
    shown = magnitude + 1 + decimals
    if shown < SIGNIFICANT:
        decimals = SIGNIFICANT - 1 - magnitude
        if decimals > 8:
            return f"{value:.{SIGNIFICANT - 1}e}"
    return f"{value:,.{decimals}f}" if grouping else f"{value:.{decimals}f}"


def _fixed(decimals: int, suffix: str = "", grouping: bool = False) -> Callable[[float], str]:
    return lambda v: significant(v, decimals, grouping) + suffix


def _percent(v: float) -> str:
    return significant(100 * v, 1) + "%"


def _integer(v: float) -> str:
    return f"{int(v)}" if math.isfinite(v) else str(v)


# (key, label, format): the tracker's keys in reading order; other numeric keys follow as "key value".
_LINE: tuple[tuple[str, str, Callable[[float], str]], ...] = (
    (keys.LOSS, "loss", _fixed(4)),
    (keys.LOSS_EMA, "loss_ema", _fixed(4)),
    (keys.GRAD_NORM, "grad_norm", _fixed(3)),
    (keys.GRAD_NORM_TOTAL, "grad_norm/total", _fixed(3)),
    (keys.GRAD_NORM_LAYER_MAX_INDEX, "max_layer", _integer),
    (keys.GRAD_NORM_LAYER_MAX, "max_layer_norm", _fixed(3)),
    (keys.GRAD_NORM_LAYER_MAX_OVER_MEDIAN, "max_layer/median", _fixed(2, "x")),
    (keys.LEARNING_RATE, "lr", lambda v: f"{v:.2e}"),
    ("accuracy", "accuracy", _fixed(4)),
    ("logprob", "logprob", _fixed(4)),
    ("entropy", "entropy", _fixed(4)),
    (keys.TOKENS_PER_SECOND, "tokens/s", _fixed(0, grouping=True)),
    (keys.TOKENS_PER_SECOND_EMA, "tokens/s_ema", _fixed(0, grouping=True)),
    (keys.TOKENS_PER_SECOND_PER_GPU, "tokens/s/gpu", _fixed(0, grouping=True)),
    (keys.TFLOPS_PER_GPU, "TFLOP/s/gpu", _fixed(1)),
    (keys.MFU, "mfu", _percent),
    (keys.MFU_EMA, "mfu_ema", _percent),
    (keys.STEP_TIME, "step_time", _fixed(3, "s")),
    (keys.STEP_TIME_MIN, "min", _fixed(3, "s")),
    (keys.STEP_TIME_EMA, "step_time_ema", _fixed(3, "s")),
    (keys.SLOWEST_RANK, "slowest_rank", _integer),
    (keys.CONSUMED_TOKENS, "consumed_tokens", _fixed(0, grouping=True)),
    (keys.NUM_ZEROS_IN_GRAD, "zeros_in_grad", _integer),
    (keys.MEMORY_ALLOCATED, "mem_alloc", _fixed(1, "GiB")),
    (keys.MEMORY_PEAK_ALLOCATED, "peak_mem_alloc", _fixed(1, "GiB")),
    (keys.MEMORY_RESERVED, "mem_reserved", _fixed(1, "GiB")),
    (keys.MEMORY_PEAK_RESERVED, "peak_mem", _fixed(1, "GiB")),
    (keys.MEMORY_TOTAL, "mem_total", _fixed(1, "GiB")),
    (keys.MEMORY_UTILIZATION, "mem_util", lambda v: f"{v:.0%}"),
)
# The compact line: what a glance at a console needs (the record has the rest).
# The headline keys, each shown when the record has it (the per-layer norms' total and largest layer only with
# record_grad_norms, MoE routing's imbalance only for MoE models).
COMPACT_KEYS = (keys.LOSS, "accuracy", keys.GRAD_NORM, keys.GRAD_NORM_TOTAL, keys.GRAD_NORM_LAYER_MAX_INDEX,
                keys.GRAD_NORM_LAYER_MAX_OVER_MEDIAN, keys.LEARNING_RATE, keys.TOKENS_PER_SECOND_PER_GPU,
                keys.TFLOPS_PER_GPU, keys.MFU, keys.STEP_TIME, keys.MEMORY_PEAK_RESERVED, keys.MOE_IMBALANCE_MAX)
DETAILS = ("compact", "full")
_FORMAT_OF = {key: fmt for key, _, fmt in _LINE}
_COMPACT_OFF_LINE = tuple(key for key in COMPACT_KEYS if key not in _FORMAT_OF)  # headline keys the tracker's
# line does not format (moe/imbalance_max, a metric's): printed after it, like the extra keys
# Non-zero counts appended in capitals: divergence (steps, then the values and tokens behind them), skipped
# optimizer steps, memory trouble, failed hooks and counted input mistakes.
_ALARMS = (keys.NONFINITE_LOSS_STEPS, keys.NONFINITE_LOSSES, keys.NONFINITE_TOKENS, keys.NONFINITE_GRAD_NORM_STEPS,
           keys.SKIPPED_STEPS, keys.LOSS_SPIKE, keys.MEMORY_OOMS, keys.MEMORY_ALLOC_RETRIES, keys.METRIC_HOOK_FAILURES,
           keys.INVALID_LABELS, keys.INVALID_GROUP_IDS, keys.MISALIGNED_ARRAYS)
# Keys that grow with the model (layers, layers × experts): for the files and the charts, never on the line.
PER_LAYER_PREFIXES = (keys.MOE_LAYER_PREFIX, *keys.LAYER_NORM_DETAIL_PREFIXES)
# The token counts behind Accuracy's ratio (and their per-dataset, per-position and eval twins): the accuracy on
# the line says what they say; the record keeps them.
TOKEN_COUNTS = ("correct_tokens", "total_tokens")


class StdoutBackend(Backend):
    """``step 10 | loss 2.3456 | accuracy 0.5698 | ... | step_time 0.748s`` on ``stream`` (default stdout).

    ``detail="compact"`` (the default) prints the headline keys (:data:`COMPACT_KEYS`: loss,
    accuracy, gradient norm, with per-layer norms their total and the layer with the largest norm
    against the median layer, learning rate, tokens/s per GPU, TFLOP/s per GPU, MFU, step time, peak
    memory, and for MoE models the largest expert-load imbalance), then the ``extra_keys`` the record
    holds (``accuracy/<dataset>``...), then every evaluation value (``eval/*``, from ``log_eval``).
    ``detail="full"`` prints every numeric key of the record: the tracker's keys in the order of
    the line, then the others (metrics of the collection, per-dataset keys, ``eval/*``) in the
    record's order, except the keys that grow with the model (:data:`PER_LAYER_PREFIXES`:
    ``moe/layer_*``, ``grad_norm/<part>``, ``param_norm/*``; their total and largest layer are
    shown) and the token counts behind the accuracy (:data:`TOKEN_COUNTS`, with their
    ``/<dataset>`` and ``eval/`` twins). Either way the anomaly counts are appended in capitals
    when non-zero (non-finite values, a loss spike, skipped steps, OOMs, allocation retries, hook
    failures, input mistakes) so they stand out, a key is printed in the format of the key it
    refines (``accuracy/easy`` and ``eval/accuracy`` like ``accuracy``), and numbers keep at
    least 3 significant digits. The JSONL backend keeps the full record whatever this line shows.
    """

    name = "stdout"

    def __init__(self, stream: Optional[TextIO] = None, detail: str = "compact",
                 extra_keys: Sequence[str] = ()) -> None:
        if detail not in DETAILS:
            raise ValueError(f"StdoutBackend(detail=...) must be one of {DETAILS}, got {detail!r}")
        if isinstance(extra_keys, str):
            raise TypeError(f"StdoutBackend(extra_keys=...) takes a sequence of keys, got the string {extra_keys!r}")
        self.stream = stream
        self.detail = detail
        self.extra_keys = tuple(extra_keys)

    def write(self, record: Mapping[str, float], step: int) -> None:
        print(self.line(record, step), file=self.stream or sys.stdout, flush=True)

    def line(self, record: Mapping[str, float], step: int) -> str:
        """The text :meth:`write` prints for ``record`` at ``step``."""
        parts = [f"step {step}"]
        if self.detail == "compact":
            parts += [f"{label} {fmt(record[key])}" for key, label, fmt in _LINE
                      if key in COMPACT_KEYS and key in record]
            later = [*_COMPACT_OFF_LINE, *self.extra_keys]
            later += [key for key in record if key.startswith(keys.EVAL_PREFIX) and key not in later
                      and _refined(key) not in TOKEN_COUNTS]
            parts += [f"{key} {_format(key, record[key])}" for key in later if key in record]
        else:
            parts += [f"{label} {fmt(record[key])}" for key, label, fmt in _LINE if key in record]
            parts += [f"{key} {_format(key, value)}" for key, value in record.items()
                      if key not in _FORMAT_OF and key not in _ALARMS and not key.startswith(PER_LAYER_PREFIXES)
                      and _refined(key) not in TOKEN_COUNTS]
        parts += [f"{_alarm(key)} {_plain(record[key])}" for key in _ALARMS if record.get(key)]
        return " | ".join(parts)


def _refined(key: str) -> str:
    """The key ``key`` refines, whose format it takes: ``accuracy/easy`` → ``accuracy``, ``eval/loss`` →
    ``loss``, ``eval/accuracy/easy`` → ``accuracy``; a key without ``/`` is its own."""
    if key.startswith(keys.EVAL_PREFIX):
        key = key[len(keys.EVAL_PREFIX):]
        if key in _FORMAT_OF:
            return key
    return key.rsplit("/", 1)[0]


def _format(key: str, value: float) -> str:
    fmt = _FORMAT_OF.get(_refined(key))
    return fmt(value) if fmt is not None and isinstance(value, float) else _plain(value)


def _plain(value: float) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def _alarm(key: str) -> str:
    """``train/loss_spike`` → ``LOSS_SPIKE``: the quantity, in capitals so it stands out."""
    return key.rsplit("/", 1)[-1].upper()
