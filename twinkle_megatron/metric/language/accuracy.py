"""Accuracy: top-1 token accuracy from vocab-parallel logits, pooled over microbatches and ranks."""

from __future__ import annotations

from typing import Any

from ..inputs.shared_call import SharedCall
from ..inputs.tensors import to_device
from ..state.base import Number, SyncedStates
from ..tokens.logits_metric import LogitsMetric


class Accuracy(LogitsMetric):
    """Twinkle's ``Accuracy``, correct under tensor, pipeline, context and data parallelism.

    For every counted token (``labels != ignore_index`` and ``completion_mask``,
    finite logits, label inside the vocabulary; see :class:`LogitsMetric`):

        accuracy = Σ [argmax_v logits = label] / Σ 1     (sum over tokens, microbatches, DP×CP ranks)

    The argmax is global over the vocabulary although each TP rank holds a
    shard; padded columns (``>= vocab_size``) never win; ties go to the lowest
    index, like ``torch.argmax``.

    ``accumulate(inputs, outputs)``: ``inputs`` one mapping or a list (one per
    microbatch) with ``labels`` ``[b, s]`` (or ``[t]`` packed) and optional
    ``completion_mask``; ``outputs['logits']`` one tensor for the batch or a list
    per microbatch, ``[b, s, V/tp]`` or Megatron's ``[s, b, V/tp]`` (found from
    the shapes; ``logits_layout='sbv'`` decides when ``b == s``).

    Results: ``accuracy``, ``correct_tokens``, ``total_tokens``, and
    ``nonfinite_tokens`` / ``invalid_labels`` when non-zero.

    >>> import torch
    >>> from twinkle_megatron import Accuracy
    >>> metric = Accuracy()
    >>> logits = torch.tensor([[[2.0, 1.0, 0.0], [0.0, 3.0, 1.0], [1.0, 0.0, 0.0]]])
    >>> metric.accumulate({"labels": torch.tensor([[0, 2, -100]])}, {"logits": logits})
    >>> metric.calculate()
    {'accuracy': 0.5, 'correct_tokens': 1, 'total_tokens': 2}
    """

    token_statistics = ("argmax",)  # no probability: the argmax-only pass when no other metric needs one

    def __init__(self, device_mesh: Any = None, process_group: Any = None, **kwargs: Any) -> None:
        super().__init__(device_mesh, process_group, **kwargs)
        self.add_state("correct_tokens", "sum", grouped=True)
        self.add_state("total_tokens", "sum", grouped=True)

    def accumulate_call(self, call: SharedCall) -> None:
        for batch, classes, groups in self._token_batches(call):
            labels = to_device(batch.labels, batch.stats.argmax.device)
            # Bool counts of the same tokens: stacked and added together (see Metric._add_token_sums).
            self._add_token_sums({"correct_tokens": classes.counted & (batch.stats.argmax == labels),
                                  "total_tokens": classes.counted, **self.problem_counts(classes)}, None, groups)

    def compute(self, states: SyncedStates) -> dict[str, Number]:
        results = self._token_problems(states)
        total = states["total_tokens"]
        if total > 0:
            results.update(accuracy=states["correct_tokens"] / total, correct_tokens=int(states["correct_tokens"]),
                           total_tokens=int(total))
        return results
