"""MetricsTracker: step time, real-token throughput, FLOPs and MFU, memory, smoothing, anomalies.

Per step (``end_step``) the tracker only records device values into its own
metrics (no host sync, no collective). At a log step (step 1, every
``log_interval`` steps, and the last step at ``close()``) it reduces them
together with the user's metrics in ONE sync (``metric/state/sync.py``: one MAX and
one SUM all-reduce in total). Each part of the record (keys in
``twinkle_megatron.keys``) is returned by the ``compute`` of the object that
owns its states: :class:`~.step_states.StepLoss` (the loss),
:class:`~.step_states.RankStates` (grad norm, learning rate, non-finite steps,
memory), :class:`~.throughput.Throughput` (step time, tokens/s, FLOPs, MFU,
consumed tokens), :class:`~.layer_norms.LayerNorms` (per-layer norms, opt-in),
the user's metrics, then :class:`~.smoothing.RecordSmoothing` (EMAs and the
loss spike, from the merged record). The record goes to the logging backends
on one rank; every rank gets the same record back.

The first step the tracker sees (``load_state_dict``'s step + 1, else the
first ``end_step``) is the run's first step: every backend drops or supersedes
what it holds from that step on, whether or not a checkpoint was loaded, so a
restarted job never logs a step twice.

Typical use with Megatron-LM::

    tracker = MetricsTracker(config=TrackerConfig(log_interval=10, model_config=config,
                                                  padded_vocab_size=args.padded_vocab_size, seq_length=args.seq_length,
                                                  global_batch_size=args.global_batch_size, log_dir=args.save),
                             metrics=collection)
    for iteration in range(start, end):
        with tracker.step(iteration + 1) as step:
            losses_reduced = forward_backward_func(...)  # one {'lm loss': [sum, count]} per microbatch
            tracker.record_grad_norms(model_chunks, optimizer)  # opt-in: per-layer norms (docs/step-health.md)
            update_successful, grad_norm, num_zeros = optimizer.step()
            step.update(loss=losses_reduced, grad_norm=grad_norm, num_zeros=num_zeros,
                        lr=optimizer.param_groups[0]["lr"], update_successful=update_successful)
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from typing import Any, Iterable, Iterator, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist

from .. import keys
from ..logging import MetricsLogger, build_backend
from ..metric import Metric, MetricCollection, SampleLosses, calculate_each, calculate_metrics, merge_results
from ..parallel import ParallelContext
from .config import TrackerConfig
from .flops import flops_coefficients, num_floating_point_operations
from .incidents import IncidentReporter
from .layer_norms import LayerNorms
from .layer_parameters import LayerParameters
from .loss_reports import accumulate_loss_values, loss_values
from .memory import reset_peak_memory
from .peak import current_device_name, fp8_autocast_active, peak_tflops
from .run_config import build_run_config
from .smoothing import RecordSmoothing
from .step_states import NonfiniteLossCounts, RankStates, StepLoss, any_flag, skipped_flag
from .throughput import Throughput
from .timer import StepTimer

LossInput = Union[torch.Tensor, float, Mapping[str, Any], Sequence[Any]]


class MetricsTracker:
    """Training-step metrics for Megatron (or any) training loops, synced with the metric collection.

    The way in: ``MetricsTracker(config=TrackerConfig(...), metrics=..., device_mesh=..., process_group=...)``,
    every setting in the :class:`TrackerConfig` (documented and validated there),
    the runtime objects as the tracker's own arguments::

        MetricsTracker(config=TrackerConfig(log_interval=10, backends=("stdout", "wandb")), metrics=collection)

    Args:
        config: the settings (:class:`TrackerConfig`; default: ``TrackerConfig()``).
        metrics: a :class:`MetricCollection` or metrics whose results join each
            log record, reduced in the same sync (their keys must not clash
            with the tracker's).
        device_mesh, process_group: the parallel layout, as for every metric
            (default: megatron-core's parallel_state, else the world).
        **settings: a thin convenience: :class:`TrackerConfig` fields as keywords
            (``MetricsTracker(log_interval=10)``), overriding ``config``'s.
    """

    def __init__(self, config: Optional[TrackerConfig] = None, *,
                 metrics: Union[MetricCollection, Iterable[Metric], None] = None, device_mesh: Any = None,
                 process_group: Any = None, **settings: Any) -> None:
        config = dataclasses.replace(config, **settings) if config is not None else TrackerConfig(**settings)
        self.config = config
        self.log_interval = config.log_interval
        self.user_metrics: list[Metric] = _metric_list(metrics)
        self.device_mesh, self.process_group = device_mesh, process_group
        model_config, padded_vocab_size = config.model_config, config.padded_vocab_size
        self._coefficients = flops_coefficients(model_config, padded_vocab_size) if model_config is not None else None
        flops_per_step = config.flops_per_step
        if flops_per_step is None and model_config is not None and config.seq_length and config.global_batch_size:
            flops_per_step = num_floating_point_operations(model_config, config.global_batch_size,
                                                           config.seq_length, padded_vocab_size)
        self.flops_per_step = flops_per_step
        self._fp8_seen = bool(getattr(model_config, "fp8", None))
        self.device_name = config.device_name if config.device_name is not None else current_device_name()
        self.smoothing = RecordSmoothing(config.ema_alpha, config.spike_threshold)
        self.logger = MetricsLogger([build_backend(b, config.log_dir) for b in config.backends],
                                    writer_rank=config.writer_rank, log_dir=config.log_dir)
        self.timer = StepTimer()
        self.last_step = 0
        self.consumed_tokens = 0
        self.last_record: dict[str, float] = {}
        self.last_incident: Optional[dict[str, Any]] = None  # of the last flagged log step (tracker/incidents.py)
        self._pending_steps = 0  # steps ended since the last log (host count: every rank ends every step)
        self._started = False  # the run's first step is known (and given to the logger)
        self._closed = False
        self._own: Optional[tuple[StepLoss, RankStates, Throughput]] = None  # the tracker's metrics (_states)
        self._warned: set[str] = set()
        self._layer_norms: Optional[LayerNorms] = None  # opt-in: record_grad_norms
        self._samples = next((m for m in self.user_metrics if isinstance(m, SampleLosses)), None)
        self._metric_losses = NonfiniteLossCounts(self.user_metrics)  # a LossMetric's non-finite losses, per step
        incidents_dir = config.incidents_dir or (config.log_dir if "jsonl" in config.backends else None)
        self.incidents = IncidentReporter(self._samples, incidents_dir, config.writer_rank, config.overflow_skips)
        if dist.is_available() and dist.is_initialized():
            self._states()  # resolve the layout now, while every rank builds its tracker together

    # ------------------------------------------------------------ per step

    def start_step(self) -> None:
        """Mark the start of a step (optional: without it a step starts where the previous one ended)."""
        self._note_precision()
        self.timer.start()

    def end_step(self, step: Optional[int] = None, loss: Optional[LossInput] = None, grad_norm: Any = None,
                 lr: Any = None, tokens: Any = None, loss_mask: Optional[torch.Tensor] = None,
                 labels: Optional[torch.Tensor] = None, num_zeros: Any = None,
                 seq_lengths: Union[torch.Tensor, Sequence[int], None] = None,
                 update_successful: Any = None) -> Optional[dict[str, float]]:
        """End a step; on a log step, sync and log, and return the record (the same on every rank).

        Collective on log steps only: every rank must call it for every step.
        Never syncs with the host on other steps: tensors stay on the device.

        Args:
            step: the step number (default: the previous one + 1).
            loss: this rank's loss. A Megatron-LM loss report ``{'lm loss': [sum, count]}``,
                a list of them (one per microbatch, as ``forward_backward_func``
                returns them), a ``[sum, count]`` tensor, or a scalar mean (a tensor
                or a number; means are averaged with equal weight over DP×CP).
                Only the last pipeline stage's TP rank 0 counts; other ranks may
                pass it or not.
            grad_norm, lr, num_zeros: the step's gradient norm, learning rate (a
                number or one per parameter group: the first is logged) and zeros in
                the gradients; the latest values are logged, max over ranks.
            tokens: this rank's real tokens; else counted from ``loss_mask``
                (non-zero entries), else from ``labels`` (``!= ignore_index``), else
                the counts of ``[sum, count]`` loss reports. Local tokens: summed
                over DP×CP (under CP, each rank passes its chunk).
            seq_lengths: lengths of the whole sequences packed into this rank's
                batch (a tensor or a list), for FLOPs with ``model_config``.
            update_successful: the first value ``optimizer.step()`` returns; False
                (Megatron skipped the step: an inf/NaN gradient under fp16/bf16 loss
                scaling, which also returns ``grad_norm=None``) counts the step in
                ``train/skipped_steps``. None: not known (not counted).

        A step is a non-finite-loss step (``train/nonfinite_loss_steps``) when ``loss``
        holds a non-finite value or when a metric among the tracker's that counts
        non-finite losses (a :class:`~twinkle_megatron.LossMetric`'s ``nonfinite_losses``)
        counted one since the previous step ended: device ops, no host sync.
        """
        self._note_precision()
        self.timer.stop()
        self.last_step = step = self.last_step + 1 if step is None else int(step)
        self._start(step)
        self._pending_steps += 1
        step_loss, ranks, throughput = self._states()
        nonfinite_loss: Any = 0.0
        loss_tokens = None
        if loss is not None:
            nonfinite_loss, loss_tokens = accumulate_loss_values(step_loss, loss_values(loss, self.config.loss_key))
        local_tokens = _real_tokens(tokens, loss_mask, labels, self.config.ignore_index)
        throughput.add_step(local_tokens if local_tokens is not None else loss_tokens)
        if seq_lengths is not None:
            if self._coefficients is None:
                self._warn_once("seq_lengths", "seq_lengths given without model_config: no FLOPs can be counted")
            else:
                throughput.add_sequence_lengths(seq_lengths)
        if isinstance(lr, (list, tuple)):
            lr = lr[0]
        nonfinite_loss = any_flag([nonfinite_loss, *self._metric_losses.step_flags()])
        ranks.add_step(nonfinite_loss, grad_norm, lr, num_zeros, skipped_flag(update_successful))
        if self._samples is not None:
            self._samples.end_step(step)
        if step == 1 or step % self.log_interval == 0:
            return self._log(step)
        return None

    def record_grad_norms(self, model_chunks: Any, optimizer: Any = None) -> None:
        """Record per-layer gradient and parameter norms of this step (opt-in; ``tracker/layer_norms.py``).

        Call it on every rank after the gradient reduction (``forward_backward_func``
        returns after ``finalize_model_grads``) and before ``optimizer.step()`` (which
        clips the gradients in place), with the model chunks and Megatron's optimizer
        (needed with the distributed optimizer). Device work only; the norms join the
        tracker's one sync, and the latest recorded step of each interval is logged.
        """
        if self._layer_norms is None:
            self._layer_norms = LayerNorms(LayerParameters(model_chunks, optimizer), optimizer, self.device_mesh,
                                           self.process_group)
        self._layer_norms.record()

    @contextlib.contextmanager
    def step(self, step: Optional[int] = None) -> Iterator[dict[str, Any]]:
        """``with tracker.step(n) as values: ...; values.update(loss=..., grad_norm=...)``.

        Starts the step on entry and ends it on a normal exit with the keywords
        put in ``values`` (those of :meth:`end_step`); the record of a log step
        is then in :attr:`last_record`. An exception leaves the step unended.
        """
        self.start_step()
        values: dict[str, Any] = {}
        yield values
        self.end_step(step, **values)

    # ------------------------------------------------------------ logging

    def _log(self, step: int) -> dict[str, float]:
        steps, self._pending_steps = self._pending_steps, 0
        own = self._states()
        health = [self._layer_norms] if self._layer_norms is not None else []
        pieces = calculate_each([*self.user_metrics, *health, *own])  # the one sync; each metric's own results
        self._metric_losses.reset()  # the synced metrics were reset: their counts start again at 0
        if self.config.device_memory:
            reset_peak_memory()
        tracker_part = merge_results((type(m).__name__, r) for m, r in pieces if any(m is o for o in own))
        metrics_part = merge_results((type(m).__name__, r) for m, r in pieces if not any(m is o for o in own))
        if keys.LOSS in tracker_part and keys.LOSS in metrics_part and tracker_part.get(keys.NONFINITE_LOSS_STEPS):
            # A non-finite microbatch report: end_step's loss left that whole microbatch out, a loss metric fed
            # per-token losses kept its healthy samples (their finite microbatches agree). The finer one is the
            # record's, not a clash.
            del tracker_part[keys.LOSS]
        # A value given to end_step and to a metric too must agree, or one would hide the other.
        record = merge_results([("MetricsTracker (end_step's values)", tracker_part),
                                ("the tracker's metrics", metrics_part)])
        if keys.LOSS not in record and record.get(keys.NONFINITE_LOSS_STEPS):
            record[keys.LOSS] = math.nan  # non-finite losses and no finite one left: the loss is NaN, not absent
        record = merge_results([("the tracker's record", record),  # after the merge: a LossMetric's loss too
                                ("RecordSmoothing", self.smoothing.compute(record, steps))])
        self.consumed_tokens = record.get(keys.CONSUMED_TOKENS, self.consumed_tokens)
        if record.get(keys.METRIC_HOOK_FAILURES):
            self._warn_once("hook failures", f"{record[keys.METRIC_HOOK_FAILURES]} metric hook failure(s) at step "
                                             f"{step}: that interval's metrics are incomplete (logged as "
                                             f"{keys.METRIC_HOOK_FAILURES}); instrument().calculate() raises them")
        self.last_record = record
        self.logger.log(record, step)
        incident = self.incidents.report(record, step)  # a flagged record (known on every rank): one gather
        self.last_incident = incident if incident is not None else self.last_incident
        return record

    def log_eval(self, step: Optional[int] = None, metrics: Union[MetricCollection, Iterable[Metric], None] = None,
                 **values: Any) -> dict[str, float]:
        """Log evaluation results as ``eval/<key>`` at ``step`` (default: the last training step).

        ``metrics`` are calculated here (collective: every rank calls
        ``log_eval``); ``values`` are numbers or tensors (read on the host: an
        evaluation is not a hot path). Evaluation time is not counted in the
        next training step.
        """
        step = self.last_step if step is None else int(step)
        self._start(step)
        record: dict[str, Any] = {}
        metric_list = _metric_list(metrics)
        if metric_list:
            record.update(calculate_metrics(metric_list))
        for key, value in values.items():
            record[key] = float(value) if isinstance(value, torch.Tensor) and value.numel() == 1 else value
        record = {f"{keys.EVAL_PREFIX}{key}": value for key, value in record.items()}
        self.logger.log(record, step)
        self.timer.restart_clock()
        return record

    def close(self) -> None:
        """Log the last steps if they were not logged yet, then flush and close the logging backends.

        Collective when steps are pending since the last log step (``--steps 7``
        with ``log_interval=5`` logs step 7 here): every rank calls ``close()``,
        as every rank calls ``end_step``. Closing twice is harmless.
        """
        if self._closed:
            return
        self._closed = True
        if self._pending_steps:
            self._log(self.last_step)
        self.logger.close()

    # ------------------------------------------------------------ resuming

    def state_dict(self) -> dict[str, Any]:
        """Step number, consumed tokens and EMAs: host values, the same on every rank.

        Steps after the last log step are not in ``consumed_tokens`` (their
        counts are still on the devices): checkpoint at a log step to lose none.
        """
        return {"step": self.last_step, "consumed_tokens": self.consumed_tokens,
                "ema": self.smoothing.averages.state_dict()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Continue a run: step numbering, totals and EMAs; backends drop what the old run logged after it.

        The run's first step is the saved step + 1: every backend supersedes
        what it holds from there on. Called after the tracker already logged
        (a rollback to an earlier checkpoint in the same process, or a record
        logged before the checkpoint was loaded), the backends are reopened at
        that step and supersede again (``MetricsLogger.restart``), so no step is
        logged twice; the steps ended since the last log step are dropped
        (they belong to the abandoned timeline).
        """
        self.last_step = int(state_dict["step"])
        self.consumed_tokens = int(state_dict["consumed_tokens"])
        self.smoothing.averages.load_state_dict(state_dict["ema"])
        self._metric_losses.reset()
        if self._own is not None:
            step_loss, ranks, throughput = self._own
            step_loss.reset()
            ranks.reset()
            throughput.restart(self.consumed_tokens)
        if self._started:
            self._pending_steps = 0
            self.logger.restart(self.last_step + 1)
        else:
            self._start(self.last_step + 1)
        self.timer.restart_clock()

    # ------------------------------------------------------------ helpers

    def _start(self, first_step: int) -> None:
        """Give the logger the run's first step and configuration, once (the first of load, end_step, log_eval)."""
        if self._started:
            return
        self._started = True
        self.logger.start(first_step, self.run_config())

    def run_config(self) -> dict[str, Any]:
        """The configuration logged to every backend (``run_config.py``), with the user's ``config`` last."""
        config = self.config
        return build_run_config(self._context(), model_config=config.model_config,
                                padded_vocab_size=config.padded_vocab_size, seq_length=config.seq_length,
                                global_batch_size=config.global_batch_size, flops_per_step=self.flops_per_step,
                                log_interval=config.log_interval, peak_tflops=self._peak_tflops(),
                                device_name=self.device_name, user_config=dict(config.run_config))

    def _context(self) -> ParallelContext:
        return self._states()[0].context

    def _states(self) -> tuple[StepLoss, RankStates, Throughput]:
        """The tracker's own metrics: built with the tracker, or on first use if torch.distributed came later."""
        if self._own is None:
            throughput = Throughput(self.timer, self.flops_per_step, self._coefficients, self._peak_tflops,
                                    self.device_mesh, self.process_group)
            throughput.restart(self.consumed_tokens)
            self._own = (StepLoss(self.device_mesh, self.process_group),
                         RankStates(self.device_mesh, self.process_group, self.config.device_memory), throughput)
        return self._own

    def _note_precision(self) -> None:
        if self.config.precision == "auto" and not self._fp8_seen and fp8_autocast_active():
            self._fp8_seen = True

    def _peak_tflops(self) -> Optional[float]:
        if self.config.peak_tflops is not None:
            return self.config.peak_tflops
        precision = self.config.precision if self.config.precision != "auto" else ("fp8" if self._fp8_seen else "bf16")
        return peak_tflops(self.device_name, precision)

    def _warn_once(self, topic: str, message: str) -> None:
        if topic not in self._warned:
            self._warned.add(topic)
            warnings.warn(message, RuntimeWarning, stacklevel=3)


def _metric_list(metrics: Union[MetricCollection, Iterable[Metric], None]) -> list[Metric]:
    if metrics is None:
        return []
    if isinstance(metrics, MetricCollection):
        return list(metrics.metrics)
    if isinstance(metrics, Metric):
        return [metrics]
    if isinstance(metrics, Mapping):
        return list(metrics.values())
    return list(metrics)


def _real_tokens(tokens: Any, loss_mask: Optional[torch.Tensor], labels: Optional[torch.Tensor],
                 ignore_index: int) -> Any:
    """This rank's real tokens as a device tensor or number (never read on the host)."""
    if tokens is not None:
        return tokens
    if loss_mask is not None:
        return (loss_mask != 0).sum()
    if labels is not None:
        return (labels != ignore_index).sum()
    return None

