"""TrackerConfig: what a MetricsTracker measures and where it writes, typed and validated once."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence, Union

from ..logging import BACKENDS, Backend, check_backends
from .peak import PRECISIONS


@dataclass(frozen=True)
class TrackerConfig:
    """The settings of a :class:`~twinkle_megatron.MetricsTracker` (the runtime objects — metrics, a
    device mesh, a process group — are the tracker's own arguments). Invalid values raise
    ``ValueError`` at construction, naming the field."""

    log_interval: int = 10
    """Log at step 1, at every multiple of this, and the last step at ``close()``."""

    model_config: Any = None
    """A megatron-core ``TransformerConfig`` (or an object with its field names, or Megatron-LM's
    ``args``) for Megatron-LM's FLOPs formula; needs ``padded_vocab_size``."""

    padded_vocab_size: Optional[int] = None
    """The model's (padded) vocabulary size, for the output layer's FLOPs."""

    seq_length: Optional[int] = None
    """Sequence length; with ``global_batch_size`` fixes the FLOPs per step as Megatron-LM computes
    them (else pass ``seq_lengths`` per step for packed sequences)."""

    global_batch_size: Optional[int] = None
    """Sequences per step over all data-parallel ranks."""

    flops_per_step: Optional[float] = None
    """Global FLOPs of one step, instead of ``model_config``."""

    peak_tflops: Optional[float] = None
    """Dense peak TFLOP/s per GPU, overriding the exact-name device table (``tracker/peak.py``)."""

    precision: str = "auto"
    """``"bf16"``, ``"fp16"``, ``"fp8"`` or ``"auto"`` (FP8 when ``model_config.fp8`` is set or
    Transformer Engine's FP8 autocast is active at a step boundary): the peak MFU is against."""

    device_name: Optional[str] = None
    """The device to look the peak up for (default: the current CUDA device; none on CPU: no MFU)."""

    ema_alpha: float = 0.1
    """Per-step smoothing factor of the EMAs; an interval of n steps is blended in with the weight
    of n steps, ``1 − (1 − α)^n``, so α means the same for any ``log_interval``."""

    spike_threshold: float = 0.5
    """``train/loss_spike`` is 1 when loss > (1 + threshold) · the loss EMA before it."""

    backends: Sequence[Union[str, Backend]] = ("stdout", "jsonl")
    """Names (``stdout``, ``jsonl``, ``tensorboard``, ``wandb``, ``swanlab``, ``mlflow``) or
    :class:`~twinkle_megatron.logging.Backend` objects. A backend whose package is missing warns at
    the first log step and is disabled, and training goes on (unless ``strict_backends``)."""

    strict_backends: bool = False
    """Check at construction, on every rank, that each backend's package is installed
    (:func:`~twinkle_megatron.logging.check_backends`, found without importing it): an
    ``ImportError`` names the backend, the package and the pip extra before training starts."""

    log_dir: str = "logs"
    """Where file backends write (``metrics.jsonl``, ``tensorboard/``, run ids)."""

    writer_rank: int = 0
    """The global rank that writes (every rank gets the same record)."""
    incidents_dir: Optional[str] = None
    """Where ``incidents.jsonl`` goes (``tracker/incidents.py``); default: ``log_dir`` with the ``jsonl`` backend,
    else no file (the console line only)."""

    overflow_skips: bool = False
    """The gradients the per-layer norms read are scaled by an fp16 loss scale whose overflow makes the optimizer
    skip the step: non-finite per-layer norms with a finite loss flag no incident (``tracker/incidents.py``). Set
    where the optimizer's skip is not passed to ``end_step`` (Megatron's own loop, before ``optimizer.step()``)."""

    device_memory: bool = True
    """Read this rank's device memory at each log step (``memory/*``) and start the next interval's peaks there
    (``torch.cuda.reset_peak_memory_stats``). False inside a loop that reports the peaks itself (Megatron's own:
    resetting them would change its numbers)."""
    ignore_index: int = -100
    """Label value of padding, when tokens are counted from ``labels``."""

    loss_key: str = "lm loss"
    """The key of the main loss in Megatron-LM's loss report dicts."""

    run_config: Mapping[str, Any] = field(default_factory=dict)
    """The user's run configuration (hyperparameters...), logged once to every backend with the
    tracker's own (layout, model shape, batch, FLOPs, versions; see ``run_config.py``)."""

    def __post_init__(self) -> None:
        def refuse(name: str, value: Any, wanted: str) -> None:
            raise ValueError(f"TrackerConfig.{name} must be {wanted}, got {value!r}")

        if isinstance(self.log_interval, bool) or not isinstance(self.log_interval, int) or self.log_interval < 1:
            refuse("log_interval", self.log_interval, "an int of at least 1")
        if self.precision != "auto" and self.precision not in PRECISIONS:
            refuse("precision", self.precision, f"'auto' or one of {PRECISIONS}")
        if self.model_config is not None and self.padded_vocab_size is None:
            raise ValueError("TrackerConfig.model_config needs padded_vocab_size to count the output layer's FLOPs")
        if not 0.0 < self.ema_alpha <= 1.0:
            refuse("ema_alpha", self.ema_alpha, "in (0, 1]")
        if self.spike_threshold < 0:
            refuse("spike_threshold", self.spike_threshold, "non-negative")
        if isinstance(self.writer_rank, bool) or not isinstance(self.writer_rank, int) or self.writer_rank < 0:
            refuse("writer_rank", self.writer_rank, "a non-negative int")
        for name in ("padded_vocab_size", "seq_length", "global_batch_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                refuse(name, value, "a positive int or None")
        for backend in self.backends:
            if not isinstance(backend, Backend) and backend not in BACKENDS:
                refuse("backends", backend, f"one of {BACKENDS} or a Backend")
        if not isinstance(self.strict_backends, bool):
            refuse("strict_backends", self.strict_backends, "a bool")
        if self.strict_backends:
            check_backends(self.backends)
