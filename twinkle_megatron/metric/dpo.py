r"""DPOMetric: TRL's preference metrics, correct under tensor, pipeline, context and data parallelism.

**Sequence log-probs under context parallelism.** A sequence's log-prob is
the sum of its token log-probs; with CP each rank holds two chunks of every
sequence and so only a partial sum. Means of sequence log-probs and rewards
are linear, so each CP rank adds its partial sums and the collection's SUM
completes them. ``rewards/accuracies`` compares each pair's margin with 0, a
nonlinearity, and whether a pair counts at all depends on its token count; so
per microbatch the pairs' partial ``(tokens, margin)`` are summed over the CP
group first: **one all-reduce of a ``[pairs, 2]`` float64 tensor per
microbatch**, only when ``cp_size > 1`` and the data is not ``cp_gathered``
(see :mod:`.grpo` for why this beats per-sequence states or object records).
Pair counts are then added by CP rank 0 only.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .base import Metric, Number, StateValues
from .inputs import check_same_shape, microbatches, to_device, token_mask
from .sequences import as_rows, labels_2d, sum_over_context_parallel

PAIR_LAYOUTS = ("interleaved", "halves")


class DPOMetric(Metric):
    r"""Twinkle's ``DPOMetric`` (TRL's definitions) with numbers instead of strings.

    For each (chosen, rejected) pair with at least one counted token
    (``labels != ignore_index`` and ``completion_mask``), sequence log-probs
    are sums of token log-probs, ``π`` the policy's (``outputs['logps']``) and
    ``π_ref`` the reference model's (``ref_outputs['logps']``), and the implicit
    rewards are ``r_c = β(log π(c) − log π_ref(c))``, ``r_r`` likewise. Means over
    pairs of all microbatches and DP ranks (sums over CP first):

    ========================= ==========================================
    ``logps/chosen``          mean log π(c)
    ``logps/rejected``        mean log π(r)
    ``logps/ref_chosen``      mean log π_ref(c)                 (with ref_outputs)
    ``logps/ref_rejected``    mean log π_ref(r)
    ``rewards/chosen``        mean r_c
    ``rewards/rejected``      mean r_r
    ``rewards/margins``       mean (r_c − r_r)
    ``rewards/accuracies``    mean [r_c − r_r > 0]              (a fraction in [0, 1])
    ========================= ==========================================

    ``pair_layout``: ``'interleaved'`` (Twinkle's ``[c1, r1, c2, r2, …]`` in
    every microbatch, the default) or ``'halves'`` (TRL's concatenated
    ``[c1, …, cn, r1, …, rn]`` in every microbatch). A microbatch with an odd
    number of sequences is a ``ValueError``.

    ``accumulate(inputs, outputs, ref_outputs=None)``: ``outputs['logps']`` and
    ``ref_outputs['logps']`` (or ``ref_logps=``) shaped like ``labels``, one
    tensor for the batch or a list per microbatch.
    """

    def __init__(self, device_mesh: Any = None, process_group: Any = None, ignore_index: int = -100,
                 beta: float = 0.1, pair_layout: str = "interleaved", **kwargs: Any) -> None:
        super().__init__(device_mesh, process_group, **kwargs)
        _check_layout(pair_layout)
        self.ignore_index = ignore_index
        self.beta = float(beta)
        self.pair_layout = pair_layout
        for name in ("pairs", "chosen_logps", "rejected_logps", "ref_pairs", "ref_chosen_logps", "ref_rejected_logps",
                     "chosen_rewards", "rejected_rewards", "margins", "correct_pairs"):
            self.add_state(name, "sum")

    def accumulate(self, inputs: Any, outputs: Any, *, ref_outputs: Any = None, ref_logps: Any = None,
                   pair_layout: Optional[str] = None, **kwargs: Any) -> None:
        if outputs is None or outputs.get("logps") is None:
            return
        layout = _check_layout(pair_layout or self.pair_layout)
        if ref_outputs is not None and ref_outputs.get("logps") is not None:
            ref_logps = ref_outputs["logps"]
        pairs = microbatches(inputs, {"logps": outputs["logps"], "ref_logps": ref_logps}, ("logps", "ref_logps"))
        for index, (batch, output) in enumerate(pairs):  # all checks before any state changes
            _check_microbatch(batch, output, layout, index)
        for batch, output in pairs:
            self._accumulate_microbatch(batch, output, layout)

    def _accumulate_microbatch(self, batch: Any, output: Any, layout: str) -> None:
        logps = as_rows(output["logps"])
        device = logps.device
        labels = to_device(labels_2d(batch, "DPOMetric"), device)
        completion_mask = batch.get("completion_mask")
        if completion_mask is not None:
            completion_mask = to_device(as_rows(completion_mask), device)
        mask = token_mask(labels, completion_mask, self.ignore_index)
        zero = torch.zeros((), dtype=torch.float64, device=device)
        tokens = mask.sum(-1).to(torch.float64)
        sequence_logps = torch.where(mask, logps.to(torch.float64), zero).sum(-1)
        chosen, rejected = _split_pairs(sequence_logps, layout)
        chosen_tokens, rejected_tokens = _split_pairs(tokens, layout)
        pair_tokens = chosen_tokens + rejected_tokens

        ref = output.get("ref_logps")
        if ref is not None:
            ref = to_device(as_rows(ref), device)
            ref_chosen, ref_rejected = _split_pairs(torch.where(mask, ref.to(torch.float64), zero).sum(-1), layout)
            chosen_rewards = self.beta * (chosen - ref_chosen)
            rejected_rewards = self.beta * (rejected - ref_rejected)
            margins = chosen_rewards - rejected_rewards
        else:
            margins = torch.zeros_like(chosen)
        # Sequence-level: complete each pair's token count and margin over CP before comparing.
        pair_tokens, full_margins = sum_over_context_parallel(torch.stack([pair_tokens, margins], -1), self.context,
                                                              self.cp_gathered).unbind(-1)
        counted = pair_tokens > 0
        once = 1.0 if self.context.counts_sequences(self.cp_gathered) else 0.0
        self._add("pairs", counted.sum() * once)
        self._add("chosen_logps", chosen.sum())
        self._add("rejected_logps", rejected.sum())
        if ref is None:
            return
        self._add("ref_pairs", counted.sum() * once)
        self._add("ref_chosen_logps", ref_chosen.sum())
        self._add("ref_rejected_logps", ref_rejected.sum())
        self._add("chosen_rewards", chosen_rewards.sum())
        self._add("rejected_rewards", rejected_rewards.sum())
        self._add("margins", margins.sum())
        self._add("correct_pairs", (counted & (full_margins > 0)).sum() * once)

    def compute(self, states: StateValues) -> dict[str, Number]:
        pairs = states["pairs"]
        if pairs == 0:
            return {}
        results: dict[str, Number] = {
            "logps/chosen": states["chosen_logps"] / pairs,
            "logps/rejected": states["rejected_logps"] / pairs,
        }
        ref_pairs = states["ref_pairs"]
        if ref_pairs > 0:
            results.update({
                "logps/ref_chosen": states["ref_chosen_logps"] / ref_pairs,
                "logps/ref_rejected": states["ref_rejected_logps"] / ref_pairs,
                "rewards/chosen": states["chosen_rewards"] / ref_pairs,
                "rewards/rejected": states["rejected_rewards"] / ref_pairs,
                "rewards/margins": states["margins"] / ref_pairs,
                "rewards/accuracies": states["correct_pairs"] / ref_pairs,
            })
        return results


def _check_microbatch(batch: Any, output: Any, layout: str, index: int) -> None:
    """``ValueError`` for mismatched shapes or a microbatch that is not made of whole pairs (shapes only)."""
    labels, logps = labels_2d(batch, "DPOMetric"), as_rows(output["logps"])
    check_same_shape("labels", labels, "logps", logps)
    if output.get("ref_logps") is not None:
        check_same_shape("logps", logps, "ref_outputs['logps']", as_rows(output["ref_logps"]))
    if batch.get("completion_mask") is not None:
        check_same_shape("labels", labels, "completion_mask", as_rows(batch["completion_mask"]))
    if labels.shape[0] % 2:
        raise ValueError(f"DPOMetric needs whole (chosen, rejected) pairs ({layout} layout), but microbatch "
                         f"{index} holds {labels.shape[0]} sequences (an odd number)")


def _check_layout(layout: str) -> str:
    if layout not in PAIR_LAYOUTS:
        raise ValueError(f"pair_layout must be one of {PAIR_LAYOUTS}, got {layout!r}")
    return layout


def _split_pairs(values: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) rows of a microbatch in the given pair layout."""
    if layout == "interleaved":
        return values[0::2], values[1::2]
    half = values.shape[0] // 2
    return values[:half], values[half:]
