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
docs/tracker.md's key table is checked against :data:`TRACKER_KEYS` by the tests.
"""

from __future__ import annotations

import re
from typing import Optional

# Twinkle's names (LossMetric, TrainMetric).
LOSS = "loss"
GRAD_NORM = "grad_norm"
LEARNING_RATE = "learning rate"

# train/: the optimisation itself.
LOSS_EMA = "train/loss_ema"
LOSS_SPIKE = "train/loss_spike"
NONFINITE_LOSS_STEPS = "train/nonfinite_loss_steps"
NONFINITE_GRAD_NORM_STEPS = "train/nonfinite_grad_norm_steps"
SKIPPED_STEPS = "train/skipped_steps"
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

# Counts the metrics report (their own keys), alarms when non-zero: non-finite values left out of the statistics
# (LossMetric's ``nonfinite_losses``: loss values or tokens; the logits metrics' ``nonfinite_tokens``) and input
# mistakes (labels outside the vocabulary, group ids outside group_names, ragged arrays that do not match their
# tokens).
NONFINITE_LOSSES = "nonfinite_losses"
NONFINITE_TOKENS = "nonfinite_tokens"
INVALID_LABELS = "invalid_labels"
INVALID_GROUP_IDS = "invalid_group_ids"
MISALIGNED_ARRAYS = "train/misaligned_arrays"

# The smoothed quantities and the key of each one's EMA.
EMA_OF = {LOSS: LOSS_EMA, TOKENS_PER_SECOND: TOKENS_PER_SECOND_EMA, MFU: MFU_EMA, STEP_TIME: STEP_TIME_EMA}

# Every key the tracker itself reports, with its meaning (the key table of docs/tracker.md).
TRACKER_KEYS: tuple[tuple[str, str], ...] = (
    (LOSS, "Σ loss sums / Σ loss tokens over the interval and DP×CP (Twinkle's LossMetric name)"),
    (GRAD_NORM, "latest gradient norm, max over ranks"),
    (LEARNING_RATE, "latest learning rate of the first parameter group (Twinkle's TrainMetric name)"),
    (LOSS_EMA, "EMA of loss, an interval of n steps weighted as n steps"),
    (LOSS_SPIKE, "1 when loss > (1 + spike_threshold) · the EMA before it"),
    (NONFINITE_LOSS_STEPS, "steps of the interval with a non-finite loss on some rank: given to end_step or "
                           "counted by a metric's nonfinite_losses (left out of loss; loss is NaN when no finite "
                           "one is left)"),
    (NONFINITE_GRAD_NORM_STEPS, "steps of the interval with a non-finite gradient norm on some rank"),
    (SKIPPED_STEPS, "steps of the interval whose optimizer step was skipped (update_successful=False)"),
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

# moe/: MoE routing health (twinkle_megatron.metric.language.moe_routing; formulas in its docstring). Aggregates
# over the MoE layers; per-layer keys (opt-in) are moe_layer_key(layer, stat).
MOE_PREFIX = "moe/"
MOE_LAYERS = "moe/layers"
MOE_TOKENS = "moe/tokens"
MOE_UTILIZATION_MIN = "moe/utilization_min"
MOE_UTILIZATION_CV = "moe/utilization_cv"
MOE_DEAD_EXPERT_FRACTION = "moe/dead_expert_fraction"
MOE_ROUTING_ENTROPY_NORM = "moe/routing_entropy_norm"
MOE_IMBALANCE_MEAN = "moe/imbalance_mean"
MOE_IMBALANCE_P50 = "moe/imbalance_p50"
MOE_IMBALANCE_P90 = "moe/imbalance_p90"
MOE_IMBALANCE_MAX = "moe/imbalance_max"
MOE_IMBALANCE_WORST_LAYER = "moe/imbalance_worst_layer"
MOE_NONFINITE_ROUTER_TOKENS = "moe/nonfinite_router_tokens"


MOE_LAYER_PREFIX = "moe/layer_"


def moe_layer_key(layer: int, stat: str) -> str:
    """``moe/layer_{layer}/{stat}``: ``layer`` is the 0-based global layer index (Megatron's ``layer_number − 1``,
    the index Megatron-LM's own per-layer keys ``moe/{loss}_layer_{i}`` use)."""
    return f"{MOE_LAYER_PREFIX}{layer}/{stat}"


# Every moe/ key with its meaning (the key table of docs/moe.md). n_e: tokens routed to expert e in the interval,
# T: tokens the layer's router saw (padding excluded), k: experts per token, E: experts, b = T·k/E.
MOE_KEYS: tuple[tuple[str, str], ...] = (
    (MOE_LAYERS, "MoE layers that routed tokens in the interval"),
    (MOE_TOKENS, "tokens routed per MoE layer (mean over layers), summed over DP×CP×EP, each TP group once"),
    (MOE_UTILIZATION_MIN, "lowest utilisation u_e = n_e / b of any expert of any layer (0: a dead expert)"),
    (MOE_UTILIZATION_CV, "mean over layers of std_e(n_e) / mean_e(n_e) (population std)"),
    (MOE_DEAD_EXPERT_FRACTION, "mean over layers of the share of experts with n_e = 0"),
    (MOE_ROUTING_ENTROPY_NORM, "mean over layers of exp(mean_t H(softmax(router logits_t))) / E, in [1/E, 1]"),
    (MOE_IMBALANCE_MEAN, "mean over layers of the imbalance max_e n_e / b (the layer's overload factor)"),
    (MOE_IMBALANCE_P50, "median over layers of the imbalance (linear interpolation)"),
    (MOE_IMBALANCE_P90, "90th percentile over layers of the imbalance (linear interpolation)"),
    (MOE_IMBALANCE_MAX, "largest imbalance: the capacity factor at which no token would have been dropped"),
    (MOE_IMBALANCE_WORST_LAYER, "0-based index of the layer with the largest imbalance (lowest on ties)"),
    (MOE_PREFIX + "load_balancing_loss", "Megatron's aux loss (coefficient removed): summed over its TP×CP "
                                         "group, mean over microbatches, DP and layers (when computed)"),
    (MOE_PREFIX + "seq_load_balancing_loss", "the same for Megatron's sequence-level aux loss"),
    (MOE_PREFIX + "global_load_balancing_loss", "the same for Megatron's global aux loss (summed over TP×DP×CP)"),
    (MOE_PREFIX + "z_loss", "Megatron's router z-loss: mean of logsumexp(logits_t)² over all tokens of all ranks, "
                            "mean over layers (when computed)"),
    (MOE_NONFINITE_ROUTER_TOKENS, "(token, layer) pairs with non-finite router logits, left out of the entropy "
                                  "(present when > 0)"),
)

# The per-layer statistics (with per_layer=True): moe_layer_key(i, stat) for each, and expert_{e}_utilization.
MOE_LAYER_STATS: tuple[tuple[str, str], ...] = (
    ("utilization_min", "min_e n_e / b"),
    ("utilization_max", "max_e n_e / b: the layer's imbalance (overload factor)"),
    ("utilization_cv", "std_e(n_e) / mean_e(n_e)"),
    ("dead_expert_fraction", "share of experts with n_e = 0"),
    ("routing_entropy_norm", "exp(mean_t H(softmax(router logits_t))) / E"),
    ("expert_{e}_utilization", "n_e / b of expert e (the heat map's cells)"),
    ("load_balancing_loss, seq_load_balancing_loss, global_load_balancing_loss, z_loss",
     "the layer's value of each of Megatron's router losses it computed"),
)


# grad_norm/, param_norm/: per-layer norms (opt-in: MetricsTracker.record_grad_norms; tracker/layer_norms.py).
# Parts: layer_NN (global 0-based layer), embedding, output_layer, final_norm, other.
GRAD_NORM_PREFIX = "grad_norm/"
PARAM_NORM_PREFIX = "param_norm/"
GRAD_NORM_TOTAL = "grad_norm/total"
GRAD_NORM_LAYER_MAX = "grad_norm/max_layer_norm"
GRAD_NORM_LAYER_MAX_INDEX = "grad_norm/max_layer"
GRAD_NORM_LAYER_MAX_OVER_MEDIAN = "grad_norm/max_layer_over_median"
# The per-part keys (for files and charts; the stdout line shows the compact view and the total only).
LAYER_NORM_DETAIL_PREFIXES = (GRAD_NORM_PREFIX + "layer_", GRAD_NORM_PREFIX + "embedding",
                              GRAD_NORM_PREFIX + "output_layer", GRAD_NORM_PREFIX + "final_norm",
                              GRAD_NORM_PREFIX + "other", PARAM_NORM_PREFIX)


_LAYER_PART = re.compile(r"layer_(\d+)")


def layer_part(layer: int, num_layers: int) -> str:
    """``layer_07``: the part name of global 0-based ``layer`` in a model of ``num_layers`` layers (zero-padded to
    two digits, more past 100 layers, so the names sort in layer order)."""
    width = max(2, len(str(max(num_layers - 1, 0))))
    return f"layer_{layer:0{width}d}"


def parse_layer_part(part: str) -> Optional[int]:
    """The layer of a part name made by :func:`layer_part` (``layer_07`` -> 7); None for any other part
    (``embedding``, ``total``, ``max_layer``)."""
    match = _LAYER_PART.fullmatch(part)
    return int(match.group(1)) if match else None


def layer_grad_norm_key(part: str) -> str:
    """``grad_norm/{part}``: ``part`` is ``layer_07`` (global 0-based layer), ``embedding``, ``output_layer``..."""
    return GRAD_NORM_PREFIX + part


def layer_param_norm_key(part: str) -> str:
    """``param_norm/{part}``, as :func:`layer_grad_norm_key`."""
    return PARAM_NORM_PREFIX + part


# Position buckets (``position_buckets=``, metric/state/positions.py): each key of a token-level metric is also reported
# per bucket of token positions, ``key/pos_<first>-<last>`` (``loss/pos_0-511``).
_POSITION_BUCKET = re.compile(r"pos_(\d+)-(\d+)")


def position_bucket_key(first: int, end: int) -> str:
    """``pos_{first}-{end - 1}``: the name of the bucket of positions ``first <= p < end`` (the last position is
    inclusive in the name), the last part of its keys (``loss/pos_0-511``)."""
    return f"pos_{first}-{end - 1}"


def parse_position_bucket_key(name: str) -> Optional[tuple[int, int]]:
    """``(first, end)`` of a bucket name made by :func:`position_bucket_key` (``pos_0-511`` -> ``(0, 512)``);
    None for any other name (a dataset's ``web``, ``pos_sim``)."""
    match = _POSITION_BUCKET.fullmatch(name)
    return (int(match.group(1)), int(match.group(2)) + 1) if match else None
