"""Megatron-Bridge 0.6.2's training loop around its own ``train_step``, ``training_log`` and evaluation (test support).

Bridge's ``train()`` (``megatron/bridge/training/train.py``) also sets up checkpointing, fault tolerance,
straggler detection, CUDA graphs, FLOP counting and profiling, none of which runs on CPU ranks. :func:`train`
below is its iteration, in its order, calling Bridge's functions unmodified (``kit.megatron_bridge``):

1. ``on_train_step_start`` (Bridge's ``CallbackManager``);
2. ``train_step(prepare_forward_step_func(forward_step, state), ...)``: zero the grad buffers, megatron-core's
   forward-backward schedule (which ends with the model config's ``finalize_model_grads_func``), the
   optimizer's step and its grad norm, the loss reports pooled over microbatches and DP×CP;
3. ``on_train_step_end``; ``state.train_state.step += 1``; ``consumed_train_samples += global batch``;
4. ``training_log(...)`` with the optimizer's loss scale and learning rate (the console line on the last rank,
   the loss reports and the grad norm to the ``GlobalState``'s loggers at ``tensorboard_log_interval``);
5. every ``cfg.validation.eval_interval`` steps, ``evaluate_and_print_results(state, "iteration N",
   forward_step, ...)`` with the same ``CallbackManager`` (``on_eval_*``).

What it leaves out: memory reports (``report_memory_flag`` is False: they read CUDA's allocator), throughput and
FLOPs (``floating_point_operations_so_far`` stays 0), checkpoints, the exit conditions.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Iterator, Optional, Sequence

from megatron.core.distributed import finalize_model_grads
from megatron.core.num_microbatches_calculator import get_num_microbatches
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.utils import get_model_config

from kit.megatron_bridge import Bridge

__all__ = ["TrainResult", "configure_model_like_bridge", "learning_rates", "train"]


def configure_model_like_bridge(model: Sequence[Any], optimizer: Any) -> None:
    """What Bridge's ``setup()`` sets on the model config once the model and optimizer exist
    (``setup.py: _update_model_config_funcs``, without overlapped communication): Megatron's
    ``finalize_model_grads`` bound to the process groups, and the optimizer's loss scaling."""
    config = get_model_config(model[0])
    config.finalize_model_grads_func = partial(finalize_model_grads,
                                               pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    config.grad_scale_func = optimizer.scale_loss


class TrainResult:
    """What the loop saw, per iteration: Bridge's pooled loss reports and its grad norm (from ``train_step``)."""

    def __init__(self) -> None:
        self.loss_dicts: dict[int, dict[str, float]] = {}
        self.grad_norms: dict[int, Optional[float]] = {}
        self.validations: dict[int, Optional[dict[str, float]]] = {}


def learning_rates(optimizer: Any) -> tuple[Optional[float], Optional[float]]:
    """Bridge's reading of the optimizer's learning rates: ``(learning_rate, decoupled_learning_rate)``."""
    learning_rate = decoupled = None
    for group in optimizer.param_groups:
        if len(group) == 0:
            continue
        if group["is_decoupled_lr"]:
            decoupled = group["lr"]
        else:
            learning_rate = group["lr"]
    return learning_rate, decoupled


def train(bridge: Bridge, state: Any, forward_step: Any, model: Sequence[Any], optimizer: Any, scheduler: Any,
          train_data: Iterator, iterations: int, *, valid_data: Optional[Iterator] = None,
          callbacks: Any = None) -> TrainResult:
    """``iterations`` steps of Bridge's loop (see the module docstring) on this rank; ``callbacks``: what a user
    hands Bridge's ``pretrain(..., callbacks=)`` (a list of ``Callback``\\ s or a ``CallbackManager``)."""
    cfg = state.cfg
    model = list(model)
    pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    manager = bridge.callbacks.normalize_callbacks(callbacks)
    fire = bridge.callbacks.should_fire
    context = bridge.callbacks.CallbackContext
    prepared = bridge.train_utils.prepare_forward_step_func(forward_step, state)
    forward_backward = get_forward_backward_func(pp_size=pg_collection.pp.size(),
                                                 vp_size=cfg.model.virtual_pipeline_model_parallel_size)
    model_config = get_model_config(model[0])
    p2p = P2PCommunicator(pp_group=pg_collection.pp, config=model_config)
    for chunk in model:
        chunk.train()
    result = TrainResult()
    total_loss_dict: dict = {}
    state.timers("interval-time", log_level=0).start(barrier=True)
    for _ in range(iterations):
        if fire(manager, "on_train_step_start"):
            manager.fire("on_train_step_start", context(state=state, model=model, user_state=manager.user_state,
                                                        optimizer=optimizer, scheduler=scheduler))
        loss_dict, skipped, _, should_exit, _, grad_norm, zeros, max_logit = bridge.train.train_step(
            prepared, train_data, model, optimizer, scheduler, state, pg_collection, forward_backward, p2p)
        assert not should_exit, "Bridge's rerun state machine asked to exit"
        if fire(manager, "on_train_step_end"):
            manager.fire("on_train_step_end", context(state=state, model=model, user_state=manager.user_state,
                                                      optimizer=optimizer, scheduler=scheduler, loss_dict=loss_dict,
                                                      grad_norm=grad_norm, skipped_iter=bool(skipped)))
        state.train_state.step += 1
        step = state.train_state.step
        state.train_state.consumed_train_samples += (cfg.data_parallel_size * cfg.train.micro_batch_size
                                                     * get_num_microbatches())
        result.loss_dicts[step] = {key: float(value) for key, value in loss_dict.items()}
        result.grad_norms[step] = grad_norm
        learning_rate, decoupled = learning_rates(optimizer)
        bridge.train_utils.training_log(loss_dict, total_loss_dict, learning_rate, decoupled,
                                        optimizer.get_loss_scale().item(), False, skipped, grad_norm, None, zeros,
                                        cfg, state, None, model, pg_collection=pg_collection,
                                        log_max_attention_logit=max_logit, loaded_iteration=0, seq_length=None)
        interval = cfg.validation.eval_interval
        if valid_data is not None and interval and step % interval == 0:
            state.timers("interval-time").stop()
            values = bridge.eval.evaluate_and_print_results(state, f"iteration {step}", forward_step, valid_data,
                                                            model, model_config, verbose=False,
                                                            write_to_tensorboard=True, callback_manager=manager)
            result.validations[step] = {key: float(value) for key, value in (values or {}).items()}
            state.timers("interval-time", log_level=0).start(barrier=True)
    return result
