"""The highest-loss samples of a log interval, kept on the device until a spike asks for them.

Per microbatch (from ``instrument()``'s ``loss_func`` hook: GPTModel's per-token
losses, the loss mask, and the batch's ``dataset_id`` and ``sample_index``),
each sample's loss is ``Σ loss·mask / Σ mask`` over its tokens. Rows
``[loss sum, tokens, dataset_id, sample_index, step]`` stay on the device; at
every step end (:meth:`SampleLosses.end_step`) the interval's rows are cut to
this rank's ``top_k`` by loss (a non-finite loss ranks first). Nothing is ever
read on the host and no collective is issued, unless a caller asks with
:meth:`SampleLosses.gather_top` (the tracker does, on a flagged log step only):
then ONE all-gather of a fixed ``[top_k, 6]`` block per rank of the reduction
group.

Which ranks count: the last pipeline stage, TP rank 0 (TP ranks hold the same
losses); under context parallelism every CP rank holds a part of each sequence
(its chunks' loss sum and tokens), and the parts of one sample are summed
after the gather, by ``(step, sample_index)``. Each CP rank picks its top-k by
its own part's mean, so a sample that is not in every CP rank's top-k comes back
with some parts only: it is reported with ``"complete": false`` after the
complete ones.

The metric reports nothing from ``calculate()`` and has no reduced states: it
joins a collection only to be fed by the same hooks.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from .base import Metric, Number, SyncedStates
from .inputs import given

_COLUMNS = 6  # score, loss sum, tokens, dataset_id, sample_index, step
_UNKNOWN = -1.0


class SampleLosses(Metric):
    """Top-k samples by loss of the current log interval (see the module docstring).

    Args:
        top_k: samples kept per rank and reported.
        dataset_key, index_key: the batch entries (one per sample) with each
            sample's dataset id (megatron-core's ``BlendedDataset`` names it
            ``dataset_id``) and its global sample index; -1 when absent.
        dataset_names: names of the dataset ids, for the reports.
        ignore_index: label of padding, when there is no loss mask.
    """

    def __init__(self, top_k: int = 8, *, dataset_key: str = "dataset_id", index_key: str = "sample_index",
                 dataset_names: Optional[Sequence[str]] = None, ignore_index: int = -100,
                 device_mesh: Any = None, process_group: Any = None) -> None:
        self._pending: list[torch.Tensor] = []  # this step's rows
        self._interval: Optional[torch.Tensor] = None  # the interval's top-k rows so far
        self._previous: Optional[torch.Tensor] = None  # the last synced interval's, for gather_top
        super().__init__(device_mesh, process_group)
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"SampleLosses: top_k must be a positive int, got {top_k!r}")
        self.top_k = top_k
        self.dataset_key, self.index_key = dataset_key, index_key
        self.dataset_names = list(dataset_names) if dataset_names else []
        self.ignore_index = ignore_index

    def accumulate(self, inputs: Any, outputs: Any, **kwargs: Any) -> None:
        """Add each sample's loss of one microbatch (or a list of them): ``outputs['token_losses']`` ``[b, s]``."""
        batches = list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]
        losses = outputs.get("token_losses") if isinstance(outputs, Mapping) else None
        if not given(losses):
            return
        losses = list(losses) if isinstance(losses, (list, tuple)) else [losses]
        if len(losses) != len(batches):
            raise ValueError(f"SampleLosses: {len(losses)} token_losses for {len(batches)} microbatches")
        for batch, token_losses in zip(batches, losses):
            self._pending.append(self._rows(batch, token_losses))

    def _rows(self, batch: Mapping[str, Any], token_losses: torch.Tensor) -> torch.Tensor:
        losses = token_losses.detach()
        losses = losses.reshape(losses.shape[0], -1) if losses.dim() > 1 else losses.reshape(1, -1)
        mask = batch.get("completion_mask")
        if mask is None and batch.get("labels") is not None:
            mask = batch["labels"] != self.ignore_index
        mask = torch.ones_like(losses, dtype=torch.bool) if mask is None else mask.reshape(losses.shape) != 0
        losses = losses.to(torch.float64)
        sums = torch.where(mask, losses, torch.zeros_like(losses)).sum(1)
        tokens = mask.sum(1).to(torch.float64)
        score = torch.where(torch.isfinite(sums), sums / tokens.clamp(min=1), torch.full_like(sums, math.inf))
        columns = [score, sums, tokens, self._per_sample(batch.get(self.dataset_key), sums),
                   self._per_sample(batch.get(self.index_key), sums), torch.zeros_like(sums)]
        return torch.stack(columns, 1)

    @staticmethod
    def _per_sample(value: Any, like: torch.Tensor) -> torch.Tensor:
        """One value per sample from ``[b]``, ``[b, s]`` (the first token's) or one number; -1 when absent."""
        if value is None:
            return torch.full_like(like, _UNKNOWN)
        value = torch.as_tensor(value).to(device=like.device, dtype=torch.float64)
        if value.dim() > 1:
            value = value[:, 0]
        return value.reshape(-1).expand(like.shape[0]) if value.numel() == 1 else value.reshape(-1)

    def end_step(self, step: int) -> None:
        """Stamp this step's rows with ``step`` and keep the interval's ``top_k`` (device work only)."""
        if not self._pending:
            return
        rows = torch.cat(self._pending)
        self._pending = []
        rows[:, 5] = float(step)
        if self._interval is not None:
            rows = torch.cat([self._interval, rows.to(self._interval.device)])
        if rows.shape[0] > self.top_k:
            rows = rows[torch.topk(rows[:, 0], self.top_k).indices]
        self._interval = rows

    def compute(self, states: SyncedStates) -> dict[str, Number]:
        return {}

    def reset(self) -> None:
        """After a sync: the interval's rows become the ones :meth:`gather_top` reads; a new interval starts."""
        super().reset()
        if self._pending:  # rows of a step not ended (a sync inside a step) join the interval as step 0
            self.end_step(0)
        self._previous, self._interval = self._interval, None

    def gather_top(self) -> list[dict[str, Any]]:
        """The last synced interval's ``top_k`` samples over all ranks, highest loss first.

        Collective (ONE all-gather): every rank calls it, and gets the same list of
        ``{"sample_index", "dataset_id", ["dataset"], "loss", "tokens", "step", "complete"}``
        (``sample_index`` / ``dataset_id`` None when the batches did not carry them).
        """
        context = self.context
        device = context.communication_device()
        local = torch.full((self.top_k, _COLUMNS), -math.inf, dtype=torch.float64, device=device)
        if self._previous is not None and self.counts_here():
            rows = self._previous.to(device)
            local[:rows.shape[0]] = rows
        if context.distributed and context.reduce_size > 1:
            gathered = [torch.empty_like(local) for _ in range(context.reduce_size)]
            dist.all_gather(gathered, local, group=context.reduce_group)
            local = torch.cat(gathered)
        parts_per_sample = max(context.cp_size, 1)
        merged: dict[tuple, list] = {}
        for index, (score, loss_sum, tokens, dataset, sample, step) in enumerate(local.cpu().tolist()):
            if score == -math.inf:
                continue
            key = (step, sample) if sample >= 0 else (step, "row", index)
            entry = merged.setdefault(key, [0.0, 0.0, dataset, sample, step, 0])
            entry[0] += loss_sum
            entry[1] += tokens
            entry[5] += 1
        samples = []
        for loss_sum, tokens, dataset, sample, step, parts in merged.values():
            entry: dict[str, Any] = {
                "sample_index": int(sample) if sample >= 0 else None,
                "dataset_id": int(dataset) if dataset >= 0 else None,
                "loss": loss_sum / tokens if tokens > 0 else (math.nan if loss_sum != 0 else 0.0),
                "tokens": int(tokens), "step": int(step), "complete": parts >= parts_per_sample}
            if entry["dataset_id"] is not None and entry["dataset_id"] < len(self.dataset_names):
                entry["dataset"] = self.dataset_names[entry["dataset_id"]]
            samples.append(entry)
        samples.sort(key=lambda s: (not s["complete"], -(s["loss"] if math.isfinite(s["loss"]) else math.inf)))
        return samples[:self.top_k]
