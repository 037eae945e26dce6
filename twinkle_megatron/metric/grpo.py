r"""GRPO, GSPO and CISPO policy diagnostics, correct under tensor, pipeline, context and data parallelism.

Twinkle's ``GRPOMetric`` / ``GSPOMetric`` / ``CISPOMetric`` (same keywords, same
``accumulate`` arguments, same result keys), with device states, no host sync
per microbatch, and the collection's one sync.

**Inputs.** ``outputs['logps']``: the policy's per-token log-probabilities of
the labels, shaped like ``labels`` (one tensor for the batch or a list per
microbatch). ``old_logps`` and ``advantages`` cover every sequence of the
``accumulate`` call, in order, in any of these forms:

* Twinkle's: a list with one entry per sequence, either a number (spread over
  the sequence's counted tokens) or a 1-D array with the values of the
  sequence's counted tokens in order (scattered onto them, like Twinkle's
  ``align_logps_to_mask``);
* a 1-D tensor with one number per sequence;
* a tensor shaped like the logps of the whole call, or a list with one tensor
  per microbatch shaped like that microbatch's logps.

**Sequence-level statistics under context parallelism.** With CP each rank
holds two chunks of every sequence (Megatron's load-balanced split). Token
statistics are sums, so each CP rank adds its own tokens and the collection's
SUM does the rest. GSPO's clip rate is different: it compares the
geometric-mean ratio of a *whole* sequence with ``1 ± ε``, a nonlinearity, so
each sequence's partial sums ``(Σ d·m, Σ m, Σ A·m)`` must be complete before the
comparison. :func:`sum_over_context_parallel` adds them over the CP group:
**one all-reduce of a ``[b, 3]`` float64 tensor per microbatch**, only for GSPO,
only when ``cp_size > 1`` and the data is not ``cp_gathered``; it is
asynchronous to the host on NCCL and as small as the microbatch's sequence
count. The alternatives were worse: shaped states indexed by a global sequence
id are free at ``calculate()`` but need a maximum number of sequences per step
declared identically on every rank (a new user-facing limit that fails when
exceeded); per-sequence object records add a pickled all-gather over the whole
reduction group to every ``calculate()`` under CP. Per-sequence arrays of
``old_logps``/``advantages`` cannot be placed on a CP chunk without knowing how
many counted tokens the other chunks hold, so under CP (not ``cp_gathered``)
they must come as tensors shaped like this rank's logps, or as one number per
sequence; anything else is a ``ValueError``.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional

import torch

from .base import Metric, Number, StateValues
from .inputs import check_same_shape, microbatches, to_device, token_mask
from .sequences import (
    as_rows,
    global_positions,
    labels_2d,
    split_per_microbatch,
    sum_over_context_parallel,
    token_values,
)
from .token_stats import microbatch_token_stats

RECORD_FIELDS = ("kl", "ratio", "logp_new", "logp_old", "token_id", "sequence", "position", "call")


class GRPOMetric(Metric):
    r"""Policy-optimisation diagnostics for GRPO (token-level clipping), Twinkle's ``GRPOMetric``.

    Over counted tokens ``t`` (``labels != ignore_index`` and ``completion_mask``,
    all inputs finite), with ``T`` = ``temperature`` (log-probs are multiplied
    by ``T`` when ``T > 0`` and ``T ≠ 1``, as Twinkle does, both new and old),
    ``d_t = T·(logp_new − logp_old)``, ``r_t = e^{d_t}``, ``A_t`` the advantage;
    every sum runs over tokens, microbatches and DP×CP ranks, every max over all
    of them:

    ======================== ============================================================
    ``train/mean_new_logp``  Σ T·logp_new / N
    ``train/policy_confidence`` exp(mean_new_logp)
    ``train/mean_old_logp``  Σ T·logp_old / N_old             (tokens that have old log-probs)
    ``train/logp_diff_mean`` Σ d / N_old
    ``train/approx_kl``      Σ (r − d − 1) / N_old             (Schulman k3 of KL(old ‖ new))
    ``train/token_kl_max``   max (r − d − 1)
    ``train/token_ratio_max`` max r
    ``train/entropy``        Σ H / N_H                         (``outputs['entropies']``, else from the
                                                               vocab-parallel logits / token statistics)
    ``train/clip_ratio_low`` Σ [r < 1 − ε, A < 0] / N_clip     (tokens with old log-probs and advantages)
    ``train/clip_ratio_high`` Σ [r > 1 + ε_high, A > 0] / N_clip
    ``train/clip_ratio``     clip_ratio_low + clip_ratio_high
    ======================== ============================================================

    ``epsilon_high`` defaults to ``epsilon``. Tokens with a non-finite input
    are left out of everything and counted in ``train/nonfinite_tokens``;
    per-sequence arrays (of ``old_logps`` or ``advantages``) that do not hold
    one value per counted token are counted in ``train/misaligned_arrays``
    (Twinkle truncates or zero-fills them silently); both reported when > 0.

    ``top_k_kl > 0`` adds ``_high_kl_records``: the K tokens of highest k3 over
    all ranks (k3 > 0), highest first, each
    ``{'gsi', 'pos', 'token_id', 'kl', 'ratio', 'logp_new', 'logp_old'}`` where
    ``gsi`` is the sequence's index in the global batch (calls since the last
    ``calculate()`` follow each other; DP ranks hold consecutive blocks) and
    ``pos`` its position in the whole sequence (CP chunks mapped back). They
    cost one extra all-gather per ``calculate()``, only when enabled.

    ``accumulate(inputs, outputs, old_logps=None, advantages=None)``: see the
    module docstring for the accepted forms; ``outputs`` may carry
    ``entropies`` (shaped like the labels), or ``logits`` (this rank's vocab
    shard, ``vocab_size`` / ``logits_layout`` as for :class:`Accuracy`) or
    ``token_stats`` from which the entropy is taken.
    """

    def __init__(self, device_mesh: Any = None, process_group: Any = None, ignore_index: int = -100,
                 temperature: float = 1.0, epsilon: float = 0.2, epsilon_high: Optional[float] = None,
                 top_k_kl: int = 0, vocab_size: Optional[int] = None, logits_layout: Optional[str] = None,
                 **kwargs: Any) -> None:
        super().__init__(device_mesh, process_group, **kwargs)
        self.ignore_index = ignore_index
        self.temperature = float(temperature)
        self.epsilon = float(epsilon)
        self.epsilon_high = float(epsilon_high) if epsilon_high is not None else float(epsilon)
        self.top_k_kl = int(top_k_kl)
        self.vocab_size = vocab_size
        self.logits_layout = logits_layout
        for name in ("tokens", "new_logp_sum", "entropy_tokens", "entropy_sum", "old_tokens", "old_logp_sum",
                     "logp_diff_sum", "approx_kl_sum", "clip_low", "clip_high", "clip_total", "nonfinite_tokens",
                     "misaligned_arrays"):
            self.add_state(name, "sum")
        self.add_state("token_kl_max", "max")
        self.add_state("token_ratio_max", "max")
        self._top_kl: Optional[torch.Tensor] = None  # [k, len(RECORD_FIELDS)] float64, on the device
        self._sequences_per_call: list[int] = []

    # ------------------------------------------------------------ accumulate

    def accumulate(self, inputs: Any, outputs: Any, *, old_logps: Any = None, advantages: Any = None,
                   vocab_size: Optional[int] = None, logits_layout: Optional[str] = None, **kwargs: Any) -> None:
        if outputs is None or outputs.get("logps") is None:
            return
        pairs = microbatches(inputs, outputs, ("logps", "entropies", "logits", "token_stats"))
        shapes = [self._checked_shape(batch, output) for batch, output in pairs]  # before any state changes
        whole_sequences = self.cp_gathered or self.context.cp_size == 1
        old_per_batch = split_per_microbatch(old_logps, "old_logps", shapes, whole_sequences)
        advantages_per_batch = split_per_microbatch(advantages, "advantages", shapes, whole_sequences)
        first_sequence = 0
        for (batch, output), old, advantage, shape in zip(pairs, old_per_batch, advantages_per_batch, shapes):
            self._accumulate_microbatch(batch, output, old, advantage, first_sequence,
                                        vocab_size or self.vocab_size, logits_layout or self.logits_layout)
            first_sequence += shape[0]
        self._sequences_per_call.append(first_sequence)

    def _checked_shape(self, batch: Any, output: Any) -> tuple[int, ...]:
        """The microbatch's ``[sequences, length]``; ``ValueError`` when a per-token tensor disagrees."""
        labels, logps = labels_2d(batch, type(self).__name__), as_rows(output["logps"])
        check_same_shape("labels", labels, "logps", logps)
        if output.get("entropies") is not None:
            check_same_shape("labels", labels, "entropies", as_rows(output["entropies"]))
        if batch.get("completion_mask") is not None:
            check_same_shape("labels", labels, "completion_mask", as_rows(batch["completion_mask"]))
        if self.top_k_kl > 0:
            global_positions(logps.shape[-1], self.context, self.cp_gathered)  # raises for an odd CP chunk pair
        return tuple(logps.shape)

    def _accumulate_microbatch(self, batch: Any, output: Any, old: Any, advantage: Any, first_sequence: int,
                               vocab_size: Optional[int], logits_layout: Optional[str]) -> None:
        logps = as_rows(output["logps"])
        device = logps.device
        labels = to_device(labels_2d(batch, type(self).__name__), device)
        completion_mask = batch.get("completion_mask")
        if completion_mask is not None:
            completion_mask = to_device(as_rows(completion_mask), device)
        mask = token_mask(labels, completion_mask, self.ignore_index)
        scale = self.temperature if self.temperature > 0 and self.temperature != 1.0 else 1.0
        new = logps.to(torch.float64) * scale
        finite = torch.isfinite(new)

        entropy = self._entropy(batch, output, labels, vocab_size, logits_layout)
        if entropy is not None:
            finite &= torch.isfinite(entropy)
        old_tokens = advantage_tokens = None
        if old is not None:
            old_tokens, misaligned = token_values(old, mask)
            old_tokens = old_tokens * scale
            finite &= torch.isfinite(old_tokens)
            self._add("misaligned_arrays", misaligned)
        if old is not None and advantage is not None:
            advantage_tokens, misaligned = token_values(advantage, mask)
            finite &= torch.isfinite(advantage_tokens)
            self._add("misaligned_arrays", misaligned)
        valid = mask & finite
        zero = torch.zeros((), dtype=torch.float64, device=device)
        self._add("nonfinite_tokens", (mask & ~finite).sum())
        self._add("tokens", valid.sum())
        self._add("new_logp_sum", torch.where(valid, new, zero).sum())
        if entropy is not None:
            self._add("entropy_tokens", valid.sum())
            self._add("entropy_sum", torch.where(valid, entropy.to(torch.float64), zero).sum())
        if old_tokens is None:
            return

        log_ratio = torch.where(valid, new - old_tokens, zero)
        ratio = torch.exp(log_ratio)
        kl = ratio - log_ratio - 1.0
        self._add("old_tokens", valid.sum())
        self._add("old_logp_sum", torch.where(valid, old_tokens, zero).sum())
        self._add("logp_diff_sum", log_ratio.sum())
        self._add("approx_kl_sum", torch.where(valid, kl, zero).sum())
        if valid.numel() > 0:
            minus_inf = torch.full((), float("-inf"), dtype=torch.float64, device=device)
            self._maximum("token_kl_max", torch.where(valid, kl, minus_inf).max())
            self._maximum("token_ratio_max", torch.where(valid, ratio, minus_inf).max())
        if advantage_tokens is not None:
            low, high, total = self._clip_counts(log_ratio, advantage_tokens, valid)
            self._add("clip_low", low)
            self._add("clip_high", high)
            self._add("clip_total", total)
        if self.top_k_kl > 0:
            self._keep_top_kl(kl, ratio, new, old_tokens, labels, valid, first_sequence)

    def _entropy(self, batch: Any, output: Any, labels: torch.Tensor, vocab_size: Optional[int],
                 logits_layout: Optional[str]) -> Optional[torch.Tensor]:
        """Per-token entropy shaped like ``labels``: given, or from the (vocab-parallel) logits."""
        if output.get("entropies") is not None:
            return to_device(as_rows(output["entropies"]), labels.device)
        if output.get("logits") is None and output.get("token_stats") is None:
            return None
        stats = microbatch_token_stats(batch, output, self.context, vocab_size, logits_layout, self.ignore_index)
        return to_device(stats.entropy.reshape(labels.shape), labels.device)

    def _clip_counts(self, log_ratio: torch.Tensor, advantages: torch.Tensor,
                     valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(clipped low, clipped high, out of): token-level, gated by the advantage sign."""
        ratio = torch.exp(log_ratio)
        low = valid & (ratio < 1 - self.epsilon) & (advantages < 0)
        high = valid & (ratio > 1 + self.epsilon_high) & (advantages > 0)
        return low.sum(), high.sum(), valid.sum()

    # ------------------------------------------------------ top-K KL records

    def _keep_top_kl(self, kl: torch.Tensor, ratio: torch.Tensor, new: torch.Tensor, old: torch.Tensor,
                     labels: torch.Tensor, valid: torch.Tensor, first_sequence: int) -> None:
        """Merge this microbatch's highest-k3 tokens into the running top K (device ops only)."""
        sequence_length = kl.shape[-1]
        candidates = torch.where(valid, kl, torch.full_like(kl, float("-inf"))).reshape(-1)
        k = min(self.top_k_kl, candidates.numel())
        if k == 0:
            return
        top, index = candidates.topk(k)
        rows, columns = index // sequence_length, index % sequence_length
        positions = global_positions(sequence_length, self.context, self.cp_gathered, kl.device)
        fields = torch.stack([
            top, ratio.reshape(-1)[index], new.reshape(-1)[index], old.reshape(-1)[index],
            labels.reshape(-1)[index].to(torch.float64), (rows + first_sequence).to(torch.float64),
            positions[columns].to(torch.float64),
            torch.full_like(top, float(len(self._sequences_per_call))),
        ], dim=1)
        merged = fields if self._top_kl is None else torch.cat([self._top_kl, fields.to(self._top_kl.device)])
        keep = merged[:, 0].topk(min(self.top_k_kl, merged.shape[0])).indices
        self._top_kl = merged[keep]

    def _local_records(self) -> Optional[list]:
        if self.top_k_kl <= 0:
            return None
        dp_rank = self.context.dp_rank
        records: list = [("sequences", call, dp_rank, count) for call, count in enumerate(self._sequences_per_call)]
        if self._top_kl is not None:
            rows = self._top_kl[self._top_kl[:, 0] > 0].tolist()  # calculate() time: host sync allowed
            records += [("token", dp_rank, dict(zip(RECORD_FIELDS, row))) for row in rows]
        return records

    def _global_top_kl(self) -> list[dict[str, Number]]:
        """The top-K records of all ranks, with sequence indices in the global batch."""
        counts: dict[tuple[int, int], int] = {}
        tokens = []
        for record in self.gathered_records:
            if record[0] == "sequences":
                _, call, dp_rank, count = record
                counts[(call, dp_rank)] = max(count, counts.get((call, dp_rank), 0))  # CP ranks agree
            else:
                tokens.append(record[1:])
        offsets, running = {}, 0
        for call, dp_rank in sorted(counts):
            offsets[(call, dp_rank)] = running
            running += counts[(call, dp_rank)]
        results = [{
            "gsi": offsets.get((int(fields["call"]), dp_rank), 0) + int(fields["sequence"]),
            "pos": int(fields["position"]),
            "token_id": int(fields["token_id"]),
            "kl": fields["kl"],
            "ratio": fields["ratio"],
            "logp_new": fields["logp_new"],
            "logp_old": fields["logp_old"],
        } for dp_rank, fields in tokens]
        results.sort(key=lambda r: (-r["kl"], r["gsi"], r["pos"]))
        return results[:self.top_k_kl]

    # --------------------------------------------------------------- results

    def compute(self, states: StateValues) -> dict[str, Number]:
        results: dict[str, Any] = {}
        tokens = states["tokens"]
        if tokens > 0:
            mean_new = states["new_logp_sum"] / tokens
            results["train/policy_confidence"] = math.exp(mean_new)
            results["train/mean_new_logp"] = mean_new
        old_tokens = states["old_tokens"]
        if old_tokens > 0:
            results["train/mean_old_logp"] = states["old_logp_sum"] / old_tokens
            results["train/logp_diff_mean"] = states["logp_diff_sum"] / old_tokens
            results["train/approx_kl"] = states["approx_kl_sum"] / old_tokens
            results["train/token_kl_max"] = states["token_kl_max"]
            results["train/token_ratio_max"] = states["token_ratio_max"]
        if states["entropy_tokens"] > 0:
            results["train/entropy"] = states["entropy_sum"] / states["entropy_tokens"]
        clip_total = states["clip_total"]
        if clip_total > 0:
            results["train/clip_ratio_low"] = states["clip_low"] / clip_total
            results["train/clip_ratio_high"] = states["clip_high"] / clip_total
            results["train/clip_ratio"] = (states["clip_low"] + states["clip_high"]) / clip_total
        if states["nonfinite_tokens"] > 0:
            results["train/nonfinite_tokens"] = int(states["nonfinite_tokens"])
        if states["misaligned_arrays"] > 0:
            results["train/misaligned_arrays"] = int(states["misaligned_arrays"])
        if self.top_k_kl > 0 and tokens > 0:
            records = self._global_top_kl()
            if records:
                results["_high_kl_records"] = records
        return results

    def reset(self) -> None:
        super().reset()
        self._top_kl = None
        self._sequences_per_call = []

    def state_dict(self) -> dict[str, Any]:
        top_kl = None if self._top_kl is None else self._top_kl.detach().cpu().clone()
        return {**super().state_dict(), "top_kl": top_kl, "sequences_per_call": list(self._sequences_per_call)}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        super().load_state_dict(state_dict)
        top_kl = state_dict.get("top_kl")
        self._top_kl = None if top_kl is None else top_kl.to(self._state_device())
        self._sequences_per_call = list(state_dict.get("sequences_per_call", []))


class GSPOMetric(GRPOMetric):
    r"""Twinkle's ``GSPOMetric``: :class:`GRPOMetric` with the clip rate on whole sequences.

    For each sequence with counted tokens (``N_s > 0``), the geometric-mean ratio
    and the mean advantage

        ρ_s = exp(Σ_t d_t / N_s),      Ā_s = Σ_t A_t / N_s

    give ``clip_ratio_low = #{ρ_s < 1 − ε, Ā_s < 0} / #sequences`` and
    ``clip_ratio_high = #{ρ_s > 1 + ε_high, Ā_s > 0} / #sequences``, counted over
    microbatches and DP ranks. Under context parallelism the three per-sequence
    sums are first added over the CP group (one all-reduce per microbatch, see
    the module docstring). The other keys are :class:`GRPOMetric`'s.
    """

    def _clip_counts(self, log_ratio: torch.Tensor, advantages: torch.Tensor,
                     valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        weights = valid.to(torch.float64)
        partial = torch.stack([(log_ratio * weights).sum(-1), weights.sum(-1), (advantages * weights).sum(-1)], -1)
        log_ratio_sum, tokens, advantage_sum = sum_over_context_parallel(partial, self.context,
                                                                         self.cp_gathered).unbind(-1)
        ratio = torch.exp(log_ratio_sum / tokens.clamp(min=1.0))
        counted = tokens > 0
        low = counted & (ratio < 1 - self.epsilon) & (advantage_sum < 0)
        high = counted & (ratio > 1 + self.epsilon_high) & (advantage_sum > 0)
        once = 1.0 if self.context.counts_sequences(self.cp_gathered) else 0.0
        return low.sum() * once, high.sum() * once, counted.sum() * once


class CISPOMetric(GRPOMetric):
    r"""Twinkle's ``CISPOMetric``: :class:`GRPOMetric` with the clip rate not gated by the advantage.

        clip_ratio_low = Σ [r < 1 − ε] / N_clip,     clip_ratio_high = Σ [r > 1 + ε_high] / N_clip

    over the tokens that have old log-probs and advantages (as in Twinkle, the
    clip rate is only reported when advantages are passed).
    """

    def _clip_counts(self, log_ratio: torch.Tensor, advantages: torch.Tensor,
                     valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ratio = torch.exp(log_ratio)
        low = valid & (ratio < 1 - self.epsilon)
        high = valid & (ratio > 1 + self.epsilon_high)
        return low.sum(), high.sum(), valid.sum()
