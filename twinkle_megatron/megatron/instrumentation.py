"""Attach metrics to a Megatron model and ``forward_step``, without changing either.

In ``GPTModel.forward(..., labels=...)`` the logits exist only between
``output_layer`` and the loss, and a fused cross-entropy may overwrite them
there. So, per microbatch, on the last pipeline stage:

1. a forward pre-hook on the GPT model captures ``labels`` (and ``loss_mask``
   when the model is given one);
2. a forward hook on ``output_layer`` computes the vocab-parallel token
   statistics (argmax, label log-prob, entropy: two TP collectives) from this
   rank's logits shard *before* the loss reads them, and keeps only those
   per-token results, never the logits (with multi-token prediction the MTP
   heads call ``output_layer`` first; only the main head's call is read);
3. the wrapped ``forward_step`` wraps the returned ``loss_func``; when the
   schedule calls it, the loss report (``(loss, num_tokens, {'lm loss': [sum,
   count]})`` or the older ``(loss, {'lm loss': value})``) and the loss mask (a
   tensor argument of the ``loss_func`` partial shaped like the labels) join the
   statistics and GPTModel's per-token losses (the ``output_tensor`` the
   ``loss_func`` receives), and everything is accumulated into the metrics on
   the device: the per-token losses slice the loss (groups, positions, samples)
   and keep the healthy samples of a microbatch whose report is non-finite.

``wrap()`` finds the step's data iterator and model by parameter name
(:mod:`.forward_step`), so Megatron-Bridge's ``forward_step(state, data_iterator,
model)`` works as Megatron-LM's does. Without a model (Megatron-LM's and
Megatron-Bridge's ``pretrain()`` build it), the hooks attach to each model chunk
the wrapped step receives, on its first call with that chunk. With
``loss_reports`` (the default without a model), the wrapped ``loss_func`` also
adds the statistics to its loss report as ``[sum, count]`` entries
(:mod:`.token_reports`), which Megatron's ``train_step`` pools over DP×CP and
``training_log`` writes to TensorBoard and W&B; mistakes are told where it logs (:mod:`.mistakes`);
microbatches of Megatron's ``evaluate()`` add no entries and feed validation values (:mod:`.validation`);
what the reports cannot carry (per-layer norms, incidents, MoE routing, position buckets) goes to Megatron's
writers from its own step end (:mod:`.step_health`).

``calculate()`` after the schedule is collective: every rank calls it and gets
the step's results; hook failures are data (:mod:`.hook_failures`).
"""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch

from .. import keys
from ..metric import Metric, MetricCollection, Number, SampleLosses, check_layout_declared, logits_token_stats
from ..parallel import ParallelContext
from ..tracker.loss_reports import loss_func_result
from .forward_step import DATA_ITERATOR, MODEL, BatchReader, StepSignature, loss_mask_of
from .framework_loop import find_framework_loop
from .fused_loss import FusedLoss, check_fused_loss
from .hook_failures import HookFailures, MetricHookError
from .language_model import language_models, mtp_heads
from .metric_choice import default_metrics, shared_vocab_size
from .microbatch_feed import microbatch_call, microbatch_feed, per_token_losses
from .mistakes import LoopChecks
from .router_hooks import attach_moe_routing, find_routers
from .step_health import StepHealth
from .token_reports import TokenReports, report_device, with_entries
from .validation import Validation, is_evaluation


