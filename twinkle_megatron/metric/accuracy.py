"""Accuracy: top-1 token accuracy from vocab-parallel logits, pooled over microbatches and ranks."""

from __future__ import annotations

from typing import Any, Optional

import torch

from .base import Metric, Number, StateValues
from .inputs import microbatches, token_mask
from .token_stats import logits_token_stats


class Accuracy(Metric):
    """Twinkle's ``Accuracy``, correct under tensor, pipeline, context and data parallelism.

    For every counted token (``labels != ignore_index`` and ``completion_mask``):

        accuracy = Σ [argmax_v logits = label] / Σ 1     (sum over tokens, microbatches, DP×CP ranks)

    The argmax is global over the vocabulary although each TP rank holds a
    shard; padded columns (``>= vocab_size``) never win; ties go to the lowest
    index. Tokens with a non-finite logit are left out and counted in
    ``nonfinite_tokens``; labels outside ``[0, vocab_size)`` are left out,
    counted in ``invalid_labels``, and make ``calculate()`` raise ``ValueError``
    on every rank (``strict=False`` reports the count instead).

    ``accumulate(inputs, outputs)``: ``inputs`` one mapping or a list (one per
    microbatch) with ``labels`` ``[b, s]`` (or ``[t]`` packed) and optional
    ``completion_mask``; ``outputs['logits']`` one tensor for the batch or a list
    per microbatch, ``[b, s, V/tp]`` or Megatron's ``[s, b, V/tp]`` (found from
    the shapes; ``logits_layout='sbv'`` decides when ``b == s``).

    Results: ``accuracy``, ``correct_tokens``, ``total_tokens``, and
    ``nonfinite_tokens`` / ``invalid_labels`` when non-zero.
    """

    def __init__(self, device_mesh: Any = None, process_group: Any = None, ignore_index: int = -100,
                 vocab_size: Optional[int] = None, logits_layout: Optional[str] = None, strict: bool = True,
                 **kwargs: Any) -> None:
        super().__init__(device_mesh, process_group, **kwargs)
        self.ignore_index = ignore_index
        self.vocab_size = vocab_size
        self.logits_layout = logits_layout
        self.strict = strict
        self.add_state("correct_tokens", "sum")
        self.add_state("total_tokens", "sum")
        self.add_state("nonfinite_tokens", "sum")
        self.add_state("invalid_labels", "sum")

    def accumulate(self, inputs: Any, outputs: Any, vocab_size: Optional[int] = None,
                   logits_layout: Optional[str] = None, **kwargs: Any) -> None:
        if outputs is None or outputs.get("logits") is None:
            return
        for batch, output in microbatches(inputs, outputs, ("logits",)):
            labels = batch.get("labels")
            if labels is None:
                raise ValueError("Accuracy needs inputs['labels']")
            logits = output["logits"]
            stats = logits_token_stats(logits, labels, self.context, vocab_size or self.vocab_size,
                                       logits_layout or self.logits_layout, self.ignore_index)
            mask = token_mask(labels, batch.get("completion_mask"), self.ignore_index).to(logits.device)
            finite = torch.isfinite(stats.entropy)
            valid_label = ~torch.isnan(stats.logprobs)
            counted = mask & finite & valid_label
            self._add("correct_tokens", (counted & (stats.argmax == labels.to(logits.device))).sum())
            self._add("total_tokens", counted.sum())
            self._add("nonfinite_tokens", (mask & ~finite).sum())
            self._add("invalid_labels", (mask & finite & ~valid_label).sum())

    def compute(self, states: StateValues) -> dict[str, Number]:
        invalid = int(states["invalid_labels"])
        if invalid and self.strict:
            raise ValueError(f"Accuracy: {invalid} label(s) outside [0, vocab_size) were seen across all ranks "
                             "(pass vocab_size, or strict=False to report the count instead)")
        total = states["total_tokens"]
        if total == 0 and not states["nonfinite_tokens"] and not invalid:
            return {}
        results: dict[str, Number] = {
            "accuracy": states["correct_tokens"] / total if total else float("nan"),
            "correct_tokens": int(states["correct_tokens"]),
            "total_tokens": int(total),
        }
        if states["nonfinite_tokens"]:
            results["nonfinite_tokens"] = int(states["nonfinite_tokens"])
        if invalid:
            results["invalid_labels"] = invalid
        return results
