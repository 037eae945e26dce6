"""Megatron-LM's ``evaluate`` and ``evaluate_and_print_results``, mirrored for megatron-core's schedules on CPU.

Megatron-LM's training code is not on the package index, so this mirrors what
``megatron/training/training.py`` does at tag ``core_v0.16.1`` (and, for these parts,
unchanged at ``core_v0.19.0``), on the kit's tiny GPT:

- ``evaluate``: every chunk ``.eval()``; under ``torch.no_grad()``, ``eval_iters`` forward-only
  schedule runs; on the last pipeline stage every key of the first microbatch's report is summed
  over the microbatches and all-reduced over DP×CP (``[sum, count]`` entries) or summed with a
  count of one per microbatch (one-element entries); then ``non_loss_data_func(model)`` on every
  rank; every chunk ``.train()``; each key ``sum / count``.
- ``evaluate_and_print_results``: for every key, the console string ``<key> value: … | <key> PPL: …``
  (``exp(min(20, value))``) and ``writer.add_scalar('<key> validation', value, iteration)`` (with
  ``log_validation_ppl_to_tensorboard`` also ``'<key> validation ppl'``); then
  ``process_non_loss_data_func(collected, iteration, writer)`` on the last rank when a writer exists.
  The string is what ``print_rank_last`` prints.

The TensorBoard writer is :class:`RecordingWriter`: ``add_scalar`` calls recorded as
``(key, value, step)`` (Megatron-LM's writer exists on the last rank only).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from kit.megatron_gpt import local_microbatches

__all__ = ["RecordingWriter", "evaluate", "evaluate_and_print_results"]


class RecordingWriter:
    """A TensorBoard ``SummaryWriter``'s ``add_scalar``, recorded."""

    def __init__(self) -> None:
        self.scalars: list[tuple[str, float, int]] = []

    def add_scalar(self, key: str, value: Any, step: int) -> None:
        self.scalars.append((key, float(value), int(step)))


def evaluate(forward_step_func: Callable, batches: Sequence[Mapping[str, torch.Tensor]], model: Sequence[Any], *,
             micro_batch_size: int, non_loss_data_func: Optional[Callable] = None) -> tuple[dict, Any]:
    """One evaluation of ``batches`` (one global batch per ``eval_iters`` iteration); returns
    ``(total_loss_dict, collected_non_loss_data)``: the pooled values on the last stage (``{}`` elsewhere)."""
    for chunk in model:
        chunk.eval()
    total_loss_dict: dict[str, torch.Tensor] = {}
    forward_backward = get_forward_backward_func()
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    with torch.no_grad():
        for batch in batches:
            microbatches = local_microbatches(batch, micro_batch_size)
            iterators = [iter(microbatches) for _ in model]
            loss_dicts = forward_backward(
                forward_step_func=forward_step_func,
                data_iterator=iterators if len(model) > 1 else iterators[0],
                model=list(model) if len(model) > 1 else model[0],
                num_microbatches=len(microbatches), seq_length=batch["tokens"].size(1),
                micro_batch_size=micro_batch_size, forward_only=True)
            if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
                for key in loss_dicts[0].keys():
                    total = total_loss_dict.setdefault(key, torch.zeros(2, dtype=torch.float))
                    values = [report[key].view(-1) for report in loss_dicts]
                    if values[0].numel() == 2:
                        pooled = torch.vstack(values).sum(dim=0)
                        dist.all_reduce(pooled, group=group)
                        total += pooled
                    else:
                        total[0] += torch.cat(values).sum()
                        total[1] += len(loss_dicts)
        collected = non_loss_data_func(model) if non_loss_data_func is not None else None
    for chunk in model:
        chunk.train()
    return {key: total[0] / total[1] for key, total in total_loss_dict.items()}, collected


def evaluate_and_print_results(prefix: str, forward_step_func: Callable, batches: Iterable[Mapping[str, Any]],
                               model: Sequence[Any], iteration: int, *, micro_batch_size: int,
                               writer: Optional[RecordingWriter] = None,
                               process_non_loss_data_func: Optional[Callable] = None,
                               non_loss_data_func: Optional[Callable] = None,
                               log_validation_ppl_to_tensorboard: bool = True) -> str:
    """Evaluate and return the string Megatron-LM prints (its ``print_rank_last``); ``writer``: the last rank's."""
    total_loss_dict, collected = evaluate(forward_step_func, list(batches), model, micro_batch_size=micro_batch_size,
                                          non_loss_data_func=non_loss_data_func)
    string = f" validation loss at {prefix} | "
    for key, value in total_loss_dict.items():
        string += f"{key} value: {value.item():.6E} | "
        ppl = math.exp(min(20, value.item()))
        string += f"{key} PPL: {ppl:.6E} | "
        if writer is not None:
            writer.add_scalar(f"{key} validation", value.item(), iteration)
            if log_validation_ppl_to_tensorboard:
                writer.add_scalar(f"{key} validation ppl", ppl, iteration)
    if process_non_loss_data_func is not None and writer is not None and dist.get_rank() == dist.get_world_size() - 1:
        process_non_loss_data_func(collected, iteration, writer)
    return string
