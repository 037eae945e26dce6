"""Megatron-LM's ``train()`` loop, mirrored line for line where the plugin meets it, on megatron-core's CPU schedules.

Megatron-LM's training code (``megatron/training/``) is not on the package index, so this module mirrors the parts
of it that the plugin's one line (``pretrain(..., metrics.wrap(forward_step), **metrics.pretrain_hooks())``) meets,
read at tag ``core_v0.16.1`` (``git show core_v0.16.1:megatron/training/training.py``); each block names its file
and lines. Everything else is real megatron-core: the schedules (``get_forward_backward_func``), Megatron's DDP and
optimizer (``kit.megatron_training.build_trained_gpt``), ``finalize_model_grads``, the microbatch calculator, the
learning-rate scheduler, MoE's ``track_moe_metrics``. Inside a worker of ``twinkle_megatron.testing.distributed``
and ``cpu_cuda_shim()``::

    args = MegatronLMArgs(micro_batch_size=2, global_batch_size=8, seq_length=8, train_iters=4)
    writers = install_megatron_training(args)               # megatron.training in sys.modules (this process)
    chunks, optimizer = build_trained_gpt(spec)
    train(step, chunks, optimizer, constant_lr_scheduler(optimizer, args), train_data_iterator(chunks, batch_of),
          None, None, get_model_config(chunks[0]))
    writers.tensorboard.scalars                              # [(key, value, iteration), ...] on the last rank

What is mirrored (``training.py`` at ``core_v0.16.1``):

- ``train`` (L2417-3032): ``iteration = args.iteration`` (L2523: where a resumed run starts, set by
  ``load_checkpoint``), ``config.grad_scale_func``, ``config.finalize_model_grads_func = finalize_model_grads``
  (L2546-2565; ``core_v0.19.0`` keeps a finalize function already set), then per iteration
  ``args.curr_iteration = iteration`` (L2765), ``train_step``, ``iteration += 1`` (L2839),
  ``args.consumed_train_samples += batch_size`` (L2858-2869), the loss scale and learning rate (L2886-2895),
  ``training_log`` (L2896), the evaluation at ``eval_interval`` (L2913-2951).
- ``train_step`` (L1603-1770): ``zero_grad_buffer`` / ``optimizer.zero_grad()``, ``forward_backward_func``,
  ``optimizer.step()`` -> ``update_successful, grad_norm, num_zeros_in_grad``, the model-parallel reductions of
  those (``utils.py`` L243-276), the scheduler step, the loss-report pooling over DP×CP on the last stage.
- ``training_log`` (L1773-2111): every TensorBoard / W&B write at ``tensorboard_log_interval`` (learning rate,
  batch size, every loss key, loss scale, ``grad-norm``, ``num-zeros``; the ``vs samples`` twins at
  ``consumed_train_samples``), MoE's ``track_moe_metrics`` (L1954-1981), the console line at ``log_interval``
  (averages over the interval; printed when ``avg > 0`` at ``core_v0.16.1``, ``avg >= 0`` at ``core_v0.19.0``,
  ``args.release``).
- ``evaluate`` (L3035-3189) and ``evaluate_and_print_results`` (L3192-3281).
- ``global_vars.py`` (L27-50, L170-220): ``get_args``, ``get_tensorboard_writer``, ``get_wandb_writer``; the writers
  exist on the last rank only (``args.rank == args.world_size - 1``).

Left out (no part of what the plugin meets): timers, the rerun state machine (one pass: ``should_run_forward_backward``
is True once), checkpoints, profiling, straggler detection, energy, RL, FSDP, CUDA graphs, memory reports, the
first-iteration console line (``is_first_iteration``: the console line at iteration 1 is printed when
``log_interval`` divides it, like later ones).

Writers: :class:`RecordingWriter` (TensorBoard's ``SummaryWriter.add_scalar``) and :class:`RecordingWandb`
(``wandb.log(dict, step)``), each call recorded as ``(key, value, step)``. Printed lines (``print_rank_last``) go to
stdout; capture it with ``contextlib.redirect_stdout``.
"""