class MegatronInstrumentation:
    """Attach ``metrics`` (default: accuracy, log-prob, entropy, loss) to a Megatron model.

    ``model``: a model or the list of model chunks (virtual pipeline stages) given
    to the schedule, wrapped or not in Megatron's DDP / Float16Module; None (for
    ``pretrain()``, which builds the model): the hooks attach to the chunks the
    wrapped ``forward_step`` receives. Pass ``instrumentation.wrap(forward_step)``
    as the ``forward_step_func``, and call ``calculate()`` on every rank after a step::

        with instrument(model, vocab_size=tokenizer.vocab_size) as metrics:
            losses = forward_backward_func(forward_step_func=metrics.wrap(forward_step), ...)
            results = metrics.calculate()   # {'accuracy': ..., 'loss': ..., 'entropy': ..., ...}

    ``vocab_size`` is the true vocabulary size (Megatron pads it); the model must be
    called with ``labels=`` (the hook reads them); the loss mask is read from the
    ``loss_func`` partial (or from ``loss_mask=`` given to the model).

    ``loss_reports`` (default: on exactly when ``model`` is None, i.e. when
    Megatron's own loop logs): add ``accuracy``, ``entropy``, ``logprob`` (and
    the per-group keys) to each loss report as ``[sum, count]`` entries, which
    Megatron's ``train_step`` pools and ``training_log`` writes
    (:mod:`.token_reports`); ``calculate()`` stays available either way. During Megatron's ``evaluate()``
    (the chunk in eval mode, autograd off) the reports keep the ``loss_func``'s own keys and the microbatches
    feed a validation copy of the metrics: :meth:`calculate_validation`, :meth:`pretrain_hooks`
    (:mod:`.validation`).

    ``group_names`` (with the default metrics; metrics passed in carry their own):
    every metric also per group (``accuracy/<name>``, ``loss/<name>``...), the
    group of each sample read from its batch's ``group_key`` (``dataset_id``,
    as megatron-core's ``BlendedDataset`` names it) or passed by ``forward_step``
    with :meth:`MegatronInstrumentation.record_group_ids`. ``position_buckets``,
    ``seq_length`` (default metrics): likewise per bucket of token positions
    (``loss/pos_0-511``...; see :mod:`twinkle_megatron.metric.state.positions`).

    ``fused_loss=True``: the model's language-model loss and the statistics from one pass over the logits, with
    Megatron's own gradient (see :mod:`.fused_loss`; what it refuses and why).

    Megatron-core MoE layers also report routing health (``moe/...``, see
    :mod:`.router_hooks`); ``moe_routing=False`` leaves the
    routers alone, ``moe_per_layer=True`` adds the per-layer keys.

    Inside Megatron-LM's and Megatron-Bridge's own ``pretrain()`` (no ``model``, loss reports on), what the loss
    reports cannot carry goes through Megatron's own step end (:mod:`.step_health`) to its writers and console:
    MoE routing health, the position buckets' keys, and with ``layer_norms=True`` the per-layer gradient and
    parameter norms (docs/step-health.md), with ``incidents=True`` an ``incidents.jsonl`` line for every step with
    a loss spike or a non-finite loss or norm, naming its highest-loss samples by their index in Megatron's
    sampler order. :meth:`bridge_callbacks` writes the validation values to Megatron-Bridge's loggers.
    """

    def __init__(self, model: Union[torch.nn.Module, Sequence[torch.nn.Module], None] = None,
                 metrics: Union[MetricCollection, Sequence[Metric], None] = None, *,
                 vocab_size: Optional[int] = None, ignore_index: int = -100, loss_key: str = "lm loss",
                 group_names: Optional[Sequence[str]] = None, group_key: str = "dataset_id",
                 moe_routing: bool = True, moe_per_layer: bool = False,
                 loss_reports: Optional[bool] = None, position_buckets: Any = None,
                 seq_length: Optional[int] = None, fused_loss: bool = False, layer_norms: bool = False,
                 incidents: bool = False) -> None:
        metrics_given = metrics is not None
        if metrics is None:
            metrics = default_metrics(vocab_size, ignore_index, group_names, position_buckets, seq_length)
        self._failures = HookFailures()
        self._context: Optional[ParallelContext] = None
        # The failure count joins the metrics' sync, wherever they are calculated (here or in a tracker).
        user_metrics = metrics.metrics if isinstance(metrics, MetricCollection) else list(metrics)
        chunks = [] if model is None else list(model) if isinstance(model, (list, tuple)) else [model]
        # MoE routing health: hooks on the routers (router_hooks.py), one more metric in the same sync.
        self.moe = attach_moe_routing(chunks, per_layer=moe_per_layer, on_error=self._failures.record) \
            if moe_routing and chunks else None
        moe_metrics = [self.moe.metric] if self.moe is not None else []
        self.metrics = MetricCollection([*user_metrics, *moe_metrics, self._failures])
        self.vocab_size = shared_vocab_size(vocab_size, user_metrics)
        self.ignore_index = ignore_index
        self.loss_key = loss_key
        self.group_key = group_key
        names = group_names or next((m.group_names for m in user_metrics if getattr(m, "group_names", ())), ())
        self._grouped = bool(names)
        # Without a model, Megatron's own loop (pretrain()) is the one that logs: the statistics ride in its reports.
        self.reports = TokenReports(ignore_index, names, loss_key) \
            if (model is None if loss_reports is None else loss_reports) else None
        # In Megatron's own loop, what its reports cannot carry goes through its step end (step_health.py).
        self.step_health = StepHealth(
            layer_norms=layer_norms, incidents=incidents, group_names=names, group_key=group_key,
            position_buckets=position_buckets, seq_length=seq_length, vocab_size=self.vocab_size,
            ignore_index=ignore_index, moe_routing=moe_routing, moe_per_layer=moe_per_layer,
            on_error=self._failures.record) if self.reports is not None and model is None else None
        if (layer_norms or incidents) and self.step_health is None:
            raise ValueError("instrument(layer_norms=..., incidents=...) is for Megatron's own loop (pretrain(): "
                             "no model given, loss reports on); in a loop you own use MetricsTracker "
                             "(record_grad_norms, SampleLosses)")
        self._moe_wanted = moe_routing and model is None and self.step_health is None
        # The default metrics' keys all reach Megatron's log (position buckets through step_health.py); metrics
        # passed in may have keys that cannot.
        self._checks = self.reports and LoopChecks(self.vocab_size, names, group_key,
                                                   user_metrics if metrics_given else [], model)
        # Megatron's evaluate() would print a perplexity of every report key: its microbatches feed a copy of the
        # metrics instead, and the reports keep the loss_func's own keys (validation.py).
        self.validation = Validation(user_metrics) if self.reports is not None else None
        self._chunks = chunks
        self._samples = next((m for m in user_metrics if isinstance(m, SampleLosses)), None)  # per-sample losses
        self._captured: Optional[dict] = None  # the current microbatch's labels and statistics
        self._group_ids, self._sample_index = None, None  # the microbatch's group ids, sample indices
        self._handles: list = []
        self._calls_in_forward = 0
        self._current: dict = {}
        self._lazy = model is None  # hooks attach to the chunks the wrapped forward_step receives
        self._chunks_seen: set[torch.nn.Module] = set()  # modules hash by identity; held, so never reused
        self._hooked: set[torch.nn.Module] = set()
        self._failure_warned = False
        # With fused_loss the statistics come from the loss's own pass (megatron/fused_loss.py), not a hook.
        self.fused_loss = FusedLoss(self._capture_stats, lambda: self.context.tp_group, self.vocab_size,
                                    ignore_index) if fused_loss else None
        self._attach(chunks)

    def _attach(self, chunks: Sequence[torch.nn.Module]) -> None:
        """Hooks on the language models of ``chunks`` not hooked yet (a chunk may come wrapped or unwrapped)."""
        if self.fused_loss is not None:
            check_fused_loss(chunks)  # before any hook is attached: a refusal leaves the model as it was
        for gpt in language_models(chunks):
            if gpt in self._hooked:
                continue
            self._hooked.add(gpt)
            # The signature is read once here, not per microbatch.
            before = functools.partial(self._before_model, inspect.signature(gpt.forward))
            self._handles.append(gpt.register_forward_pre_hook(before, with_kwargs=True))
            if self.fused_loss is not None:
                self.fused_loss.attach(gpt)
            else:
                self._handles.append(gpt.output_layer.register_forward_hook(
                    functools.partial(self._after_output_layer, mtp_heads(gpt)), with_kwargs=True))

    def _attach_lazily(self, model: Any, arguments: Mapping[str, Any]) -> None:
        """On a chunk's first microbatch: its hooks (virtual pipeline stages arrive one chunk per call);
        ``arguments``: the call's, by parameter name (Megatron-Bridge's state among them)."""
        chunks = [m for m in (model if isinstance(model, (list, tuple)) else [model]) if isinstance(m, torch.nn.Module)]
        new = [chunk for chunk in chunks if chunk not in self._chunks_seen]
        if not new:
            return
        self._chunks_seen.update(new)
        self._attach(new)
        if self.step_health is not None:
            self.step_health.attach(new, find_framework_loop(arguments))
        if self._moe_wanted and find_routers(new):
            self._moe_wanted = False  # its metric must exist before anything reads the collection
            warnings.warn("instrument() without a model leaves MoE routing health out: pass the model chunks "
                          "for the moe/ keys", RuntimeWarning, stacklevel=4)

    # ------------------------------------------------------------------ hooks

    def _before_model(self, signature: inspect.Signature, module: torch.nn.Module, args: tuple,
                      kwargs: dict) -> None:
        try:
            bound = signature.bind_partial(*args, **kwargs).arguments
            self._current = {key: bound.get(key) for key in ("labels", "loss_mask", "packed_seq_params")}
            self._calls_in_forward = 0
        except Exception as error:  # noqa: BLE001 - see the module docstring
            self._failures.record("model pre-hook", error)

    def _after_output_layer(self, mtp_heads: int, module: torch.nn.Module, args: tuple, kwargs: dict,
                            output: Any) -> None:
        call, self._calls_in_forward = self._calls_in_forward, self._calls_in_forward + 1
        labels = self._current.get("labels")
        if call != mtp_heads or labels is None:
            return  # an MTP head, or no labels: the user computes the loss outside the model
        try:
            logits = output[0] if isinstance(output, tuple) else output
            gathered = kwargs.get("runtime_gather_output")
            gathered = getattr(module, "gather_output", False) if gathered is None else gathered
            context = self.context
            stats = logits_token_stats(logits.detach(), labels, context if not gathered else context.without_tp(),
                                       self.vocab_size, layout="sbv", ignore_index=self.ignore_index)
            self._captured = {**self._current, "stats": stats}
        except Exception as error:  # noqa: BLE001
            self._failures.record("output_layer hook", error)

    def _capture_stats(self, labels: torch.Tensor, stats: Any) -> None:  # the fused loss's statistics
        self._captured = {**self._current, "labels": labels, "stats": stats}

    # ----------------------------------------------------------- forward_step

    def wrap(self, forward_step_func: Callable) -> Callable:
        """The user's ``forward_step`` with its ``loss_func`` wrapped; the signature is kept (Megatron-Bridge
        reads it to inject its state).

        The data iterator and the model are the arguments named ``data_iterator``
        and ``model`` (after what a ``functools.partial`` binds), wherever they
        stand; ``TypeError`` here when one that is needed has no such parameter.
        With ``group_names`` the iterator is read through: each batch's
        ``group_key`` entry (megatron-core's ``BlendedDataset`` gives a
        ``dataset_id`` per sample) becomes the microbatch's group ids, unless
        ``forward_step`` passes them with :meth:`record_group_ids`. Without a model,
        the hooks attach to each chunk the step receives, on its first call with it.
        """
        step = StepSignature.of(forward_step_func)
        reads_batches = self._grouped or self._samples is not None
        if reads_batches:
            step.require(DATA_ITERATOR, forward_step_func, f"to read each batch's {self.group_key!r} (group_names) "
                         f"or sample indices (SampleLosses)")
        if self._lazy:
            step.require(MODEL, forward_step_func, "to attach the hooks to it (instrument() was given no model)")
        reads_arguments = reads_batches or self._lazy or self._checks is not None and step.takes(MODEL)

        @functools.wraps(forward_step_func)
        def forward_step(*args: Any, **kwargs: Any):
            # One microbatch per forward_step: what an earlier model call captured (a call outside the
            # schedule, a microbatch whose loss_func never ran) must not be paired with this one.
            self._captured, self._group_ids, self._sample_index = None, None, None
            arguments = step.bind(args, kwargs) if reads_arguments else None
            evaluating = self.validation is not None and is_evaluation(
                arguments.arguments.get(MODEL) if arguments is not None else None, self._chunks)
            if self._checks is not None:  # mistakes told where Megatron logs; before the step's work is queued
                self._checks.at_call(arguments.arguments.get(MODEL) if arguments is not None else None)
            if reads_arguments:
                if self._lazy:
                    self._attach_lazily(arguments.arguments.get(MODEL), arguments.arguments)
                iterator = arguments.arguments.get(DATA_ITERATOR)
                if reads_batches and iterator is not None:
                    arguments.arguments[DATA_ITERATOR] = BatchReader(iterator, self.record_batch)
                output_tensor, loss_func = step.call(arguments)
            else:
                output_tensor, loss_func = forward_step_func(*args, **kwargs)
            if loss_func is None:
                return output_tensor, loss_func
            return output_tensor, self._wrap_loss_func(loss_func, self._group_ids, self._sample_index, evaluating)

        return forward_step

    def record_group_ids(self, group_ids: Any) -> None:
        """The current microbatch's group ids (one per sample, per token, or one number), for a
        ``forward_step`` whose batches do not carry them under ``group_key``; call it in ``forward_step``."""
        self._group_ids = group_ids

    def record_batch(self, batch: Any) -> None:
        """Read the microbatch's group ids and (for :class:`SampleLosses`) sample indices from its batch."""
        if not isinstance(batch, Mapping):
            return
        if batch.get(self.group_key) is not None:
            self.record_group_ids(batch[self.group_key])
        if self._samples is not None:
            self._sample_index = batch.get(self._samples.index_key)

    def _wrap_loss_func(self, loss_func: Callable, group_ids: Any = None, sample_index: Any = None,
                        evaluating: bool = False) -> Callable:
        """``loss_func`` feeding the metrics (the validation copy when ``evaluating``) and, with ``loss_reports``
        and not ``evaluating``, adding the statistics to its report."""
        target = self.validation.metrics if evaluating else self.metrics

        @functools.wraps(loss_func)
        def wrapped(output_tensor: torch.Tensor, *args: Any, **kwargs: Any):
            result = loss_func(output_tensor, *args, **kwargs)
            captured, self._captured = self._captured, None
            if kwargs.get("non_loss_data"):
                return result
            entries = None
            try:
                loss_mask = None if captured is None else \
                    loss_mask_of(loss_func, captured["labels"], given=captured.get("loss_mask"))
                entries = self._accumulate(captured, loss_mask, result, output_tensor, group_ids, sample_index,
                                           target, evaluating)
            except Exception as error:  # noqa: BLE001
                self._failures.record("loss_func hook", error)
            if self.step_health is not None and not evaluating:
                self.step_health.end_microbatch()
            if self.reports is None:
                return result
            self._warn_failures()
            if evaluating:  # Megatron's evaluate() prints a perplexity of every key: its own keys only
                return result  # Megatron's own loop may never call calculate(), which raises them
            return with_entries(result, entries if entries is not None else self.reports.empty(report_device(result)))

        return wrapped

    def _warn_failures(self) -> None:
        first = self._failures.first_failure()
        if first is not None and not self._failure_warned:
            self._failure_warned = True
            warnings.warn(f"twinkle-megatron: a metric hook failed; this microbatch's statistics are left out of the "
                          f"loss reports: {first}", RuntimeWarning, stacklevel=3)

    def _accumulate(self, captured: Optional[dict], loss_mask: Optional[torch.Tensor], result: Any,
                    output_tensor: Optional[torch.Tensor] = None, group_ids: Any = None,
                    sample_index: Any = None, target: Optional[MetricCollection] = None,
                    evaluating: bool = False) -> Optional[dict]:
        """Feed the metrics (``target``, default: the training metrics) and, for a training microbatch in
        Megatron's own loop, the step health; returns the report entries (with ``loss_reports``) when statistics
        were captured."""
        target = self.metrics if target is None else target
        health = self.step_health if self.step_health is not None and self.step_health.attached \
            and not evaluating else None
        loss, num_tokens = loss_func_result(result, self.loss_key)
        if captured is None:  # no labels seen: the loss only (Megatron's [sum, count] report, pooled by tokens)
            call = microbatch_call(*microbatch_feed(loss=loss, num_tokens=num_tokens), {"loss_reduction": "sum"})
            target.accumulate_call(call)
            if health is not None:
                health.feed(call)
            return None
        labels = captured["labels"]
        loss_mask = None if loss_mask is None else loss_mask.reshape(labels.shape)
        # Per group, position and sample, the loss is pooled from the per-token losses GPTModel hands the
        # loss_func (the report's [sum, count] is one number for the whole microbatch); the global loss is the
        # report's while it is finite, and the finite per-token losses' when it is not (LossMetric): one NaN
        # sample never takes the healthy samples of its microbatch with it.
        token_losses = per_token_losses(output_tensor, labels)
        more = {"packed_seq_params": captured.get("packed_seq_params")}  # THD: sub-sequences
        health_samples = health.samples if health is not None else None
        if sample_index is None and health_samples is not None:
            sample_index = health.sample_indices(labels.shape[0], self.context, labels.device)  # sampler order
        for samples in (self._samples, health_samples):
            if samples is not None and sample_index is not None:
                more[samples.index_key] = sample_index
        stats = captured["stats"]
        inputs, outputs = microbatch_feed(labels=labels, loss_mask=loss_mask, stats=stats,
                                          group_key=self.group_key, group_ids=group_ids, loss=loss,
                                          num_tokens=num_tokens, more_inputs=more, token_losses=token_losses)
        entries, classes = None, None
        if self.reports is not None:
            # The microbatch's tokens are classified once: for the reports, and handed to the metrics that count
            # the same tokens (the loss mask's, with this ignore_index) through the call.
            selected, classes = self.reports.loss_mask_tokens(labels, loss_mask, stats)
            groups = self.reports.groups(group_ids, labels, self.context)
            entries, mistakes = self.reports.of(labels, selected, stats, classes, groups, token_losses)
            self._checks.add(mistakes)
        # The loss is Megatron's [sum, count] report: every LossMetric pools it by tokens, whatever its default.
        call = microbatch_call(inputs, outputs, {"loss_reduction": "sum"}, classes, self.ignore_index)
        target.accumulate_call(call)
        if health is not None:
            health.feed(call)
        return entries

    # --------------------------------------------------------- explicit calls

    def record_microbatch(self, *, logits: Optional[torch.Tensor] = None, labels: Optional[torch.Tensor] = None,
                          loss_mask: Optional[torch.Tensor] = None, loss: Any = None, num_tokens: Any = None,
                          logits_layout: Optional[str] = None, group_ids: Any = None,
                          token_losses: Optional[torch.Tensor] = None) -> None:
        """For custom ``forward_step``\\ s: feed one microbatch by hand (last pipeline stage only).

        ``logits`` is this rank's vocab shard (``[b, s, V/tp]`` or ``[s, b, V/tp]``),
        read before any in-place loss; ``loss`` is the microbatch's loss *sum*
        over ``num_tokens`` tokens (Megatron-LM's per-token convention). With
        ``group_names``: ``group_ids`` (one per sample, per token, or one number)
        and, for the per-group loss, ``token_losses`` (per token, shaped like
        ``labels``: GPTModel's output with ``labels=``).
        """
        stats = None
        if labels is not None and logits is not None:
            check_layout_declared(self, logits, labels, logits_layout)
            stats = logits_token_stats(logits.detach(), labels, self.context, self.vocab_size, logits_layout,
                                       self.ignore_index)
        inputs, outputs = microbatch_feed(labels=labels, loss_mask=loss_mask, stats=stats, group_key=self.group_key,
                                          group_ids=group_ids, loss=loss, num_tokens=num_tokens,
                                          token_losses=token_losses if loss is not None else None)
        self.metrics.accumulate(inputs, outputs, loss_reduction="sum")

    # ------------------------------------------------------------ results etc.

    @property
    def context(self) -> ParallelContext:
        """The parallel layout the hooks compute in: megatron-core's ``parallel_state`` (or the world)."""
        if self._context is None:
            self._context = ParallelContext.resolve()
        return self._context

    def calculate(self) -> dict[str, Number]:
        """The step's metrics, the same on every rank (collective: every rank calls it).

        Raises :class:`MetricHookError` on every rank when a hook failed on any rank
        during the step (the step's metrics are incomplete).
        """
        self._captured = None
        # This rank's first message, read before the sync starts a new interval.
        here = self._failures.first_failure() or "none on this rank; see the log of the failing rank"
        results = self.metrics.calculate()
        failures = results.pop(keys.METRIC_HOOK_FAILURES, 0)
        if failures:
            raise MetricHookError(f"twinkle-megatron: {failures} metric hook failure(s) during the step; the "
                                  f"step's metrics are incomplete. First failure on this rank: {here}")
        return results

    def calculate_validation(self) -> dict[str, Number]:
        """``{'validation/<key>': value}`` of the microbatches Megatron's ``evaluate()`` ran since the last call
        (collective: every rank calls it; ``{}`` when none ran or without ``loss_reports``). See :mod:`.validation`."""
        return {} if self.validation is None else self.validation.calculate()

    def pretrain_hooks(self) -> dict[str, Callable]:
        """Keywords for Megatron-LM's ``pretrain(..., **metrics.pretrain_hooks())``: at each evaluation the
        validation values are calculated on every rank and written to Megatron-LM's TensorBoard and W&B writers at
        the evaluation's iteration (:meth:`.Validation.pretrain_hooks`); ``{}`` without ``loss_reports``."""
        return {} if self.validation is None else self.validation.pretrain_hooks()

    def bridge_callbacks(self) -> list:
        """For Megatron-Bridge's ``pretrain(config, metrics.wrap(forward_step), callbacks=metrics.bridge_callbacks())``:
        at the end of each evaluation the validation values are calculated on every rank and written to Bridge's
        loggers at its iteration (:class:`.validation.BridgeValidation`); ``[]`` without ``loss_reports``."""
        return [] if self.validation is None else self.validation.bridge_callbacks()

    def detach(self) -> None:
        """Remove every hook of ours from the model."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._hooked.clear()
        self._chunks_seen.clear()
        if self.fused_loss is not None:
            self.fused_loss.detach()
        if self.moe is not None:
            self.moe.detach()
        if self.step_health is not None:
            self.step_health.detach()
        self._captured = None

    def __enter__(self) -> MegatronInstrumentation:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.detach()


# The short name users call: ``instrument(model, ...)`` builds the class; one signature, one docstring.
instrument = MegatronInstrumentation

