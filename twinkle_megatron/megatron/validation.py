"""Validation under Megatron's own ``evaluate()``: values of its own, never a perplexity of an accuracy.

Megatron-LM's ``evaluate_and_print_results`` (``megatron/training/training.py``, read at
``core_v0.16.1`` and ``core_v0.19.0``) and Megatron-Bridge 0.6.2's (``training/eval.py``) pool every
key of the loss reports over the evaluation batches and then, for *every* key, print
``<key> value`` and ``<key> PPL`` (``exp(min(20, value))``) and write ``<key> validation`` (and,
with ``--log-validation-ppl-to-tensorboard``, ``<key> validation ppl``). A perplexity of an
accuracy or a log-prob means nothing, so while Megatron evaluates, the loss reports carry only
the ``loss_func``'s own keys, and the plugin's statistics go to a validation copy of its metrics
instead (device states, no host sync per microbatch), read as ``validation/<key>``.

When a microbatch is an evaluation's (:func:`is_evaluation`): both ``evaluate()``\\ s put every model
chunk in eval mode (``model_module.eval()``) and run the forward-only schedule under
``torch.no_grad()``; a training step runs with autograd on. So a microbatch is an evaluation's
when the model chunk the wrapped ``forward_step`` receives is in eval mode *and* autograd is off:
neither alone is enough (a forward-only pass in train mode, an RL loop that trains with dropout off
by ``eval()``, stay training microbatches).

Where the values go: :meth:`Validation.calculate` (collective: every rank calls it) returns
``{'validation/accuracy': ..., 'validation/loss': ..., 'validation/accuracy/<name>': ...}`` over
the batches evaluated since the last call, each key a token-weighted mean over all ranks like the
training metrics', and starts a new evaluation. Megatron-LM's ``pretrain()`` calls two functions
of the caller's at every evaluation, which is where the values reach its writers:
``non_loss_data_func(model)`` on every rank after the evaluation's last batch (a safe point for a
collective: every rank has finished its schedule) and ``process_non_loss_data_func(collected,
iteration, writer)`` on the last rank when a TensorBoard writer exists. :meth:`Validation.pretrain_hooks`
gives both: the first is :meth:`Validation.calculate`, the second writes each value to TensorBoard
(``writer.add_scalar('validation/<key>', value, iteration)``), to W&B through
``megatron.training.get_wandb_writer()`` when Megatron-LM has one, and prints one console line.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ..metric import Metric, MetricCollection, Number
from .framework_loop import BridgeLoop, last_rank

VALIDATION = "validation"  # the prefix of the keys of an evaluation on the validation set
TEST = "test"  # and on the test set (Megatron-Bridge's on_test_end)


def is_evaluation(model: Any, fallback: Sequence[torch.nn.Module] = ()) -> bool:
    """Whether the current microbatch is one of Megatron's ``evaluate()``: autograd off and every model chunk in
    eval mode. ``model``: what the wrapped step receives (a chunk or a list of chunks); ``fallback``: the chunks
    given to ``instrument()``, for a step that takes no ``model``. Reads only host flags."""
    if torch.is_grad_enabled():
        return False
    chunks = [m for m in (model if isinstance(model, (list, tuple)) else [model]) if isinstance(m, torch.nn.Module)]
    chunks = chunks or list(fallback)
    return bool(chunks) and not any(chunk.training for chunk in chunks)


class Validation:
    """A copy of the instrumented metrics (fresh states) fed by evaluation microbatches; see the module docstring.

    ``metrics``: the metrics ``instrument()`` feeds, copied before any of them holds a state.
    """

    def __init__(self, metrics: Sequence[Metric]) -> None:
        self.metrics = MetricCollection(copy.deepcopy(list(metrics)))

    def calculate(self, model: Any = None, prefix: str = VALIDATION) -> dict[str, Number]:
        """``{'validation/<key>': value}`` over the batches evaluated since the last call (collective: every rank
        calls it; every rank gets the same dict; ``{}`` when nothing was evaluated). ``model`` is ignored: it is
        there so that this method is Megatron-LM's ``non_loss_data_func(model)``."""
        return {f"{prefix}/{key}": value for key, value in self.metrics.calculate().items()}

    def write(self, values: Optional[dict], iteration: int, writer: Any) -> None:
        """Megatron-LM's ``process_non_loss_data_func(collected, iteration, writer)``: ``values`` (what
        :meth:`calculate` returned) to the TensorBoard ``writer`` and W&B at the evaluation's ``iteration``,
        and one console line. Called by Megatron-LM on the last rank only."""
        if not values:
            return
        if writer is not None:
            for key, value in values.items():
                writer.add_scalar(key, value, iteration)
        wandb_writer = _megatron_wandb_writer()
        if wandb_writer is not None:
            wandb_writer.log(dict(values), iteration)
        print_values(values, iteration)

    def pretrain_hooks(self) -> dict[str, Callable]:
        """The keywords for Megatron-LM's ``pretrain()``: ``non_loss_data_func`` (:meth:`calculate`, every rank)
        and ``process_non_loss_data_func`` (:meth:`write`, the last rank)."""
        return {"non_loss_data_func": self.calculate, "process_non_loss_data_func": self.write}


    def bridge_callbacks(self) -> list:
        """Megatron-Bridge's ``pretrain(config, forward_step, callbacks=...)``: see :class:`BridgeValidation`."""
        return [BridgeValidation(self)]


class BridgeValidation:
    """A Megatron-Bridge callback (duck-typed: Bridge's ``CallbackManager.add`` registers every ``on_<event>``
    method): at the end of each evaluation (``on_eval_end``, every rank, after the last batch: a safe point for a
    collective) the values of :meth:`Validation.calculate` go to Bridge's loggers at ``state.train_state.step``
    (:class:`~.framework_loop.BridgeLoop`) and one console line is printed on the last rank; ``on_test_end`` does
    the same for the test set's evaluation, as ``test/<key>``."""

    def __init__(self, validation: Validation) -> None:
        self.validation = validation

    def on_eval_end(self, context: Any) -> None:
        self._write(context.state, VALIDATION)

    def on_test_end(self, context: Any) -> None:
        self._write(context.state, TEST)

    def _write(self, state: Any, prefix: str) -> None:
        values = self.validation.calculate(prefix=prefix)
        if not values:
            return
        iteration = int(state.train_state.step)
        BridgeLoop(state).write(values, iteration)
        if dist.get_rank() == last_rank():
            print_values(values, iteration)


def print_values(values: dict, iteration: int) -> None:
    """One console line: `` validation at iteration N | accuracy: 5.1E-01 | ...`` (Megatron's number format)."""
    prefix = next(iter(values)).split("/", 1)[0]
    print(f" {prefix} at iteration {iteration} | " + " | ".join(
        f"{key[len(prefix) + 1:]}: {value if isinstance(value, int) else format(value, '.6E')}"
        for key, value in values.items()), flush=True)


def _megatron_wandb_writer() -> Any:
    """Megatron-LM's W&B writer on this rank, or None (no Megatron-LM training package, or no writer here)."""
    try:
        from megatron.training import get_wandb_writer
    except (ImportError, RuntimeError, OSError):
        return None
    try:
        return get_wandb_writer()
    except Exception:  # noqa: BLE001 - its global state may be uninitialised outside pretrain()
        return None
