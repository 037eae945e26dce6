r"""DPOMetric: TRL's preference metrics, correct under tensor, pipeline, context and data parallelism.

**Sequence log-probs under context parallelism.** A sequence's log-prob is
the sum of its token log-probs; with CP each rank holds two chunks of every
sequence and so only a partial sum. Means of sequence log-probs and rewards
are linear, so each CP rank adds its partial sums and the collection's SUM
completes them. ``rewards/accuracies`` compares each pair's margin with 0, a
nonlinearity, and whether a pair counts at all depends on its token count and
on whether any of its log-probs is non-finite; so per microbatch the pairs'
partial ``(tokens, margin, non-finite tokens)`` are summed over the CP group
first: **one all-reduce of a ``[pairs, 3]`` float64 tensor per microbatch**,
only when ``cp_size > 1`` and the data is local (not complete on every CP
rank; see :mod:`..inputs.context_parallel` and :mod:`.grpo` for why this beats
per-sequence states or object records). Pair counts are then added by CP rank
0 only.

**Non-finite log-probs.** A NaN or infinite log-prob (policy or reference) in a
counted token makes its sequence's log-prob, and so its pair's rewards and
margin, undefined: the whole pair is left out of every statistic and counted
in ``nonfinite_pairs`` (leaving out only the token would report a sequence
log-prob that silently misses a term).
"""

from __future__ import annotations

from typing import Any

import torch

from ..inputs.microbatches import call_value, given
from ..inputs.tensors import all_finite, to_device
from ..inputs.view import MicrobatchView, ViewSpec, microbatch_views
from ..state.base import Metric, Number, SyncedStates
from ..tokens.sequence_totals import counts_sequences_here, sum_over_context_parallel

PAIR_LAYOUTS = ("interleaved", "halves")


