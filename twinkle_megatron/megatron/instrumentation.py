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
   statistics, and everything is accumulated into the metrics on the device.

``calculate()`` after the schedule is collective: every rank calls it and gets
the step's results. A failure inside a hook does not escape mid-schedule (that
would leave the other pipeline stages waiting in a p2p call forever): it is
recorded, and ``calculate()`` raises it on every rank.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import traceback
from typing import Any, Callable, Optional, Sequence, Union

import torch

from .. import keys
from ..metric import Accuracy, LogitsMetric, LossMetric, Metric, MetricCollection, TokenStatsMetric
from ..metric.base import Number, StateValues
from ..metric.logits_pass import logits_token_stats
from ..parallel import ParallelContext
from .fused_loss import FusedLoss, check_fused_loss
from .loss_reports import loss_func_result
from .moe_routing import attach_moe_routing


class MetricHookError(RuntimeError):
    """A metric hook failed during the step on some rank; raised by ``calculate()`` on every rank."""


class HookFailures(Metric):
    """Counts hook failures on every rank, so that every rank learns of them in the one sync.

    Reports them as data, ``train/metric_hook_failures`` (when > 0), on every
    rank; :meth:`MegatronInstrumentation.calculate` raises :class:`MetricHookError`
    for them, a :class:`~twinkle_megatron.MetricsTracker` logs them as an alarm.
    ``first_failure`` keeps this rank's first message of the interval.
    """

    every_rank_counts = True  # a failure on any rank counts, whatever its stage

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("failures", "sum")
        self.messages: list[str] = []
        self.first_failure: Optional[str] = None

    def record(self, where: str, error: BaseException) -> None:
        self.messages.append(f"{where}: {type(error).__name__}: {error}\n{traceback.format_exc()}")
        self._add("failures", 1.0)

    def accumulate(self, inputs: Any, outputs: Any, **kwargs: Any) -> None:
        pass

    def compute(self, states: StateValues) -> dict[str, Number]:
        self.first_failure = self.messages[0] if self.messages else None
        self.messages = []
        return {keys.METRIC_HOOK_FAILURES: int(states["failures"])} if states["failures"] else {}


def default_metrics(vocab_size: Optional[int] = None, ignore_index: int = -100,
                    group_names: Optional[Sequence[str]] = None) -> list[Metric]:
    """Token accuracy, label log-prob, entropy, non-finite counts and the per-token loss (per group too)."""
    groups = {"group_names": group_names} if group_names else {}
    return [Accuracy(vocab_size=vocab_size, ignore_index=ignore_index, **groups),
            TokenStatsMetric(vocab_size=vocab_size, ignore_index=ignore_index, **groups),
            LossMetric(**groups)]


