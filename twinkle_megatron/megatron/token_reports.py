"""The token statistics as entries of Megatron's loss reports, which Megatron's own loop pools and logs.

A Megatron ``loss_func`` returns ``(loss, num_tokens, {'lm loss': [sum, count]})``.
Megatron-LM's ``train_step`` (``megatron/training/training.py``, read at tags
``core_v0.13.0``, ``core_v0.16.1``, ``core_v0.19.0`` and on ``main``) and Megatron-Bridge 0.6.2's
(``megatron/bridge/training/train.py``) pool every key of those dicts alike:
for the keys of the first microbatch's dict, the ``[sum, count]`` tensors
(2 elements) of all microbatches are summed, all-reduced over the DP×CP group
(one all-reduce per key per step, on the last pipeline stage), and the step's
value is ``sum / count``; ``training_log`` then writes each key to
TensorBoard and W&B (and to its console line when the average is > 0 up to
``core_v0.16.1``, >= 0 from ``core_v0.19.0`` on). During Megatron's ``evaluate()`` no
entry is added (:mod:`.validation`). So a
statistic added as a ``[sum, count]`` entry is pooled by tokens over the global
batch exactly like the loss. Per microbatch, for the counted tokens t (label
not ``ignore_index``, loss mask set, finite logits, label inside the
vocabulary; the rule of :class:`~twinkle_megatron.LogitsMetric`):

    accuracy = [Σ_t [argmax_t = label_t], Σ_t 1]
    logprob  = [Σ_t log p(label_t),       Σ_t 1]
    entropy  = [Σ_t H_t,                  Σ_t 1]

and with group names, the same per group (``accuracy/<name>``, ...) and the
per-token loss per group (``<loss key>/<name>`` = [Σ loss_t, Σ 1] over the
group's tokens of the loss mask with a finite loss). Every microbatch reports
every key (``[0, 0]`` when it has nothing), because ``train_step`` takes the
keys of the first microbatch and all-reduces them in order on every rank; a
group absent from the whole step reads ``0 / 0 = NaN`` in Megatron's log.
The entries are float32 device tensors, like Megatron's own ``lm loss``
report; building them never reads a value on the host. Beside them each
microbatch counts, on the device, the tokens the reports cannot place (labels
outside the vocabulary; with group names, tokens without a valid group id):
:mod:`.mistakes` reads those counts at step starts and warns once.
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist

from ..metric import TokenClasses, TokenGroups, classify_tokens, token_groups, token_mask
from ..ops import TokenStats
from ..parallel import ParallelContext

ACCURACY, LOGPROB, ENTROPY = "accuracy", "logprob", "entropy"  # the metrics' own result names
INVALID_LABELS, UNGROUPED_TOKENS = "invalid_labels", "ungrouped_tokens"  # the mistakes a microbatch counts


class MicrobatchReport(NamedTuple):
    """One microbatch's report entries and its mistake counts (device float64 scalars by kind: tokens of the loss
    mask with a label outside the vocabulary; with group names, tokens without a group id in range)."""

    entries: dict[str, torch.Tensor]
    mistakes: dict[str, torch.Tensor]


class TokenReports:
    """The ``[sum, count]`` report entries of one microbatch's token statistics (see the module docstring)."""

    def __init__(self, ignore_index: int = -100, group_names: Sequence[str] = (), loss_key: str = "lm loss") -> None:
        self.ignore_index = ignore_index
        self.group_names = tuple(group_names)
        self.loss_key = loss_key
        self.keys = [ACCURACY, ENTROPY, LOGPROB] + [f"{key}/{name}" for key in (ACCURACY, ENTROPY, LOGPROB, loss_key)
                                                    for name in self.group_names]

    def empty(self, device: torch.device) -> dict[str, torch.Tensor]:
        """Every key as ``[0, 0]``: a microbatch without statistics (no labels seen, a failed hook)."""
        return {key: torch.zeros(2, dtype=torch.float32, device=device) for key in self.keys}

    def groups(self, group_ids: Any, labels: torch.Tensor, context: ParallelContext) -> Optional[TokenGroups]:
        """The group of each token of the microbatch as tensor-parallel rank 0 read it, on every TP rank.

        Megatron-LM's ``get_batch`` takes the batch from the data iterator on TP
        rank 0 only and broadcasts fixed keys (no ``dataset_id``), while the log is
        written by the last rank: under TP the ids (shaped like the tokens, -1
        where rank 0 had none) are broadcast from TP rank 0, one TP collective per
        microbatch, only with group names. Bad ids raise after the broadcast, so
        that no rank is left waiting in it.
        """
        if not self.group_names:
            return None
        count = len(self.group_names)
        if context.tp_size == 1:
            return None if group_ids is None else token_groups(group_ids, labels, count)
        ids, error = torch.full(labels.shape, -1, dtype=torch.int64, device=labels.device), None
        try:
            own = None if group_ids is None else token_groups(group_ids, labels, count)
            ids = ids if own is None else torch.where(own.in_range, own.ids, -1)
        except ValueError as bad:
            error = bad
        dist.broadcast(ids, src=dist.get_global_rank(context.tp_group, 0), group=context.tp_group)
        if error is not None:
            raise error
        return token_groups(ids, labels, count)

    def loss_mask_tokens(self, labels: torch.Tensor, loss_mask: Optional[torch.Tensor], stats: TokenStats
                         ) -> tuple[torch.Tensor, TokenClasses]:
        """The tokens of the loss mask (:func:`.token_mask` of ``labels`` and ``loss_mask``, shaped like the
        per-token ``stats``, with ``ignore_index``) and their classes (:func:`.classify_tokens`): made once per
        microbatch, for the reports and (handed on by the instrumentation) the metrics."""
        device = stats.entropy.device
        selected = token_mask(labels.to(device), None if loss_mask is None else loss_mask.to(device),
                              self.ignore_index)
        return selected, classify_tokens(stats, selected)

    def of(self, labels: torch.Tensor, selected: torch.Tensor, stats: TokenStats, classes: TokenClasses,
           groups: Optional[TokenGroups] = None, token_losses: Optional[torch.Tensor] = None
           ) -> MicrobatchReport:
        """The entries of one microbatch and its mistake counts: ``labels`` shaped like the per-token ``stats``,
        ``selected`` and ``classes`` from :meth:`loss_mask_tokens`; ``groups`` (per token) and ``token_losses``
        (shaped like ``labels``) for the per-group entries."""
        device = stats.entropy.device
        counted = classes.counted
        # Tokens of the loss mask the reports cannot place: labels outside the vocabulary, and (with group
        # names) tokens without a group id inside the names (none given, or out of range).
        mistakes = {INVALID_LABELS: classes.invalid_label.sum(dtype=torch.float64)}
        if self.group_names:
            ungrouped = selected if groups is None else selected & ~groups.in_range
            mistakes[UNGROUPED_TOKENS] = ungrouped.sum(dtype=torch.float64)
        zero = torch.zeros((), dtype=stats.entropy.dtype, device=device)
        values = {ACCURACY: counted & (stats.argmax == labels.to(device)),
                  ENTROPY: torch.where(counted, stats.entropy, zero),
                  LOGPROB: torch.where(counted, stats.logprobs, zero)}
        count = counted.sum().to(torch.float64)
        reports = {key: _pair(value.to(torch.float64).sum(), count) for key, value in values.items()}
        if self.group_names:
            reports.update(self._per_group(values, counted, selected, groups, token_losses, device))
        return MicrobatchReport(reports, mistakes)

    def _per_group(self, values: dict, counted: torch.Tensor, selected: torch.Tensor, groups: Optional[TokenGroups],
                   token_losses: Optional[torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
        zeros = torch.zeros(len(self.group_names), dtype=torch.float64, device=device)
        sums, counts = {}, {}
        for key, value in values.items():
            sums[key] = groups.sum(value) if groups is not None else zeros
            counts[key] = groups.sum(counted) if groups is not None else zeros
        losses = None if token_losses is None else token_losses.detach().to(device).reshape(selected.shape)
        if groups is not None and losses is not None:
            loss_counted = selected & torch.isfinite(losses)
            sums[self.loss_key] = groups.sum(torch.where(loss_counted, losses.to(torch.float64), 0.0))
            counts[self.loss_key] = groups.sum(loss_counted)
        else:
            sums[self.loss_key] = counts[self.loss_key] = zeros
        return {f"{key}/{name}": _pair(sums[key][index], counts[key][index])
                for key in (ACCURACY, ENTROPY, LOGPROB, self.loss_key) for index, name in enumerate(self.group_names)}


def _pair(total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    return torch.stack([total, count]).to(torch.float32)


def report_device(result: Any) -> torch.device:
    """The device of a ``loss_func`` result's loss (Megatron's reports live there)."""
    loss = result[0] if isinstance(result, (tuple, list)) and result else None
    return loss.device if isinstance(loss, torch.Tensor) else torch.device("cpu")


def with_entries(result: Any, entries: dict) -> Any:
    """``result`` with ``entries`` added to its report dict (keys the ``loss_func`` reports itself stay its own)."""
    if not isinstance(result, (tuple, list)) or not isinstance(result[-1], Mapping):
        return result
    report = dict(result[-1])
    for key, value in entries.items():
        report.setdefault(key, value)
    return (*result[:-1], report)
