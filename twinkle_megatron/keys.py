"""The names of the numbers the tracker logs: one name per quantity, grouped the way dashboards group them.

Quantities Twinkle already names keep Twinkle's name exactly (``loss``,
``grad_norm``, ``learning rate``), so a run that also uses Twinkle's
``LossMetric`` or ``TrainMetric`` logs each quantity once; the tracker's own
quantities are grouped under ``train/``, ``perf/`` and ``memory/`` (W&B,
SwanLab and TensorBoard show one section per prefix). Metric results join the
record with the keys their metric defines (``accuracy``, ``train/approx_kl``,
``rewards/margins``...), evaluation results under ``eval/``.

This module is the one place the names are spelled: the tracker, the stdout
line, the plots and ``twinkle-megatron summary`` import them from here, and the
README's key table is checked against :data:`TRACKER_KEYS` by the tests.
"""

from __future__ import annotations

# Twinkle's names (LossMetric, TrainMetric).
LOSS = "loss"
GRAD_NORM = "grad_norm"
LEARNING_RATE = "learning rate"

# train/: the optimisation itself.
LOSS_EMA = "train/loss_ema"
LOSS_SPIKE = "train/loss_spike"
NONFINITE_LOSS_STEPS = "train/nonfinite_loss_steps"
NONFINITE_GRAD_NORM_STEPS = "train/nonfinite_grad_norm_steps"
NUM_ZEROS_IN_GRAD = "train/num_zeros_in_grad"
CONSUMED_TOKENS = "train/consumed_tokens"

# perf/: speed.
STEP_TIME = "perf/step_time"
STEP_TIME_MIN = "perf/step_time_min"
STEP_TIME_EMA = "perf/step_time_ema"
SLOWEST_RANK = "perf/slowest_rank"
TOKENS_PER_SECOND = "perf/tokens_per_second"
TOKENS_PER_SECOND_EMA = "perf/tokens_per_second_ema"
TOKENS_PER_SECOND_PER_GPU = "perf/tokens_per_second_per_gpu"
TFLOPS_PER_GPU = "perf/tflops_per_gpu"
MFU = "perf/mfu"
MFU_EMA = "perf/mfu_ema"

# memory/: device memory, max over ranks.
MEMORY_PREFIX = "memory/"
MEMORY_ALLOCATED = "memory/allocated_gib"
MEMORY_PEAK_ALLOCATED = "memory/peak_allocated_gib"
MEMORY_RESERVED = "memory/reserved_gib"
MEMORY_PEAK_RESERVED = "memory/peak_reserved_gib"
MEMORY_TOTAL = "memory/total_gib"
MEMORY_UTILIZATION = "memory/utilization"
MEMORY_ALLOC_RETRIES = "memory/alloc_retries"
MEMORY_OOMS = "memory/ooms"

EVAL_PREFIX = "eval/"

# Reported by instrument()'s metrics (not the tracker's own), an alarm when present: hooks that failed in the
# interval, on any rank (that interval's metrics are incomplete).
METRIC_HOOK_FAILURES = "train/metric_hook_failures"

# The smoothed quantities and the key of each one's EMA.
EMA_OF = {LOSS: LOSS_EMA, TOKENS_PER_SECOND: TOKENS_PER_SECOND_EMA, MFU: MFU_EMA, STEP_TIME: STEP_TIME_EMA}

# Every key the tracker itself reports, with its meaning (the README's key table).
TRACKER_KEYS: tuple[tuple[str, str], ...] = (
    (LOSS, "Σ loss sums / Σ loss tokens over the interval and DP×CP (Twinkle's LossMetric name)"),
    (GRAD_NORM, "latest gradient norm, max over ranks"),
    (LEARNING_RATE, "latest learning rate of the first parameter group (Twinkle's TrainMetric name)"),
    (LOSS_EMA, "EMA of loss, an interval of n steps weighted as n steps"),
    (LOSS_SPIKE, "1 when loss > (1 + spike_threshold) · the EMA before it"),
    (NONFINITE_LOSS_STEPS, "steps of the interval with a non-finite loss on some rank (left out of loss)"),
    (NONFINITE_GRAD_NORM_STEPS, "steps of the interval with a non-finite gradient norm on some rank"),
    (NUM_ZEROS_IN_GRAD, "latest count of zeros in the gradients, max over ranks"),
    (CONSUMED_TOKENS, "real (loss-mask) tokens since step 1, summed over DP×CP; continues on resume"),
    (STEP_TIME, "seconds per step of the slowest rank over the interval"),
    (STEP_TIME_MIN, "seconds per step of the fastest rank"),
    (STEP_TIME_EMA, "EMA of step_time"),
    (SLOWEST_RANK, "global rank with the largest step time (lowest on ties)"),
    (TOKENS_PER_SECOND, "real tokens of the interval / its duration (all GPUs)"),
    (TOKENS_PER_SECOND_EMA, "EMA of tokens_per_second"),
    (TOKENS_PER_SECOND_PER_GPU, "tokens_per_second / GPUs"),
    (TFLOPS_PER_GPU, "model FLOPs (Megatron-LM's formula) / duration / GPUs / 1e12"),
    (MFU, "tflops_per_gpu / the device's dense peak (known devices only)"),
    (MFU_EMA, "EMA of mfu"),
    (MEMORY_ALLOCATED, "GiB allocated at the log step, max over ranks (GPUs only)"),
    (MEMORY_PEAK_ALLOCATED, "peak GiB allocated in the interval, max over ranks"),
    (MEMORY_RESERVED, "GiB reserved by the caching allocator, max over ranks"),
    (MEMORY_PEAK_RESERVED, "peak GiB reserved in the interval, max over ranks"),
    (MEMORY_TOTAL, "device capacity in GiB"),
    (MEMORY_UTILIZATION, "peak reserved / capacity"),
    (MEMORY_ALLOC_RETRIES, "allocator retries since the process started, max over ranks"),
    (MEMORY_OOMS, "out-of-memory errors since the process started, max over ranks"),
)

# Counters that must stay exact (TensorBoard stores float32: exact only up to 2**24).
EXACT_COUNTERS = (CONSUMED_TOKENS,)
