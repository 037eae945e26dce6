"""The highest-loss samples of a log interval, kept on the device until a spike asks for them.

Per microbatch (from ``instrument()``'s ``loss_func`` hook: GPTModel's per-token
losses, the loss mask, and the batch's ``dataset_id`` and ``sample_index``),
each sample's loss is ``Σ loss / tokens`` over its counted tokens (the loss
mask, labels other than ``ignore_index``, and in a packed row its real tokens).
A sample is a row of the microbatch, or, in a packed row (Megatron's THD format:
``packed_seq_params`` or ``cu_seqlens`` / ``cu_seqlens_padded``, see
:mod:`..inputs.packed`), each packed sequence: its own tokens, never the THD padding
between sequences, whatever labels that padding carries. The microbatch reaches
the rows through the one input pipeline (:mod:`..inputs.view`: the CP
matching, the packed sub-sequences, the token mask).

Rows ``[score, loss sum, tokens, non-finite tokens, dataset_id, sample_index,
step, share]`` stay on the device; at every step end
(:meth:`SampleLosses.end_step`) the interval's rows are cut to this rank's
``top_k`` by score (the mean; a sample with a non-finite counted token ranks
first). Nothing is ever read on the host and no collective is issued, unless a
caller asks with :meth:`SampleLosses.gather_top` (the tracker does, on a flagged
log step only): then ONE all-gather of a fixed ``[top_k, 8]`` block per rank of
the reduction group.

Each sample's ``dataset_id`` and ``sample_index`` come from the batch: one value
per row (``[b]``; ``[b, s]``: the first token's; one number: every row's), and
in a packed row one value per packed sequence (``[n]`` or ``[1, n]`` for its
``n`` sequences; one number: the dataset of every sequence, or the index of the
only one). Absent: -1 (reported as None).

Which ranks count: the last pipeline stage, TP rank 0 (TP ranks hold the same
losses); under context parallelism every CP rank holds a part of each sequence
(its chunks' loss sum and tokens; packed sequences are split per sequence), and
the parts of one sample are summed after the gather, by ``(step,
sample_index)``; each part carries its share of the sample (``1/cp``; data
gathered over CP: 1, counted on CP rank 0). Each CP rank picks its top-k by its
own part's mean, so a sample that is not in every CP rank's top-k comes back
with some parts only: it is reported with ``"complete": false`` after the
complete ones (a non-finite sample is reported first either way: one
non-finite part makes the whole sample non-finite).

The metric reports nothing from ``calculate()`` and has no reduced states: it
joins a collection only to be fed by the same hooks.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from ..inputs.microbatches import given
from ..inputs.tensors import all_finite, to_device
from ..inputs.view import MicrobatchView, ViewSpec, microbatch_views_of
from ..state.base import Metric, Number, SyncedStates

# The columns of a row: the ranking score, Σ loss, counted tokens, non-finite counted tokens, dataset id,
# sample index, step, and the share of the sample the row holds (CP parts add up to 1).
SCORE, LOSS_SUM, TOKENS, NONFINITE, DATASET, SAMPLE, STEP, SHARE = range(8)
_COLUMNS = 8
_UNKNOWN = -1.0


class SampleLosses(Metric):
    """Top-k samples by loss of the current log interval (see the module docstring).

    Args:
        top_k: samples kept per rank and reported.
        dataset_key, index_key: the batch entries (one per sample, or per packed
            sequence) with each sample's dataset id (megatron-core's
            ``BlendedDataset`` names it ``dataset_id``) and its global sample
            index; -1 when absent.
        dataset_names: names of the dataset ids, for the reports.
        ignore_index: label of padding (left out, like the tokens off the loss mask).
        cp_gathered: per-token losses complete on every CP rank (default: each
            rank's own chunks, as ``instrument()`` passes them).
    """

    def __init__(self, top_k: int = 8, *, dataset_key: str = "dataset_id", index_key: str = "sample_index",
                 dataset_names: Optional[Sequence[str]] = None, ignore_index: int = -100,
                 device_mesh: Any = None, process_group: Any = None, cp_gathered: Optional[bool] = None) -> None:
        self._pending: list[torch.Tensor] = []  # this step's rows
        self._interval: Optional[torch.Tensor] = None  # the interval's top-k rows so far
        self._previous: Optional[torch.Tensor] = None  # the last synced interval's, for gather_top
        super().__init__(device_mesh, process_group, cp_gathered=cp_gathered)
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"SampleLosses: top_k must be a positive int, got {top_k!r}")
        self.top_k = top_k
        self.dataset_key, self.index_key = dataset_key, index_key
        self.dataset_names = list(dataset_names) if dataset_names else []
        self.ignore_index = ignore_index

    def accumulate(self, inputs: Any, outputs: Any, **kwargs: Any) -> None:
        """Add each sample's loss of one microbatch (or a list of them): ``outputs['token_losses']`` shaped like
        ``inputs['labels']`` (``[b, s]``, a packed row ``[1, t]``), or a list with one per microbatch."""
        batches = list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]
        losses = outputs.get("token_losses") if isinstance(outputs, Mapping) else None
        if not given(losses):
            return
        losses = list(losses) if isinstance(losses, (list, tuple)) else [losses]
        if len(losses) != len(batches):
            raise ValueError(f"SampleLosses: {len(losses)} token_losses for {len(batches)} microbatches")
        spec = ViewSpec("SampleLosses", "token_losses", ignore_index=self.ignore_index, cp_gathered=self.cp_gathered)
        pairs = [(batch, {"token_losses": loss.detach()}) for batch, loss in zip(batches, losses)]
        views = microbatch_views_of(pairs, spec, self.context)
        rows = [self._rows(batch, view) for batch, view in zip(batches, views) if view.counts_here]
        self._pending.extend(rows)  # after every view is built: a call that raises adds nothing

    def _rows(self, batch: Mapping[str, Any], view: MicrobatchView) -> torch.Tensor:
        """``[samples, 8]``: one row per sample of the microbatch (per packed sequence in a packed row)."""
        losses = view.tensors["token_losses"]
        selected = to_device(view.selected, losses.device)
        counted = selected & all_finite([losses])
        per_token = torch.stack([torch.where(counted, losses, 0.0), selected, selected & ~counted]).to(torch.float64)
        if view.packed is not None:
            sums, tokens, nonfinite = (view.packed.sum(values) for values in per_token.unbind(0))
        else:
            sums, tokens, nonfinite = per_token.sum(-1).unbind(0)
        # A non-finite token makes the sample's sum NaN and its score +inf: it ranks first.
        sums = torch.where(nonfinite > 0, math.nan, sums)
        score = torch.where(nonfinite > 0, math.inf, sums / tokens.clamp(min=1))
        share = 1.0 if view.cp_gathered else 1.0 / max(self.context.cp_size, 1)
        packed = view.packed is not None
        columns = [score, sums, tokens, nonfinite, self._per_sample(batch.get(self.dataset_key), sums, packed, ""),
                   self._per_sample(batch.get(self.index_key), sums, packed, self.index_key),
                   torch.zeros_like(sums), torch.full_like(sums, share)]
        return torch.stack(columns, 1)

    @staticmethod
    def _per_sample(value: Any, like: torch.Tensor, packed: bool, unique: str) -> torch.Tensor:
        """One value per sample (``like``: ``[samples]``) from the batch's entry; -1 when absent. Rows: ``[b]``,
        ``[b, s]`` (the first token's) or one number. Packed sequences: ``[n]``, ``[1, n]`` or one number, which
        an entry named ``unique`` (the sample index) may give only for a row holding one sequence."""
        if value is None:
            return torch.full_like(like, _UNKNOWN)
        value = to_device(torch.as_tensor(value), like.device).to(torch.float64)  # the batch's ids: no host wait
        if packed:
            value = value.reshape(-1)
            if value.numel() == 1 and (like.shape[0] == 1 or not unique):
                return value.expand(like.shape[0])
            if value.numel() != like.shape[0]:
                raise ValueError(f"SampleLosses: a packed row of {like.shape[0]} sequences needs one "
                                 f"{unique or 'dataset id'} per packed sequence, got {tuple(value.shape)}")
            return value
        if value.dim() > 1:
            value = value[:, 0]
        if value.numel() not in (1, like.shape[0]):
            raise ValueError(f"SampleLosses: a microbatch of {like.shape[0]} samples needs one "
                             f"{unique or 'dataset id'} per sample, got shape {tuple(value.shape)}")
        return value.reshape(-1).expand(like.shape[0]) if value.numel() == 1 else value.reshape(-1)

    def end_step(self, step: int) -> None:
        """Stamp this step's rows with ``step`` and keep the interval's ``top_k`` (device work only)."""
        if not self._pending:
            return
        rows = torch.cat(self._pending)
        self._pending = []
        rows[:, STEP] = float(step)
        if self._interval is not None:
            rows = torch.cat([self._interval, rows.to(self._interval.device)])
        if rows.shape[0] > self.top_k:
            # A stable sort, not topk: among equal scores (non-finite samples all score +inf) the earlier steps'
            # rows stay, so the first non-finite sample of a diverging interval is the one kept.
            rows = rows[torch.sort(rows[:, SCORE], descending=True, stable=True).indices[:self.top_k]]
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
        """The last synced interval's ``top_k`` samples over all ranks: non-finite ones first, then highest loss.

        Collective (ONE all-gather): every rank calls it, and gets the same list of
        ``{"sample_index", "dataset_id", ["dataset"], "loss", "tokens", "nonfinite_tokens", "step", "complete"}``
        (``sample_index`` / ``dataset_id`` None when the batches did not carry them; ``loss`` NaN and
        ``nonfinite_tokens`` > 0 for a sample with a non-finite loss among its counted tokens).
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
        merged: dict[tuple, list] = {}
        for index, row in enumerate(local.cpu().tolist()):
            if row[SCORE] == -math.inf:
                continue
            sample, step = row[SAMPLE], row[STEP]
            key = (step, sample) if sample >= 0 else (step, "row", index)
            entry = merged.setdefault(key, [0.0, 0.0, 0.0, row[DATASET], sample, step, 0.0])
            entry[0] += row[LOSS_SUM]
            entry[1] += row[TOKENS]
            entry[2] += row[NONFINITE]
            entry[6] += row[SHARE]
        samples = []
        for loss_sum, tokens, nonfinite, dataset, sample, step, share in merged.values():
            entry: dict[str, Any] = {
                "sample_index": int(sample) if sample >= 0 else None,
                "dataset_id": int(dataset) if dataset >= 0 else None,
                "loss": math.nan if nonfinite else loss_sum / tokens if tokens > 0 else 0.0,
                "tokens": int(tokens), "nonfinite_tokens": int(nonfinite), "step": int(step),
                "complete": share > 1.0 - 1e-6}
            if entry["dataset_id"] is not None and entry["dataset_id"] < len(self.dataset_names):
                entry["dataset"] = self.dataset_names[entry["dataset_id"]]
            samples.append(entry)
        samples.sort(key=_rank)
        return samples[:self.top_k]


def _rank(sample: Mapping[str, Any]) -> tuple:
    """Sort key: non-finite samples first (the earliest step first: what diverged first; then most non-finite
    tokens), then complete ones, by loss."""
    if sample["nonfinite_tokens"]:
        return (0, sample["step"], -sample["nonfinite_tokens"])
    return (1, not sample["complete"], -sample["loss"])
