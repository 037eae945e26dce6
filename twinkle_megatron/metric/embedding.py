r"""EmbeddingMetric: anchor/positive similarity and in-batch negatives over the global batch.

**Cross-rank data without a gather of embeddings.** Twinkle all-gathers every
embedding of every rank (sizing its buffers by the world size while gathering
on the DP group, which breaks with TP/PP/CP > 1). Here nothing but sums cross
ranks. With unit vectors ``â_i`` (anchors) and ``p̂_i`` (their positives), the
in-batch negative similarities of a batch of ``n`` anchors add up to

    Σ_{i≠j} â_i·p̂_j = (Σ_i â_i)·(Σ_j p̂_j) − Σ_i â_i·p̂_i

so a rank only needs its ``Σ â``, ``Σ p̂`` (two ``d``-vectors), its anchor count
and its positive-similarity sum per ``accumulate`` call. Positive
similarities (sum, min, max, count) are ordinary states; the per-call vectors
travel in the collection's one object all-gather over the reduction group
(ranks that do not hold data contribute nothing), so any TP×PP×CP×DP layout
and any per-rank batch size work, and the bytes sent are ``O(d)`` per rank
and call instead of ``O(n·d)``. The product of the global sums happens in
``compute``, after the gather: the result equals the single-process one.

Cost: a collection holding an ``EmbeddingMetric`` issues the object all-gather
at every ``calculate()`` (three collectives in all instead of two), since
``d`` is not known when the states are declared. An ``embedding_dim`` keyword
that declared ``[calls, d]`` SUM states would remove it; not done yet.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Mapping, Optional, Union

import torch
import torch.nn.functional as F

from .base import Metric, Number, StateValues
from .inputs import call_value, given, microbatches, to_device


class EmbeddingMetric(Metric):
    r"""Twinkle's ``EmbeddingMetric`` (InfoNCE training), with numbers and an exact cross-rank batch.

    ``labels`` mark anchors (non-zero); the positive of the anchor at row ``i``
    is row ``i + 1`` of the same ``accumulate`` call (an anchor in the last row
    has none and is skipped). Over all anchors of all ranks, with cosine
    similarity ``cos``:

    ================ =========================================================
    ``pos_sim``      mean cos(anchor_i, positive_i)
    ``pos_sim_min``  min  cos(anchor_i, positive_i)
    ``pos_sim_max``  max  cos(anchor_i, positive_i)
    ``neg_sim``      mean cos(anchor_i, positive_j), i ≠ j, within each call's global batch
    ``loss``         Σ loss · anchors / Σ anchors over calls and ranks: each rank's ``outputs['loss']`` (the
                     mean of its finite values) weighted by the anchors it passed with it, so a rank's loss
                     over its own anchors pools into the global mean, and a loss every rank passes alike
                     stays the same, under any layout
    ``grad_norm``    latest finite value passed (``grad_norm=`` or ``outputs['grad_norm']``), max over ranks
    ================ =========================================================

    Non-finite values are left out and counted: an embedding row with a NaN or
    infinite entry takes no part (an anchor whose row or whose positive's row
    is non-finite is skipped, like an unmarked row) and is counted in
    ``nonfinite_embeddings``; a non-finite loss in ``nonfinite_losses``, a
    non-finite grad norm in ``nonfinite_grad_norms`` (each when > 0).

    ``neg_sim`` is a cosine like ``pos_sim`` (Twinkle uses a raw dot product,
    which agrees only for normalised embeddings). Embeddings
    (``outputs['embeddings']``, else ``outputs['logits']``) are ``[n, d]`` or
    ``[n, s, d]`` (position 0 is taken), one tensor or a list per microbatch;
    ``labels`` hold one value per row. Sentence embeddings are complete on
    every CP rank (pooled, or position 0, which Megatron's CP split keeps on CP
    rank 0), so ``cp_gathered`` defaults to True: CP rank 0 counts.

    >>> import torch
    >>> from twinkle_megatron import EmbeddingMetric
    >>> metric = EmbeddingMetric()
    >>> embeddings = torch.tensor([[1.0, 0.0], [0.8, 0.6], [0.0, 1.0], [0.6, 0.8]])  # anchor, positive, ...
    >>> metric.accumulate({"labels": torch.tensor([1, 0, 1, 0])}, {"embeddings": embeddings})
    >>> {key: round(value, 6) for key, value in metric.calculate().items()}
    {'pos_sim': 0.8, 'pos_sim_min': 0.8, 'pos_sim_max': 0.8, 'neg_sim': 0.6}
    """

    call_keywords = ("grad_norm",)
    output_keys = ("embeddings", "logits")

    def __init__(self, device_mesh: Any = None, process_group: Any = None, cp_gathered: bool = True,
                 **kwargs: Any) -> None:
        super().__init__(device_mesh, process_group, cp_gathered=cp_gathered, **kwargs)
        self.add_state("pos_sim_sum", "sum")
        self.add_state("pos_count", "sum")
        self.add_state("pos_sim_min", "min")
        self.add_state("pos_sim_max", "max")
        self.add_state("loss_sum", "sum")
        self.add_state("loss_weight", "sum")
        self.add_state("grad_norm", "max")
        for name in ("nonfinite_embeddings", "nonfinite_losses", "nonfinite_grad_norms"):
            self.add_state(name, "sum")
        self._calls: list[tuple] = []  # per call with anchors: call index, Σâ, Σp̂, anchors, Σ cos(â, p̂)
        self._call_count = 0  # calls since the last calculate(): ranks call in lockstep, so indices agree

    def accumulate(self, inputs: Any, outputs: Any, **kwargs: Any) -> None:
        """Add one call's anchors (its rows form one in-batch-negatives batch); ``grad_norm`` is a
        per-call value (keyword first, then ``outputs``)."""
        grad_norm = call_value("grad_norm", kwargs, outputs)
        if grad_norm is not None:
            self._assign_finite("grad_norm", grad_norm, "nonfinite_grad_norms")
        if outputs is None:
            return
        key = "embeddings" if given(outputs.get("embeddings")) else "logits"
        if not given(outputs.get(key)):
            return
        sentences, labels = [], []
        for index, (batch, output) in enumerate(microbatches(inputs, outputs, (key,))):
            embeddings = output[key]
            embeddings = embeddings[:, 0] if embeddings.dim() == 3 else embeddings
            if batch.get("labels") is None:
                raise ValueError("EmbeddingMetric needs inputs['labels'] (non-zero marks an anchor)")
            batch_labels = to_device(torch.as_tensor(batch["labels"]).reshape(-1), embeddings.device)
            if embeddings.shape[0] != batch_labels.shape[0]:
                raise ValueError(f"outputs[{key!r}] has {embeddings.shape[0]} rows (shape {tuple(output[key].shape)}) "
                                 f"but labels has {batch_labels.shape[0]} values (microbatch {index})")
            sentences.append(embeddings)
            labels.append(batch_labels)
        anchors = self._accumulate_call(torch.cat(sentences), torch.cat(labels)) if sentences else 0.0
        self._call_count += 1
        self._accumulate_loss(outputs.get("loss"), anchors)

    def _accumulate_call(self, sentences: torch.Tensor, labels: torch.Tensor) -> Union[torch.Tensor, float]:
        """Add one call's anchors; returns their number (a device count)."""
        finite_rows = torch.isfinite(sentences).all(-1)
        self._add("nonfinite_embeddings", (~finite_rows).sum())
        if sentences.shape[0] < 2:
            return 0.0
        unit = F.normalize(torch.where(finite_rows[:, None], sentences.to(torch.float64), 0.0), dim=-1)
        anchors, positives = unit[:-1], unit[1:]
        is_anchor = (labels[:-1] != 0) & finite_rows[:-1] & finite_rows[1:]
        similarity = (anchors * positives).sum(-1)
        zero = torch.zeros((), dtype=torch.float64, device=unit.device)
        positive_sum = torch.where(is_anchor, similarity, zero).sum()
        self._add("pos_sim_sum", positive_sum)
        self._add("pos_count", is_anchor.sum())
        inf = torch.full((), float("inf"), dtype=torch.float64, device=unit.device)
        self._minimum("pos_sim_min", torch.where(is_anchor, similarity, inf).min())
        self._maximum("pos_sim_max", torch.where(is_anchor, similarity, -inf).max())
        weights = is_anchor.to(torch.float64)[:, None]
        self._calls.append((self._call_count, (anchors * weights).sum(0), (positives * weights).sum(0), is_anchor.sum(),
                            positive_sum))
        return is_anchor.sum()

    def _accumulate_loss(self, loss: Any, anchors: Union[torch.Tensor, float]) -> None:
        """The call's loss (its finite values' mean), weighted by the anchors this rank passed with it."""
        if not given(loss):
            return
        values = torch.stack([self._as_state("loss_sum", v).reshape(())
                              for v in (loss if isinstance(loss, (list, tuple)) else [loss])])
        finite = torch.isfinite(values)
        mean = torch.where(finite, values, 0.0).sum() / finite.sum().clamp(min=1)
        weight = self._as_state("loss_weight", anchors) * finite.any()
        self._add("loss_sum", mean * weight)
        self._add("loss_weight", weight)
        self._add("nonfinite_losses", (~finite).sum())

    def sync_records(self) -> Optional[list]:
        # calculate() time: reading the per-call sums on the host is allowed here.
        return [(call, anchor_sum.tolist(), positive_sum.tolist(), int(anchors), float(positive_similarity))
                for call, anchor_sum, positive_sum, anchors, positive_similarity in self._calls]

    def _negative_similarity(self, records: list) -> tuple[float, int]:
        """(Σ over calls of Σ_{i≠j} cos(â_i, p̂_j), number of such pairs), from all ranks' per-call sums."""
        per_call: dict[int, list] = defaultdict(lambda: [0.0, 0.0, 0, 0.0])
        for call, anchor_sum, positive_sum, anchors, positive_similarity in records:
            totals = per_call[call]
            totals[0] = totals[0] + torch.tensor(anchor_sum, dtype=torch.float64)
            totals[1] = totals[1] + torch.tensor(positive_sum, dtype=torch.float64)
            totals[2] += anchors
            totals[3] += positive_similarity
        negative_sum, negative_pairs = 0.0, 0
        for anchor_sum, positive_sum, anchors, positive_similarity in per_call.values():
            if anchors > 1:
                negative_sum += float(torch.dot(anchor_sum, positive_sum)) - positive_similarity
                negative_pairs += anchors * (anchors - 1)
        return negative_sum, negative_pairs

    def compute(self, states: StateValues) -> dict[str, Number]:
        results: dict[str, Number] = {}
        if states["pos_count"] > 0:
            results["pos_sim"] = states["pos_sim_sum"] / states["pos_count"]
            results["pos_sim_min"] = states["pos_sim_min"]
            results["pos_sim_max"] = states["pos_sim_max"]
        negative_sum, negative_pairs = self._negative_similarity(states.records)
        if negative_pairs > 0:
            results["neg_sim"] = negative_sum / negative_pairs
        if states["loss_weight"] > 0:
            results["loss"] = states["loss_sum"] / states["loss_weight"]
        if states["grad_norm"] != float("-inf"):
            results["grad_norm"] = states["grad_norm"]
        for name in ("nonfinite_embeddings", "nonfinite_losses", "nonfinite_grad_norms"):
            if states[name] > 0:
                results[name] = int(states[name])
        return results

    def reset(self) -> None:
        super().reset()
        self._calls = []
        self._call_count = 0

    def extra_state(self, states: StateValues) -> dict[str, Any]:
        """The per-call sums of all ranks, merged per call (the state is layout-free)."""
        merged: dict[int, list] = {}
        for call, anchor_sum, positive_sum, anchors, positive_similarity in states.records:
            totals = merged.setdefault(call, [torch.zeros(len(anchor_sum), dtype=torch.float64),
                                              torch.zeros(len(positive_sum), dtype=torch.float64), 0, 0.0])
            totals[0] += torch.tensor(anchor_sum, dtype=torch.float64)
            totals[1] += torch.tensor(positive_sum, dtype=torch.float64)
            totals[2] += anchors
            totals[3] += positive_similarity
        return {"calls": [(call, *totals) for call, totals in sorted(merged.items())], "call_count": self._call_count}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Continue under any layout: the merged per-call sums go to the primary rank only."""
        super().load_state_dict(state_dict)
        device = self._state_device()
        calls = state_dict.get("calls", []) if self._is_primary() else []
        self._calls = [(call, anchor_sum.to(device), positive_sum.to(device),
                        torch.tensor(float(anchors), dtype=torch.float64),
                        torch.tensor(float(positive_similarity), dtype=torch.float64))
                       for call, anchor_sum, positive_sum, anchors, positive_similarity in calls]
        self._call_count = state_dict.get("call_count", 0)