REF_LOGPS = "ref_outputs['logps']"


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
    ``nonfinite_pairs``       pairs left out for a non-finite log-prob (when > 0)
    ========================= ==========================================

    ``pair_layout``: ``'interleaved'`` (Twinkle's ``[c1, r1, c2, r2, …]`` in
    every microbatch, the default) or ``'halves'`` (TRL's concatenated
    ``[c1, …, cn, r1, …, rn]`` in every microbatch). A microbatch with an odd
    number of sequences is a ``ValueError``. In a packed microbatch (``cu_seqlens``,
    :mod:`..inputs.packed`) the sequences are its sub-sequences.

    ``accumulate(inputs, outputs, *, ref_outputs=None, ref_logps=None, pair_layout=None)``:
    ``outputs['logps']`` and ``ref_outputs['logps']`` (or ``ref_logps``) shaped
    like ``labels`` (or gathered over CP while the labels are local, and the
    reverse), one tensor for the batch or a list per microbatch.

    >>> import torch
    >>> from twinkle_megatron import DPOMetric
    >>> metric = DPOMetric(beta=0.1)
    >>> labels = torch.tensor([[1, 2], [3, 4]])  # one (chosen, rejected) pair
    >>> metric.accumulate({"labels": labels}, {"logps": torch.tensor([[-1.0, -1.0], [-3.0, -1.0]])},
    ...                   ref_outputs={"logps": torch.tensor([[-2.0, -1.0], [-2.0, -1.0]])})
    >>> result = metric.calculate()
    >>> round(result["rewards/margins"], 6), result["rewards/accuracies"]
    (0.2, 1.0)
    """

    call_keywords = ("pair_layout", "ref_outputs", "ref_logps", "group_ids")
    output_keys = ("logps",)

    def __init__(self, device_mesh: Any = None, process_group: Any = None, ignore_index: int = -100,
                 beta: float = 0.1, pair_layout: str = "interleaved", **kwargs: Any) -> None:
        super().__init__(device_mesh, process_group, **kwargs)
        _check_layout(pair_layout)
        self.ignore_index = ignore_index
        self.beta = float(beta)
        self.pair_layout = pair_layout
        for name in ("pairs", "chosen_logps", "rejected_logps", "ref_pairs", "ref_chosen_logps", "ref_rejected_logps",
                     "chosen_rewards", "rejected_rewards", "margins", "correct_pairs"):
            self.add_state(name, "sum", grouped=True)
        self.add_state("nonfinite_pairs", "sum")

    def accumulate(self, inputs: Any, outputs: Any, **kwargs: Any) -> None:
        """Add the pairs of a call; ``ref_outputs`` (or ``ref_logps``) and ``pair_layout`` are per-call
        values (keyword first, then ``outputs``, then the constructor's)."""
        if outputs is None or not given(outputs.get("logps")):
            return
        layout = _check_layout(call_value("pair_layout", kwargs, outputs, self.pair_layout))
        ref_outputs = call_value("ref_outputs", kwargs, outputs)
        ref_logps = ref_outputs.get("logps") if ref_outputs is not None else None
        ref_logps = ref_logps if given(ref_logps) else call_value("ref_logps", kwargs, outputs)
        # The reference log-probs under the name a user knows them by (error messages say it).
        source = {"logps": outputs["logps"], REF_LOGPS: ref_logps, "group_ids": outputs.get("group_ids")}
        spec = ViewSpec("DPOMetric", "logps", per_token=(REF_LOGPS,), ignore_index=self.ignore_index,
                        cp_gathered=self.cp_gathered,
                        group_key=self.group_key if self.group_names else None)
        batches = microbatch_views(inputs, source, kwargs, spec, self.context)
        for index, batch in enumerate(batches):  # all checks before any state changes
            sequences = batch.sequence_count
            if sequences % 2:
                raise ValueError(f"DPOMetric needs whole (chosen, rejected) pairs ({layout} layout), but "
                                 f"microbatch {index} holds {sequences} sequences (an odd number)")
        for batch in batches:
            if batch.counts_here:
                self._accumulate_microbatch(batch, layout)

    def _accumulate_microbatch(self, batch: MicrobatchView, layout: str) -> None:
        logps = batch.tensors["logps"]
        device = logps.device
        selected = batch.selected
        zero = torch.zeros((), dtype=torch.float64, device=device)
        policy = logps.to(torch.float64)
        ref = batch.tensors.get(REF_LOGPS)
        ref = to_device(ref, device).to(torch.float64) if ref is not None else None
        finite = all_finite([policy] if ref is None else [policy, ref])
        tokens = batch.sequence_sum(selected.to(torch.float64))  # per row, or per packed sub-sequence
        nonfinite = batch.sequence_sum((selected & ~finite).to(torch.float64))
        sequence_logps = batch.sequence_sum(torch.where(selected & finite, policy, zero))
        chosen, rejected = _split_pairs(sequence_logps, layout)
        pair_tokens, pair_nonfinite = (sum(_split_pairs(t, layout)) for t in (tokens, nonfinite))
        if ref is not None:
            ref_logps = batch.sequence_sum(torch.where(selected & finite, ref, zero))
            ref_chosen, ref_rejected = _split_pairs(ref_logps, layout)
            chosen_rewards = self.beta * (chosen - ref_chosen)
            rejected_rewards = self.beta * (rejected - ref_rejected)
            margins = chosen_rewards - rejected_rewards
        else:
            margins = torch.zeros_like(chosen)
        # Sequence-level: complete each pair's counts and margin over CP before comparing.
        pair_tokens, full_margins, pair_nonfinite = sum_over_context_parallel(
            torch.stack([pair_tokens, margins, pair_nonfinite], -1), self.context, batch.cp_gathered).unbind(-1)
        clean = pair_nonfinite == 0
        counted = (pair_tokens > 0) & clean
        counts_here = counts_sequences_here(self.context, batch.cp_gathered)  # CP ranks share each pair
        # A pair's group is its chosen sequence's (both sequences of a pair come from one dataset).
        groups = self._token_groups(batch.group_ids, selected, selected)
        if groups is not None:
            groups = groups.of_sequences().select(lambda rows: _split_pairs(rows, layout)[0])

        # A pair with a non-finite log-prob adds nothing (``clean``); every statistic added in one op.
        sums = {"pairs": counted & counts_here, "chosen_logps": chosen, "rejected_logps": rejected}
        if ref is not None:
            sums.update({"ref_pairs": counted & counts_here, "ref_chosen_logps": ref_chosen,
                         "ref_rejected_logps": ref_rejected, "chosen_rewards": chosen_rewards,
                         "rejected_rewards": rejected_rewards, "margins": margins,
                         "correct_pairs": counted & (full_margins > 0) & counts_here})
        self._add_token_sums(sums, clean, groups,
                             {"nonfinite_pairs": ((pair_tokens > 0) & ~clean & counts_here).sum(dtype=torch.float64)})

    def compute(self, states: SyncedStates) -> dict[str, Number]:
        results: dict[str, Number] = states.counts(("nonfinite_pairs",))
        pairs = states["pairs"]
        if pairs == 0:
            return results
        results.update({
            "logps/chosen": states["chosen_logps"] / pairs,
            "logps/rejected": states["rejected_logps"] / pairs,
        })
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