from __future__ import annotations

import math
import sys
import types
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.distributed import finalize_model_grads
from megatron.core.num_microbatches_calculator import (
    destroy_num_microbatches_calculator,
    get_num_microbatches,
    init_num_microbatches_calculator,
)
from megatron.core.pipeline_parallel import get_forward_backward_func

from kit.megatron_gpt import local_microbatches

__all__ = ["MegatronLMArgs", "MegatronLMWriters", "RecordingWandb", "RecordingWriter", "constant_lr_scheduler",
           "evaluate", "evaluate_and_print_results", "install_megatron_training", "is_last_rank", "print_rank_last",
           "train", "train_data_iterator", "train_step", "training_log"]

RELEASES = ("core_v0.16.1", "core_v0.19.0")


@dataclass
class MegatronLMArgs:
    """The fields of Megatron-LM's ``args`` (``arguments.py``) the mirrored code reads, with its defaults where they
    matter. ``release``: which tag's console rule ``training_log`` follows (:data:`RELEASES`)."""

    micro_batch_size: int
    global_batch_size: int
    seq_length: int
    train_iters: int
    lr: float = 1e-3
    iteration: int = 0
    curr_iteration: int = 0
    consumed_train_samples: int = 0
    skipped_train_samples: int = 0
    consumed_valid_samples: int = 0
    log_interval: int = 1
    tensorboard_log_interval: int = 1
    eval_interval: Optional[int] = None
    eval_iters: int = 1
    do_valid: bool = True
    log_validation_ppl_to_tensorboard: bool = False
    log_loss_scale_to_tensorboard: bool = True
    log_num_zeros_in_grad: bool = False
    tensorboard_dir: Optional[str] = None
    wandb_project: str = ""
    save: Optional[str] = None
    decoder_seq_length: Optional[int] = None
    num_experts: Optional[int] = None
    num_layers: Optional[int] = None
    moe_router_load_balancing_type: str = "aux_loss"
    moe_z_loss_coeff: Optional[float] = None
    moe_per_layer_logging: bool = False
    multiple_validation_sets: bool = False
    full_validation: bool = False
    sft: bool = False
    release: str = "core_v0.16.1"
    rank: int = 0
    world_size: int = 1
    data_parallel_size: int = 1


class RecordingWriter:
    """A TensorBoard ``SummaryWriter``'s ``add_scalar``, recorded as ``(key, value, step)``."""

    def __init__(self) -> None:
        self.scalars: list[tuple[str, float, int]] = []

    def add_scalar(self, key: str, value: Any, step: int) -> None:
        self.scalars.append((key, float(value), int(step)))


class RecordingWandb:
    """What Megatron-LM's W&B writer is (the ``wandb`` module): ``log(dict, step)``, recorded per key."""

    def __init__(self) -> None:
        self.logged: list[tuple[str, float, int]] = []

    def log(self, data: Mapping[str, Any], step: Optional[int] = None, commit: Any = None) -> None:
        self.logged.extend((key, float(value), int(step)) for key, value in data.items())


@dataclass
class MegatronLMWriters:
    """This rank's writers as ``global_vars.py`` sets them: None except on the last rank."""

    tensorboard: Optional[RecordingWriter]
    wandb: Optional[RecordingWandb]


