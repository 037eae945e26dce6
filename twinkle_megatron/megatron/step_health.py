"""Step health inside Megatron's own loop: per-layer norms, incidents, MoE routing and position buckets through
the one wrapped ``forward_step``.

In Megatron-LM's and Megatron-Bridge's ``pretrain()`` the user never sees the end of a step. megatron-core's
schedules call the model config's ``finalize_model_grads_func`` once per training step, on every rank, at the
end of ``forward_backward_func``: after the last backward, with the gradients reduced over DP (and, with
Megatron's distributed optimizer, reduce-scattered), before ``optimizer.step()`` clips them; never in the
forward-only evaluation. Both frameworks set it (``config.finalize_model_grads_func = finalize_model_grads``)
before their loop starts. So on the first wrapped call that receives the model, :class:`StepHealth` wraps it
(:class:`StepBoundary`), and at every step end, after Megatron's own finalize:

1. per-layer gradient and parameter squares (:class:`~twinkle_megatron.tracker.layer_norms.LayerNorms`; the
   optimizer, for the distributed optimizer's shards and the fp16 loss scale, is the one whose ``scale_loss`` the
   frameworks set as ``config.grad_scale_func``): device work only;
2. one :class:`~twinkle_megatron.MetricsTracker` step (``log_interval=1``): the step-health metrics (the norms,
   the step's loss per dataset and position bucket, the top samples, MoE routing) in the tracker's one coalesced
   sync — at most two collectives per step, plus one all-gather of the top samples on a flagged step only — and
   the values read on the host once per step (the optimizer's own step reads its gradient norm there too);
3. the tracker's record goes to :class:`FrameworkWriters`: on the rank holding the framework's writers, the
   step-health keys (:func:`step_health_values`) at the framework's iteration when it writes TensorBoard, one
   console line when it prints its own; a flagged step (a loss spike, a non-finite loss or norm) writes
   ``incidents.jsonl`` in the framework's run folder (:mod:`.framework_loop`) and prints its line
   (:mod:`twinkle_megatron.tracker.incidents`).

The step-health metrics are fed the same per-microbatch call as the user's metrics (one shared call: the tokens
are classified once) and only by training microbatches. Each sample of a step gets its index in Megatron's
sampler order (:meth:`StepHealth.sample_indices`), for the incidents and their skip list. Gradients, weights
and Megatron's loss are read, never written.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from .. import keys
from ..logging import Backend, StdoutBackend
from ..metric import Accuracy, LossMetric, Metric, MetricCollection, SampleLosses, SharedCall, TokenStatsMetric
from ..parallel import ParallelContext
from ..tracker import MetricsTracker, TrackerConfig
from ..tracker.layer_norms import LayerNorms
from ..tracker.layer_parameters import LayerParameters
from .framework_loop import FrameworkLoop, last_rank
from .router_hooks import MoERoutingHooks, attach_moe_routing, find_routers

# The token counts behind an accuracy: the accuracy says what they say.
_TOKEN_COUNTS = ("correct_tokens", "total_tokens")
_ALARMS = (keys.LOSS_SPIKE, keys.NONFINITE_LOSS_STEPS)


def step_health_values(record: Mapping[str, Any]) -> dict[str, float]:
    """The keys of a step-health record the framework's writers get: per-layer norms (``grad_norm/...``,
    ``param_norm/...``), MoE routing (``moe/...``), the statistics per position bucket (``loss/pos_0-511``...,
    which the loss reports cannot carry: see :mod:`.token_reports`), and the loss-spike and non-finite-loss flags.
    Megatron's own keys (its loss, grad norm, learning rate) stay Megatron's."""
    values = {}
    for key, value in record.items():
        head, _, tail = key.partition("/")
        if key.startswith((keys.GRAD_NORM_PREFIX, keys.PARAM_NORM_PREFIX, keys.MOE_PREFIX)) or key in _ALARMS or (
                tail and keys.parse_position_bucket_key(tail) is not None and head not in _TOKEN_COUNTS):
            values[key] = value
    return values


class FrameworkWriters(Backend):
    """The step-health tracker's backend: the framework's writers at its TensorBoard interval, and its console at
    its log interval (one line, the compact view of :class:`~twinkle_megatron.logging.StdoutBackend`)."""

    name = "framework"

    def __init__(self, loop: FrameworkLoop) -> None:
        self.loop = loop
        self.console = StdoutBackend(detail="compact")

    def write(self, record: Mapping[str, float], step: int) -> None:
        values = step_health_values(record)
        if not values:
            return
        log_interval, tensorboard_interval = self.loop.intervals()
        if step % tensorboard_interval == 0:
            self.loop.write(values, step)
        if step % log_interval == 0:  # like Megatron's own line: " iteration N | ..."
            shown = self.console.line(values, step).split(" | ", 1)[1:]
            print(" | ".join([f" twinkle-megatron step health at iteration {step}", *shown]), flush=True)


class StepBoundary:
    """``config.finalize_model_grads_func`` with ``on_step_end(model)`` called after it (same arguments, same
    result; ``model``: its first argument, the list of every model chunk of this rank)."""

    def __init__(self, finalize: Callable, on_step_end: Callable[[Sequence[torch.nn.Module]], None]) -> None:
        self.finalize, self.on_step_end = finalize, on_step_end

    def __call__(self, model: Sequence[torch.nn.Module], *args: Any, **kwargs: Any) -> Any:
        result = self.finalize(model, *args, **kwargs)
        self.on_step_end(model)
        return result


class StepHealth:
    """Step health through the one wrapped ``forward_step`` (see the module docstring).

    Args:
        layer_norms: per-layer gradient and parameter norms (docs/step-health.md's keys).
        incidents: ``incidents.jsonl`` for flagged steps, with the top ``top_k`` samples of the step.
        group_names, group_key, position_buckets, seq_length, vocab_size, ignore_index: as ``instrument()``'s;
            position buckets add the per-bucket accuracy, log-prob, entropy and loss.
        moe_routing, moe_per_layer: MoE routing health from the routers of the chunks the step receives.
        on_error: where the router hooks report a failure (``instrument()``'s hook failures).
    """

    def __init__(self, *, layer_norms: bool, incidents: bool, group_names: Sequence[str] = (),
                 group_key: str = "dataset_id", position_buckets: Any = None, seq_length: Optional[int] = None,
                 vocab_size: Optional[int] = None, ignore_index: int = -100, moe_routing: bool = True,
                 moe_per_layer: bool = False, top_k: int = 8,
                 on_error: Optional[Callable[[str, BaseException], None]] = None) -> None:
        self.layer_norms, self.incidents = layer_norms, incidents
        self.moe_routing, self.moe_per_layer = moe_routing, moe_per_layer
        self.on_error = on_error
        groups: dict[str, Any] = {"group_names": tuple(group_names)} if group_names else {}
        buckets = {"position_buckets": position_buckets, "seq_length": seq_length} if position_buckets else {}
        fed: list[Metric] = []
        if incidents or buckets:
            fed.append(LossMetric(**groups, **buckets))  # the step's loss (per dataset, per bucket)
        if buckets:
            # strict=False: labels outside the vocabulary are counted, never raised at the step end (that would stop
            # Megatron's training; mistakes.py tells them once where Megatron logs).
            fed += [Accuracy(vocab_size=vocab_size, ignore_index=ignore_index, strict=False, **buckets),
                    TokenStatsMetric(vocab_size=vocab_size, ignore_index=ignore_index, strict=False, **buckets)]
        self.samples = SampleLosses(top_k, dataset_key=group_key, dataset_names=tuple(group_names) or None) \
            if incidents else None
        if self.samples is not None:
            fed.append(self.samples)
        self.fed = MetricCollection(fed) if fed else None
        self.loop: Optional[FrameworkLoop] = None
        self.moe: Optional[MoERoutingHooks] = None
        self.tracker: Optional[MetricsTracker] = None
        self._norms: Optional[LayerNorms] = None
        self._boundary: Optional[StepBoundary] = None
        self._config: Any = None
        self._microbatches = 0  # training microbatches fed in the current step (last stage)
        self._consumed = 0  # samples consumed before the current step
        self._last_iteration: Optional[int] = None  # of the last step end written

    # ------------------------------------------------------------ attaching

    def attach(self, chunks: Sequence[torch.nn.Module], loop: Optional[FrameworkLoop]) -> None:
        """For chunks the wrapped step receives for the first time (virtual pipeline stages arrive one by one):
        the MoE routers' hooks, and on the first of them the wrapped ``finalize_model_grads_func`` of the model
        config. Without the framework's loop or its finalize function nothing is attached, with one warning
        (step health needs Megatron's own step end)."""
        from megatron.core.utils import get_model_config

        first = self._config is None
        if first:
            self._config = get_model_config(chunks[0])
        if self.moe_routing:
            if self.moe is None:
                self.moe = attach_moe_routing(chunks, per_layer=self.moe_per_layer, on_error=self.on_error,
                                              skip_evaluation=True)
            else:
                self.moe.hook(find_routers(chunks))
        if not first:
            return
        if not (self.layer_norms or self.incidents or self.fed is not None or self.moe is not None):
            return
        finalize = getattr(self._config, "finalize_model_grads_func", None)
        if loop is None or finalize is None:
            warnings.warn("twinkle-megatron: layer norms, incidents, MoE routing and position buckets through "
                          "wrap() need Megatron's own loop (Megatron-LM's or Megatron-Bridge's pretrain(): its "
                          f"global arguments and config.finalize_model_grads_func; found loop={loop is not None}, "
                          f"finalize_model_grads_func={finalize is not None}): left out. In a loop you own, use "
                          "MetricsTracker (record_grad_norms, SampleLosses) instead.", RuntimeWarning, stacklevel=4)
            self.moe_routing = False
            self._detach_moe()
            return
        self.loop = loop
        self._boundary = StepBoundary(finalize, self.step_end)
        self._config.finalize_model_grads_func = self._boundary

    def _detach_moe(self) -> None:
        if self.moe is not None:
            self.moe.detach()
        self.moe = None

    @property
    def attached(self) -> bool:
        return self._boundary is not None

    # ------------------------------------------------------------ per microbatch

    def feed(self, call: SharedCall) -> None:
        """One training microbatch (its shared call), on the last stage, once attached."""
        if self.fed is not None:
            self.fed.accumulate_call(call)

    def end_microbatch(self) -> None:
        """A training microbatch's ``loss_func`` ran (fed or not: a failed hook must not shift the next indices)."""
        self._microbatches += 1

    def sample_indices(self, batch_size: int, context: ParallelContext, device: torch.device) -> torch.Tensor:
        """The sampler index of each sample of the current microbatch: ``consumed + m·(b·dp) + dp_rank·b + j``.

        Megatron's pretraining sampler (``MegatronPretrainingSampler``) hands each step's global batch out in
        order: microbatch ``m`` of the step takes ``b·dp`` consecutive samples from ``consumed`` (the samples
        consumed before the step) on, DP rank ``r`` the ``b`` of them from ``r·b`` (sample ``j``). The index is the
        position in the sampler's order: the dataset's own index for Megatron's GPT and blended datasets (whose
        ``dataset_id`` names the corpus); with a shuffling sampler (``--dataloader-type cyclic``) or a packed or
        SFT dataset it is the position in that order, not the row of a corpus file.
        """
        if self._microbatches == 0:
            self._consumed = self.loop.consumed_samples() if self.loop is not None else 0
        start = self._consumed + self._microbatches * batch_size * context.dp_size + context.dp_rank * batch_size
        return torch.arange(start, start + batch_size, dtype=torch.int64, device=device)

    # ------------------------------------------------------------ the step end

    def step_end(self, model: Sequence[torch.nn.Module]) -> None:
        """After Megatron's finalize of ``model`` (every chunk of this rank): record the norms, one tracker step at
        the framework's iteration."""
        iteration = self.loop.step_iteration()
        self._microbatches = 0
        if iteration == self._last_iteration:
            # Megatron's rerun state machine ran the step again at the same iteration (a NaN or spiky loss under
            # validate_results): the first run was written; this run's states are dropped, on every rank alike.
            for metric in self._fed_metrics():
                metric.reset()
            return
        self._last_iteration = iteration
        if self.tracker is None:
            self.tracker = self._build_tracker(list(model) if isinstance(model, (list, tuple)) else [model])
        if self._norms is not None:
            self._norms.record()
        self.tracker.end_step(step=iteration)

    def _fed_metrics(self) -> list[Metric]:
        """The metrics fed between step ends (by the microbatches and the router hooks)."""
        return [*(self.fed.metrics if self.fed is not None else []), *([self.moe.metric] if self.moe else [])]

    def _build_tracker(self, chunks: list[torch.nn.Module]) -> MetricsTracker:
        """The tracker of the step-health metrics (built at the first step end, on every rank together)."""
        metrics = self._fed_metrics()
        if self.layer_norms:
            optimizer = getattr(getattr(self._config, "grad_scale_func", None), "__self__", None)
            self._norms = LayerNorms(LayerParameters(chunks, optimizer), optimizer)
            metrics.append(self._norms)
        run_dir = self.loop.run_dir()
        config = TrackerConfig(log_interval=1, backends=(FrameworkWriters(self.loop),), writer_rank=last_rank(),
                               log_dir=run_dir, incidents_dir=run_dir if self.incidents else None,
                               device_memory=False,  # Megatron reports its own memory peaks: never reset them
                               overflow_skips=bool(getattr(self._config, "fp16", False)))
        return MetricsTracker(config, metrics=metrics)

    def detach(self) -> None:
        """Give Megatron its finalize function back and remove the router hooks."""
        if self._boundary is not None and self._config is not None \
                and self._config.finalize_model_grads_func is self._boundary:
            self._config.finalize_model_grads_func = self._boundary.finalize
        self._boundary = None
        self._detach_moe()