class MegatronInstrumentation:
    """Metrics attached to a Megatron model; see :func:`instrument`."""

    def __init__(self, model: Union[torch.nn.Module, Sequence[torch.nn.Module]],
                 metrics: Union[MetricCollection, Sequence[Metric], None] = None, *,
                 vocab_size: Optional[int] = None, ignore_index: int = -100, loss_key: str = "lm loss",
                 group_names: Optional[Sequence[str]] = None, group_key: str = "dataset_id",
                 moe_routing: bool = True, moe_per_layer: bool = False, fused_loss: bool = False) -> None:
        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        if fused_loss:
            check_fused_loss(chunks)  # before any hook is attached: a refusal leaves the model as it was
        if metrics is None:
            metrics = default_metrics(vocab_size, ignore_index, group_names)
        self._failures = HookFailures()
        self._context: Optional[ParallelContext] = None
        # The failure count joins the metrics' sync, wherever they are calculated (here or in a tracker).
        user_metrics = metrics.metrics if isinstance(metrics, MetricCollection) else list(metrics)
        # MoE routing health: hooks on the routers, one more metric in the same sync (megatron/moe_routing.py).
        self.moe = attach_moe_routing(chunks, per_layer=moe_per_layer, on_error=self._failures.record) \
            if moe_routing else None
        moe_metrics = [self.moe.metric] if self.moe is not None else []
        self.metrics = MetricCollection([*user_metrics, *moe_metrics, self._failures])
        self.vocab_size = _shared_vocab_size(vocab_size, user_metrics)
        self.ignore_index = ignore_index
        self.loss_key = loss_key
        self.group_key = group_key
        self._grouped = any(getattr(m, "group_names", ()) for m in user_metrics)
        self._captured: Optional[dict] = None  # the current microbatch's labels and statistics
        self._group_ids: Any = None  # the current microbatch's group ids (read from its batch, or recorded)
        self._handles: list = []
        self._calls_in_forward = 0
        self._current: dict = {}
        models = _language_models(chunks)
        for gpt in models:
            # The signature is read once here, not per microbatch.
            before = functools.partial(self._before_model, inspect.signature(gpt.forward))
            self._handles.append(gpt.register_forward_pre_hook(before, with_kwargs=True))
            if not fused_loss:
                self._handles.append(gpt.output_layer.register_forward_hook(
                    functools.partial(self._after_output_layer, _mtp_heads(gpt)), with_kwargs=True))
        # With fused_loss the statistics come from the loss's own pass (megatron/fused_loss.py).
        self.fused_loss = FusedLoss(models if fused_loss else [], self._capture_stats, lambda: self.context.tp_group,
                                    self.vocab_size, ignore_index)

    # ------------------------------------------------------------------ hooks

    def _before_model(self, signature: inspect.Signature, module: torch.nn.Module, args: tuple,
                      kwargs: dict) -> None:
        try:
            bound = signature.bind_partial(*args, **kwargs).arguments
            self._current = {"labels": bound.get("labels"), "loss_mask": bound.get("loss_mask")}
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
            stats = logits_token_stats(logits.detach(), labels, context if not gathered else _no_tp(context),
                                       self.vocab_size, layout="sbv", ignore_index=self.ignore_index)
            self._captured = {"labels": labels, "loss_mask": self._current.get("loss_mask"), "stats": stats}
        except Exception as error:  # noqa: BLE001
            self._failures.record("output_layer hook", error)

    def _capture_stats(self, labels: torch.Tensor, stats: Any) -> None:  # the fused loss's statistics
        self._captured = {"labels": labels, "loss_mask": self._current.get("loss_mask"), "stats": stats}

    # ----------------------------------------------------------- forward_step

    def wrap(self, forward_step_func: Callable) -> Callable:
        """The user's ``forward_step`` with its ``loss_func`` wrapped; the signature is kept.

        With grouped metrics (``group_names``), the data iterator handed to
        ``forward_step`` is read through: the batch's ``group_key`` entry (a
        ``dataset_id`` per sample, as megatron-core's ``BlendedDataset`` gives)
        becomes the microbatch's group ids, unless ``forward_step`` passes them
        with :meth:`record_group_ids`.
        """

        @functools.wraps(forward_step_func)
        def forward_step(data_iterator: Any, *args: Any, **kwargs: Any):
            # One microbatch per forward_step: what an earlier model call captured (a call outside the
            # schedule, a microbatch whose loss_func never ran) must not be paired with this one.
            self._captured, self._group_ids = None, None
            if self._grouped and data_iterator is not None:
                data_iterator = _GroupIdsReader(data_iterator, self)
            output_tensor, loss_func = forward_step_func(data_iterator, *args, **kwargs)
            if loss_func is None:
                return output_tensor, loss_func
            return output_tensor, self._wrap_loss_func(loss_func, self._group_ids)

        return forward_step

    def record_group_ids(self, group_ids: Any) -> None:
        """The current microbatch's group ids (one per sample, per token, or one number), for a
        ``forward_step`` whose batches do not carry them under ``group_key``; call it in ``forward_step``."""
        self._group_ids = group_ids

    def _wrap_loss_func(self, loss_func: Callable, group_ids: Any = None) -> Callable:
        @functools.wraps(loss_func)
        def wrapped(output_tensor: torch.Tensor, *args: Any, **kwargs: Any):
            result = loss_func(output_tensor, *args, **kwargs)
            captured, self._captured = self._captured, None
            if kwargs.get("non_loss_data"):
                return result
            try:
                loss_mask = _loss_mask_of(loss_func, captured)
                self._accumulate(captured, loss_mask, result, output_tensor, group_ids)
            except Exception as error:  # noqa: BLE001
                self._failures.record("loss_func hook", error)
            return result

        return wrapped

    def _accumulate(self, captured: Optional[dict], loss_mask: Optional[torch.Tensor], result: Any,
                    output_tensor: Optional[torch.Tensor] = None, group_ids: Any = None) -> None:
        loss, num_tokens = loss_func_result(result, self.loss_key)
        inputs: dict[str, Any] = {}
        outputs: dict[str, Any] = {"loss": loss, "num_tokens": num_tokens}
        if captured is not None:
            labels = captured["labels"]
            inputs["labels"] = labels
            if loss_mask is not None:
                inputs["completion_mask"] = loss_mask.reshape(labels.shape)
            outputs["token_stats"] = captured["stats"]
            if group_ids is not None:
                inputs[self.group_key] = group_ids
                # Per group, the loss is pooled from the per-token losses GPTModel hands the loss_func (the
                # report's [sum, count] is one number for the whole microbatch, whatever its samples' groups);
                # the global loss stays the report's.
                if isinstance(output_tensor, torch.Tensor) and output_tensor.numel() == labels.numel():
                    outputs["token_losses"] = output_tensor.detach().reshape(labels.shape)
        # The loss is Megatron's [sum, count] report: every LossMetric pools it by tokens, whatever its default.
        self.metrics.accumulate(inputs, outputs, loss_reduction="sum")

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
        inputs: dict[str, Any] = {}
        outputs: dict[str, Any] = {}
        if labels is not None:
            inputs["labels"] = labels
            if loss_mask is not None:
                inputs["completion_mask"] = loss_mask.reshape(labels.shape)
            if logits is not None:
                outputs["token_stats"] = logits_token_stats(logits.detach(), labels, self.context, self.vocab_size,
                                                            logits_layout, self.ignore_index)
        if group_ids is not None:
            inputs[self.group_key] = group_ids
        if loss is not None:
            outputs.update(loss=loss, num_tokens=num_tokens)
            if token_losses is not None:
                outputs["token_losses"] = token_losses.detach()
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
        results = self.metrics.calculate()
        failures = results.pop(keys.METRIC_HOOK_FAILURES, 0)
        if failures:
            here = self._failures.first_failure or "none on this rank; see the log of the failing rank"
            raise MetricHookError(f"twinkle-megatron: {failures} metric hook failure(s) during the step; the "
                                  f"step's metrics are incomplete. First failure on this rank: {here}")
        return results

    def detach(self) -> None:
        """Remove every hook of ours from the model."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.fused_loss.detach()
        if self.moe is not None:
            self.moe.detach()
        self._captured = None

    def __enter__(self) -> MegatronInstrumentation:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.detach()


def instrument(model: Union[torch.nn.Module, Sequence[torch.nn.Module]],
               metrics: Union[MetricCollection, Sequence[Metric], None] = None, *,
               vocab_size: Optional[int] = None, ignore_index: int = -100, loss_key: str = "lm loss",
               group_names: Optional[Sequence[str]] = None, group_key: str = "dataset_id",
               moe_routing: bool = True, moe_per_layer: bool = False,
               fused_loss: bool = False) -> MegatronInstrumentation:
    """Attach ``metrics`` (default: accuracy, log-prob, entropy, loss) to a Megatron model.

    ``model`` is a model or the list of model chunks (virtual pipeline stages)
    given to the schedule, wrapped or not in Megatron's DDP / Float16Module.
    Then pass ``instrumentation.wrap(forward_step)`` to the schedule and call
    ``instrumentation.calculate()`` on every rank after it::

        with instrument(model, vocab_size=tokenizer.vocab_size) as metrics:
            losses = forward_backward_func(forward_step_func=metrics.wrap(forward_step), ...)
            results = metrics.calculate()   # {'accuracy': ..., 'loss': ..., 'entropy': ..., ...}

    ``vocab_size`` is the true vocabulary size (Megatron pads it); the model must be
    called with ``labels=`` (the hook reads them); the loss mask is read from the
    ``loss_func`` partial (or from ``loss_mask=`` given to the model).

    ``group_names`` (with the default metrics; metrics passed in carry their own):
    every metric also per group (``accuracy/<name>``, ``loss/<name>``...), the
    group of each sample read from its batch's ``group_key`` (``dataset_id``,
    as megatron-core's ``BlendedDataset`` names it) or passed by ``forward_step``
    with :meth:`MegatronInstrumentation.record_group_ids`.

    A model with megatron-core MoE layers also reports routing health (``moe/...``
    keys, see :mod:`.moe_routing`) in the same sync; ``moe_routing=False`` leaves
    the routers alone, ``moe_per_layer=True`` adds the per-layer keys.

    ``fused_loss=True``: the model's loss and the statistics from one pass (see :mod:`.fused_loss`).
    """
    return MegatronInstrumentation(model, metrics, vocab_size=vocab_size, ignore_index=ignore_index,
                                   loss_key=loss_key, group_names=group_names, group_key=group_key,
                                   moe_routing=moe_routing, moe_per_layer=moe_per_layer, fused_loss=fused_loss)


# ------------------------------------------------------------------ helpers


class _GroupIdsReader:
    """The schedule's data iterator, read through: each batch's group ids go to the instrumentation."""

    def __init__(self, iterator: Any, instrumentation: MegatronInstrumentation) -> None:
        self.iterator, self.instrumentation = iterator, instrumentation

    def __iter__(self) -> _GroupIdsReader:
        return self

    def __next__(self) -> Any:
        batch = next(self.iterator)
        if isinstance(batch, dict) and batch.get(self.instrumentation.group_key) is not None:
            self.instrumentation.record_group_ids(batch[self.instrumentation.group_key])
        return batch


def _language_models(chunks: Sequence[torch.nn.Module]) -> list[torch.nn.Module]:
    """The modules with an ``output_layer`` (GPTModel on the last stage), through any wrappers."""
    found = []
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(getattr(module, "output_layer", None), torch.nn.Module) and \
                    getattr(module, "post_process", True):
                found.append(module)
    return found


def _shared_vocab_size(vocab_size: Optional[int], metrics: Sequence[Metric]) -> Optional[int]:
    """The true vocabulary size the hook computes statistics for: one value for all metrics.

    The hook computes the statistics once for every metric, so metrics asking
    for different vocabulary sizes cannot all be served: that is an error, not
    a silent choice.
    """
    sizes = {m.vocab_size for m in metrics if isinstance(m, LogitsMetric) and m.vocab_size is not None}
    if vocab_size is not None:
        sizes.add(vocab_size)
    if len(sizes) > 1:
        raise ValueError(f"instrument(): the metrics and vocab_size ask for different vocabulary sizes "
                         f"{sorted(sizes)}; the statistics are computed once for all of them")
    return sizes.pop() if sizes else None


def _mtp_heads(gpt: torch.nn.Module) -> int:
    config = getattr(gpt, "config", None)
    return int(getattr(config, "mtp_num_layers", None) or 0)


def _no_tp(context: Any) -> Any:
    """The context with the whole vocabulary local (the output layer gathered its output)."""
    return dataclasses.replace(context, tp_group=None, tp_size=1)


def _loss_mask_of(loss_func: Callable, captured: Optional[dict]) -> Optional[torch.Tensor]:
    """The loss mask: given to the model, or a tensor bound in the ``loss_func`` partial."""
    if captured is None:
        return None
    if captured.get("loss_mask") is not None:
        return captured["loss_mask"]
    labels = captured["labels"]
    bound = []
    while isinstance(loss_func, functools.partial):
        bound += [loss_func.keywords.get("loss_mask"), *loss_func.args, *loss_func.keywords.values()]
        loss_func = loss_func.func
    for value in bound:
        if isinstance(value, torch.Tensor) and value.numel() == labels.numel() and value.numel() > 1:
            return value
    return None