def install_megatron_training(args: MegatronLMArgs, *, tensorboard: bool = True, wandb: bool = True
                              ) -> MegatronLMWriters:
    """``megatron.training`` (and ``megatron.training.global_vars``) in ``sys.modules`` of this (forked worker)
    process, holding ``args`` and this rank's writers; also the microbatch calculator (``set_global_variables``,
    ``global_vars.py`` L85-118). Fills ``args.rank``, ``world_size`` and ``data_parallel_size`` from the world and
    parallel_state."""
    args.rank, args.world_size = dist.get_rank(), dist.get_world_size()
    args.data_parallel_size = mpu.get_data_parallel_world_size()
    last = args.rank == args.world_size - 1  # global_vars.py L176-177, L194
    writers = MegatronLMWriters(RecordingWriter() if tensorboard and last else None,
                                RecordingWandb() if wandb and last else None)
    global_vars = types.ModuleType("megatron.training.global_vars")
    global_vars.get_args = lambda: args
    global_vars.get_tensorboard_writer = lambda: writers.tensorboard
    global_vars.get_wandb_writer = lambda: writers.wandb
    package = types.ModuleType("megatron.training")
    package.__path__ = []  # a package: megatron/training/__init__.py re-exports these (L5-18)
    for name in ("get_args", "get_tensorboard_writer", "get_wandb_writer"):
        setattr(package, name, getattr(global_vars, name))
    package.global_vars = global_vars
    package.is_last_rank, package.print_rank_last = is_last_rank, print_rank_last
    sys.modules["megatron.training"], sys.modules["megatron.training.global_vars"] = package, global_vars
    destroy_num_microbatches_calculator()
    init_num_microbatches_calculator(args.rank, None, args.global_batch_size, args.micro_batch_size,
                                     args.data_parallel_size)
    return writers


def _args() -> MegatronLMArgs:
    return sys.modules["megatron.training"].get_args()


def _writers() -> tuple[Any, Any]:
    training = sys.modules["megatron.training"]
    return training.get_tensorboard_writer(), training.get_wandb_writer()


# ------------------------------------------------------------------ utils.py (core_v0.16.1)


def is_last_rank() -> bool:
    """``utils.py`` L419-422."""
    return dist.get_rank() == dist.get_world_size() - 1


def print_rank_last(message: str) -> None:
    """``utils.py`` L425-431."""
    if is_last_rank():
        print(message, flush=True)


def reduce_max_stat_across_model_parallel_group(stat: Optional[float]) -> Optional[float]:
    """``utils.py`` L243-261: max over the model-parallel group; None where no rank has the value."""
    if stat is None:
        stat = -1.0
    stat = torch.tensor([stat], dtype=torch.float32)
    dist.all_reduce(stat, op=dist.ReduceOp.MAX, group=mpu.get_model_parallel_group())
    if stat.item() == -1.0:
        return None
    return stat.item()


def logical_and_across_model_parallel_group(value: bool) -> bool:
    """``utils.py`` L264-276."""
    flag = torch.tensor([1 if value is True else 0], dtype=torch.int)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=mpu.get_model_parallel_group())
    return bool(flag.item())


def canonical_lr(param_groups: Sequence[dict]) -> Optional[float]:
    """``get_canonical_lr_for_logging`` (megatron-core's ``optimizer_param_scheduler.py``, which training.py L2895
    calls): the first ``default_config`` group's lr; releases without it: the last group's (older loops)."""
    try:
        from megatron.core.optimizer_param_scheduler import get_canonical_lr_for_logging
    except ImportError:
        return param_groups[-1]["lr"] if param_groups else None
    return get_canonical_lr_for_logging(param_groups)


def constant_lr_scheduler(optimizer: Any, args: MegatronLMArgs) -> Any:
    """megatron-core's ``OptimizerParamScheduler`` with a constant ``args.lr`` (what ``get_optimizer_param_scheduler``
    builds for ``--lr-decay-style constant`` without warmup, training.py L1354-1407)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    steps = args.train_iters * args.global_batch_size
    return OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.lr, lr_warmup_steps=0,
                                   lr_decay_steps=steps, lr_decay_style="constant", start_wd=0.0, end_wd=0.0,
                                   wd_incr_steps=steps, wd_incr_style="constant")


# ------------------------------------------------------------------ data


def train_data_iterator(model: Sequence[torch.nn.Module], batch_of_iteration: Callable[[int], Mapping],
                        first_iteration: int = 0) -> Any:
    """Megatron-LM's ``train_data_iterator``: an endless iterator over this rank's microbatches in
    ``MegatronPretrainingSampler`` order (global batch ``batch_of_iteration(i)`` of iteration ``i``, cut by
    ``kit.megatron_gpt.local_microbatches``: DP rank, microbatch, then the CP chunks of ``get_batch_on_this_cp_rank``);
    with virtual pipeline stages one iterator per chunk over the same data (``pretrain``, training.py L978-996)."""
    micro_batch_size = _args().micro_batch_size

    def stream() -> Iterator[dict]:
        iteration = first_iteration
        while True:
            yield from local_microbatches(batch_of_iteration(iteration), micro_batch_size)
            iteration += 1

    iterators = [stream() for _ in model]
    return iterators if len(iterators) > 1 else iterators[0]


# ------------------------------------------------------------------ train_step (training.py L1603-1770)


def train_step(forward_step_func: Callable, data_iterator: Any, model: Sequence[torch.nn.Module], optimizer: Any,
               opt_param_scheduler: Any, config: Any, forward_backward_func: Callable, iteration: int
               ) -> tuple[dict, int, Optional[float], Optional[float]]:
    """One training step; returns ``(loss_reduced, skipped_iter, grad_norm, num_zeros_in_grad)`` (the real one also
    returns the checkpoint/exit flags and the max attention logit, left out)."""
    args = _args()
    # L1611-1618: one pass of the rerun loop; zero the gradients.
    for model_chunk in model:
        model_chunk.zero_grad_buffer()
    optimizer.zero_grad()
    # L1649-1661: forward and backward of every microbatch; finalize_model_grads_func runs at its end.
    losses_reduced = forward_backward_func(
        forward_step_func=forward_step_func,
        data_iterator=data_iterator,
        model=model if len(model) > 1 else model[0],  # the schedules take a list; one chunk as it is (both work)
        num_microbatches=get_num_microbatches(),
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        decoder_seq_length=args.decoder_seq_length,
        forward_only=False,
    )
    # L1703: the optimizer step.
    update_successful, grad_norm, num_zeros_in_grad = optimizer.step()
    # L1713-1719: agree over the model-parallel group.
    update_successful = logical_and_across_model_parallel_group(update_successful)
    grad_norm = reduce_max_stat_across_model_parallel_group(grad_norm)
    if args.log_num_zeros_in_grad:
        num_zeros_in_grad = reduce_max_stat_across_model_parallel_group(num_zeros_in_grad)
    # L1726-1731: the learning-rate scheduler.
    if update_successful:
        increment = get_num_microbatches() * args.micro_batch_size * args.data_parallel_size
        opt_param_scheduler.step(increment=increment)
        skipped_iter = 0
    else:
        skipped_iter = 1
    # L1737-1770: on the last stage, every report key pooled over the microbatches and DP×CP.
    if mpu.is_pipeline_last_stage(ignore_virtual=True):
        return pool_training_losses(losses_reduced), skipped_iter, grad_norm, num_zeros_in_grad
    return {}, skipped_iter, grad_norm, num_zeros_in_grad


def pool_training_losses(losses_reduced: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """``train_step``'s pooling (L1739-1758): the keys of the first microbatch's report; ``[sum, count]`` entries
    summed over microbatches, all-reduced over DP×CP, ``sum / count``; one-element entries averaged."""
    loss_reduced = {}
    for key in losses_reduced[0].keys():
        val = [x[key].view(-1) for x in losses_reduced]
        if val[0].numel() == 2:
            val = torch.vstack(val).sum(dim=0)
            dist.all_reduce(val, group=mpu.get_data_parallel_group(with_context_parallel=True))
            loss_reduced[key] = val[0] / val[1]
        elif val[0].numel() == 1:
            loss_reduced[key] = torch.cat(val).mean()
        else:
            raise ValueError(f"Invalid value shape: {val[0].shape} for key {key}")
    return loss_reduced


# ------------------------------------------------------------------ training_log (training.py L1773-2111)

ADVANCED, SKIPPED, NAN = "advanced iterations", "skipped iterations", "nan iterations"


def training_log(loss_dict: Mapping[str, torch.Tensor], total_loss_dict: dict, learning_rate: Optional[float],
                 iteration: int, loss_scale: float, skipped_iter: int, grad_norm: Optional[float],
                 num_zeros_in_grad: Optional[float]) -> None:
    """The writes and the console line of one iteration (``params_norm`` and the timers left out)."""
    args = _args()
    writer, wandb_writer = _writers()
    _count_iterations(loss_dict, total_loss_dict, skipped_iter)
    batch_size = args.micro_batch_size * args.data_parallel_size * get_num_microbatches()  # L1869
    learning_rate = reduce_max_stat_across_model_parallel_group(learning_rate)  # L1877
    if writer and iteration % args.tensorboard_log_interval == 0:
        _write_tensorboard(writer, wandb_writer, loss_dict, learning_rate, iteration, loss_scale, batch_size,
                           grad_norm, num_zeros_in_grad)
    if args.num_experts is not None:
        _track_moe_metrics(iteration, writer, wandb_writer, total_loss_dict)
    if iteration % args.log_interval == 0:
        print_rank_last(_console_line(total_loss_dict, learning_rate, iteration, loss_scale, batch_size, grad_norm,
                                      num_zeros_in_grad))


def _count_iterations(loss_dict: Mapping[str, torch.Tensor], total_loss_dict: dict, skipped_iter: int) -> None:
    """L1798-1820: advanced / skipped / nan iterations; every loss key summed over the interval."""
    if not skipped_iter:
        total_loss_dict[ADVANCED] = total_loss_dict.get(ADVANCED, 0) + 1
    elif ADVANCED not in total_loss_dict:
        total_loss_dict[ADVANCED] = 0
    total_loss_dict[SKIPPED] = total_loss_dict.get(SKIPPED, 0) + skipped_iter
    got_nan = False
    for key in loss_dict:
        if not skipped_iter:
            total_loss_dict[key] = total_loss_dict.get(key, torch.tensor([0.0], dtype=torch.float)) + loss_dict[key]
        else:
            value = loss_dict[key].float().sum().item()
            got_nan = got_nan or value in (float("inf"), -float("inf")) or value != value
    total_loss_dict[NAN] = total_loss_dict.get(NAN, 0) + int(got_nan)


def _write_tensorboard(writer: Any, wandb_writer: Any, loss_dict: Mapping[str, torch.Tensor],
                       learning_rate: Optional[float], iteration: int, loss_scale: float, batch_size: int,
                       grad_norm: Optional[float], num_zeros_in_grad: Optional[float]) -> None:
    """L1879-1952 (the ones this loop has): learning rate, batch size, every loss key, loss scale, grad norm,
    num zeros; each with its ``vs samples`` twin on TensorBoard and its W&B entry."""
    args = _args()
    samples = args.consumed_train_samples
    if wandb_writer:
        wandb_writer.log({"samples vs steps": samples}, iteration)
    if learning_rate is not None:
        writer.add_scalar("learning-rate", learning_rate, iteration)
        writer.add_scalar("learning-rate vs samples", learning_rate, samples)
        if wandb_writer:
            wandb_writer.log({"learning-rate": learning_rate}, iteration)
    if args.skipped_train_samples > 0:
        writer.add_scalar("skipped-train-samples", args.skipped_train_samples, iteration)
        if wandb_writer:
            wandb_writer.log({"skipped-train-samples": args.skipped_train_samples}, iteration)
    writer.add_scalar("batch-size", batch_size, iteration)
    writer.add_scalar("batch-size vs samples", batch_size, samples)
    if wandb_writer:
        wandb_writer.log({"batch-size": batch_size}, iteration)
    for key in loss_dict:
        writer.add_scalar(key, loss_dict[key], iteration)
        writer.add_scalar(key + " vs samples", loss_dict[key], samples)
        if wandb_writer:
            wandb_writer.log({key: loss_dict[key]}, iteration)
    if args.log_loss_scale_to_tensorboard:
        writer.add_scalar("loss-scale", loss_scale, iteration)
        writer.add_scalar("loss-scale vs samples", loss_scale, samples)
        if wandb_writer:
            wandb_writer.log({"loss-scale": loss_scale}, iteration)
    if grad_norm is not None:
        writer.add_scalar("grad-norm", grad_norm, iteration)
        writer.add_scalar("grad-norm vs samples", grad_norm, samples)
        if wandb_writer:
            wandb_writer.log({"grad-norm": grad_norm}, iteration)
    if num_zeros_in_grad is not None:
        writer.add_scalar("num-zeros", num_zeros_in_grad, iteration)
        writer.add_scalar("num-zeros vs samples", num_zeros_in_grad, samples)
        if wandb_writer:
            wandb_writer.log({"num-zeros": num_zeros_in_grad}, iteration)


def _track_moe_metrics(iteration: int, writer: Any, wandb_writer: Any, total_loss_dict: dict) -> None:
    """L1954-1981: megatron-core's ``track_moe_metrics`` (the router losses' TensorBoard / W&B entries)."""
    from megatron.core.transformer.moe.moe_utils import track_moe_metrics

    args = _args()
    track_names = []
    if "aux_loss" in args.moe_router_load_balancing_type:
        track_names.append("load_balancing_loss")
    if args.moe_z_loss_coeff is not None:
        track_names.append("z_loss")
    track_moe_metrics(loss_scale=1 / get_num_microbatches(), iteration=iteration, writer=writer,
                      wandb_writer=wandb_writer, total_loss_dict=total_loss_dict,
                      per_layer_logging=args.moe_per_layer_logging, force_initialize=True, track_names=track_names,
                      num_layers=args.num_layers)


def _console_line(total_loss_dict: dict, learning_rate: Optional[float], iteration: int, loss_scale: float,
                  batch_size: int, grad_norm: Optional[float], num_zeros_in_grad: Optional[float]) -> str:
    """L2037-2095: the console line (the interval's averages, then the interval restarts). Megatron-LM prints an
    average when ``avg > 0.0`` (``core_v0.16.1``, L2069) or ``avg >= 0.0`` (``core_v0.19.0``, its L2881)."""
    args = _args()
    log_string = f" [{datetime.now().strftime('%Y-%m-%d %H:%M:%S.%f')}]"
    log_string += f" iteration {iteration:8d}/{args.train_iters:8d} |"
    log_string += f" consumed samples: {args.consumed_train_samples:12d} |"
    if args.skipped_train_samples > 0:
        log_string += f" skipped samples: {args.skipped_train_samples:12d} |"
    log_string += f" learning rate: {learning_rate:.6E} |"
    log_string += f" global batch size: {batch_size:5d} |"
    for key in total_loss_dict:
        if key not in [ADVANCED, SKIPPED, NAN]:
            avg = total_loss_dict[key].item() / float(max(1, total_loss_dict[ADVANCED]))
            if avg > 0.0 or args.release == "core_v0.19.0" and avg >= 0.0:
                log_string += f" {key}: {avg:.6E} |"
            total_loss_dict[key] = torch.tensor([0.0], dtype=torch.float)
    log_string += f" loss scale: {loss_scale:.1f} |"
    if grad_norm is not None:
        log_string += f" grad norm: {grad_norm:.3f} |"
    if num_zeros_in_grad is not None:
        log_string += f" num zeros: {num_zeros_in_grad} |"
    log_string += f" number of skipped iterations: {total_loss_dict[SKIPPED]:3d} |"
    log_string += f" number of nan iterations: {total_loss_dict[NAN]:3d} |"
    total_loss_dict[ADVANCED] = total_loss_dict[SKIPPED] = total_loss_dict[NAN] = 0
    return log_string


# ------------------------------------------------------------------ train (training.py L2417-3033)


def train(forward_step_func: Callable, model: Sequence[torch.nn.Module], optimizer: Any, opt_param_scheduler: Any,
          train_data_iterator: Any, valid_data_iterator: Any, process_non_loss_data_func: Optional[Callable],
          config: Any, non_loss_data_func: Optional[Callable] = None,
          after_iteration: Optional[Callable[[int], None]] = None) -> int:
    """Iterations ``args.iteration`` up to ``args.train_iters``; returns the last one (``pretrain``'s ``iteration``,
    L1066-1072). ``after_iteration(iteration)``: a test's probe after each iteration's log and evaluation (where
    Megatron-LM runs its checkpoint and exit checks, L2971-2990)."""
    args = _args()
    model = list(model)
    total_loss_dict: dict = {}  # L2520
    iteration = args.iteration  # L2523
    # L2546-2565: the config the schedules read.
    config.grad_scale_func = optimizer.scale_loss
    config.timers = None  # the timers are left out (the schedules skip them when None)
    # core_v0.16.1 sets it unconditionally; core_v0.19.0 (its L3548-3550) keeps one a model builder installed.
    if args.release != "core_v0.19.0" or config.finalize_model_grads_func is None:
        config.finalize_model_grads_func = finalize_model_grads
    forward_backward_func = get_forward_backward_func()  # L2606
    while iteration < args.train_iters:  # L2684
        args.curr_iteration = iteration  # L2765
        loss_dict, skipped_iter, grad_norm, num_zeros_in_grad = train_step(
            forward_step_func, train_data_iterator, model, optimizer, opt_param_scheduler, config,
            forward_backward_func, iteration=iteration)  # L2786-2797
        iteration += 1  # L2839
        batch_size = mpu.get_data_parallel_world_size() * args.micro_batch_size * get_num_microbatches()
        args.consumed_train_samples += batch_size  # L2862-2869
        loss_scale = optimizer.get_loss_scale().item()  # L2886-2890
        learning_rate = canonical_lr(optimizer.param_groups)  # L2895
        training_log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale, skipped_iter, grad_norm,
                     num_zeros_in_grad)  # L2896-2910
        if args.eval_interval and iteration % args.eval_interval == 0 and args.do_valid:  # L2913-2951
            prefix = f"iteration {iteration}"
            evaluate_and_print_results(prefix, forward_step_func, valid_data_iterator, model, iteration,
                                       process_non_loss_data_func, config, verbose=False, write_to_tensorboard=True,
                                       non_loss_data_func=non_loss_data_func)
            if args.num_experts is not None:
                from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

                clear_aux_losses_tracker()  # L2967-2968
        if after_iteration is not None:
            after_iteration(iteration)
    return iteration


# ------------------------------------------------------------------ evaluate (training.py L3035-3189)


def evaluate(forward_step_func: Callable, data_iterator: Any, model: Sequence[torch.nn.Module],
             process_non_loss_data_func: Optional[Callable], config: Any, verbose: bool = False,
             non_loss_data_func: Optional[Callable] = None, eval_iters: Optional[int] = None
             ) -> tuple[dict, Any, bool]:
    """``(total_loss_dict, collected_non_loss_data, timelimit)``: every chunk ``.eval()``; under ``torch.no_grad()``
    ``eval_iters`` forward-only schedule runs of a global batch; on the last stage every key pooled over the
    microbatches and DP×CP; ``non_loss_data_func(model)`` on every rank; every chunk ``.train()``; ``sum / count``.
    (``--sft``'s per-microbatch normalisation, the time limit and the ``collect_non_loss_data`` pass are left out.)"""
    args = _args()
    model = list(model)
    for model_module in model:  # L3053-3054
        model_module.eval()
    total_loss_dict: dict[str, torch.Tensor] = {}
    eval_batch_size = args.global_batch_size  # L3068-3069
    eval_num_microbatches = eval_batch_size // (args.micro_batch_size * args.data_parallel_size)
    forward_backward_func = get_forward_backward_func()
    if eval_iters is None:
        eval_iters = args.eval_iters
    with torch.no_grad():  # L3077-3168
        iteration = 0
        while iteration < eval_iters:
            iteration += 1
            loss_dicts = forward_backward_func(
                forward_step_func=forward_step_func,
                data_iterator=data_iterator,
                model=model if len(model) > 1 else model[0],
                num_microbatches=eval_num_microbatches,
                seq_length=args.seq_length,
                micro_batch_size=args.micro_batch_size,
                decoder_seq_length=args.decoder_seq_length,
                forward_only=True,
            )
            if mpu.is_pipeline_last_stage(ignore_virtual=True):  # L3107-3145
                for key in loss_dicts[0].keys():
                    if key not in total_loss_dict:
                        total_loss_dict[key] = torch.tensor([0.0, 0.0], dtype=torch.float)
                    val = [x[key].view(-1) for x in loss_dicts]
                    if val[0].numel() == 2:
                        val = torch.vstack(val).sum(dim=0)
                        dist.all_reduce(val, group=mpu.get_data_parallel_group(with_context_parallel=True))
                        total_loss_dict[key] += val
                    elif val[0].numel() == 1:
                        val = torch.cat(val).sum()
                        total_loss_dict[key][0] += val
                        total_loss_dict[key][1] += len(loss_dicts)
                    else:
                        raise ValueError(f"Invalid value shape: {val[0].shape} for key {key}")
            args.consumed_valid_samples += eval_batch_size  # L3147
        collected_non_loss_data = None
        if non_loss_data_func is not None:  # L3161-3163
            collected_non_loss_data = non_loss_data_func(model)
    for model_module in model:  # L3177-3178
        model_module.train()
    for key in total_loss_dict:  # L3180-3182
        numerator, denominator = total_loss_dict[key]
        total_loss_dict[key] = numerator / denominator
    return total_loss_dict, collected_non_loss_data, False


def evaluate_and_print_results(prefix: str, forward_step_func: Callable, data_iterator: Any,
                               model: Sequence[torch.nn.Module], iteration: int,
                               process_non_loss_data_func: Optional[Callable], config: Any, verbose: bool = False,
                               write_to_tensorboard: bool = True, non_loss_data_func: Optional[Callable] = None
                               ) -> str:
    """L3192-3281 for one validation set: evaluate, then for every key the console string ``<key> value: … | <key>
    PPL: …`` (``exp(min(20, value))``), ``'<key> validation'`` (and ``vs samples``; with
    ``log_validation_ppl_to_tensorboard`` the ``ppl`` pair) on TensorBoard, ``'<key> validation'`` on W&B; then
    ``process_non_loss_data_func(collected, iteration, writer)`` on the last rank when a writer exists; the string
    printed by ``print_rank_last``. Returns that string (the real one returns None)."""
    args = _args()
    writer, wandb_writer = _writers()
    writer = writer if write_to_tensorboard else None
    total_loss_dict, collected_non_loss_data, _ = evaluate(forward_step_func, data_iterator, model,
                                                           process_non_loss_data_func, config, verbose,
                                                           non_loss_data_func, eval_iters=args.eval_iters)
    string = f" validation loss at {prefix} | "
    for key in total_loss_dict:
        string += f"{key} value: {total_loss_dict[key].item():.6E} | "
        ppl = math.exp(min(20, total_loss_dict[key].item()))
        string += f"{key} PPL: {ppl:.6E} | "
        if writer:
            writer.add_scalar(f"{key} validation", total_loss_dict[key].item(), iteration)
            writer.add_scalar(f"{key} validation vs samples", total_loss_dict[key].item(), args.consumed_train_samples)
            if args.log_validation_ppl_to_tensorboard:
                writer.add_scalar(f"{key} validation ppl", ppl, iteration)
                writer.add_scalar(f"{key} validation ppl vs samples", ppl, args.consumed_train_samples)
            if wandb_writer and is_last_rank():
                wandb_writer.log({f"{key} validation": total_loss_dict[key].item()}, iteration)
    if process_non_loss_data_func is not None and writer and is_last_rank():
        process_non_loss_data_func(collected_non_loss_data, iteration, writer)
    length = len(string) + 1
    print_rank_last("-" * length)
    print_rank_last(string)
    print_rank_last("-" * length)
    return string
