r"""GRPO, GSPO and CISPO policy diagnostics, correct under tensor, pipeline, context and data parallelism.

Twinkle's ``GRPOMetric`` / ``GSPOMetric`` / ``CISPOMetric`` (same keywords, same
``accumulate`` arguments, same result keys), with device states, no host sync
per microbatch, and the collection's one sync.

**Inputs.** ``outputs['logps']``: the policy's per-token log-probabilities of
the labels, shaped like ``labels`` (one tensor for the batch or a list per
microbatch). ``old_logps`` and ``advantages`` cover every sequence of the
``accumulate`` call, in order, in any of these forms:

* Twinkle's: a list with one entry per sequence, either a number (spread over
  the sequence's selected tokens) or a 1-D array with the values of the
  sequence's selected tokens in order (scattered onto them, like Twinkle's
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
import warnings
from typing import Any, Mapping, NamedTuple, Optional

import torch

from ..inputs.keywords import check_layout_declared
from ..inputs.microbatches import call_value, given
from ..inputs.shared_call import SharedCall
from ..inputs.tensors import all_finite, as_rows, check_same_shape, to_device
from ..inputs.view import MicrobatchView, ViewSpec, logits_sequence_dim
from ..state.base import Metric, Number, SyncedStates
from ..state.groups import TokenSlices
from ..state.resume import counts_loaded_sums_here
from ..state.token_sums import max_totals, sum_totals
from ..tokens.logits_pass import call_token_stats, check_vocab_size
from ..tokens.sequence_totals import counts_sequences_here, sum_over_context_parallel
from .high_kl_records import HighKLRecords, global_top_kl, saved_state
from .rollout_mismatch import MISMATCH_MAX, check_threshold, declare_mismatch_states, mismatch_results, mismatch_terms


class TokenTerms(NamedTuple):
    """A microbatch's per-token terms of GRPO's family and the totals of their states (the same for each metric
    of the family: computed once per call, see :meth:`.SharedCall.shared`)."""

    sums: dict[str, torch.Tensor]  # state name -> what to add: totals, twins' per-slice totals, counts
    maxima: dict[str, torch.Tensor]  # state name -> what to apply to its max
    misaligned: Any  # the misaligned-array count when a host number (else in ``sums``)
    counted: torch.Tensor  # the selected tokens with every input finite
    labels: torch.Tensor
    new: torch.Tensor
    old: Optional[torch.Tensor]
    advantages: Optional[torch.Tensor]
    log_ratio: Optional[torch.Tensor]
    ratio: Optional[torch.Tensor]
    kl: Optional[torch.Tensor]


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
    per-sequence arrays (of ``old_logps``, ``advantages`` or ``rollout_logps``)
    that do not hold one value per selected token are counted in
    ``train/misaligned_arrays`` and their sequences are left out of every key,
    as if absent (Twinkle truncates or zero-fills them silently, which invents
    values); both reported when > 0.

    ``top_k_kl > 0`` adds ``_high_kl_records``: the K tokens of highest k3 over
    all ranks (k3 > 0), highest first, each
    ``{'gsi', 'pos', 'token_id', 'kl', 'ratio', 'logp_new', 'logp_old'}`` where
    ``gsi`` is the sequence's index in the global batch (calls since the last
    ``calculate()`` follow each other; DP ranks hold consecutive blocks) and
    ``pos`` its position in the whole sequence (CP chunks mapped back). They
    cost one extra all-gather per ``calculate()``, only when enabled.

    ``rollout_logps`` (the inference engine's, in the forms of ``old_logps``)
    adds the train–inference mismatch keys (:mod:`.rollout_mismatch`);
    ``rollout_threshold`` is its |Δ| threshold.

    ``accumulate(inputs, outputs, old_logps=None, advantages=None, rollout_logps=None)``: see the
    module docstring for the accepted forms; ``outputs`` may carry
    ``entropies`` (shaped like the labels), or ``logits`` (this rank's vocab
    shard, ``vocab_size`` / ``logits_layout`` as for :class:`Accuracy`) or
    ``token_stats`` from which the entropy is taken.

    >>> import math, torch
    >>> from twinkle_megatron import GRPOMetric
    >>> metric = GRPOMetric(epsilon=0.2)
    >>> logps = torch.tensor([[math.log(0.5), math.log(0.25)]])  # the policy's, per token
    >>> old = [[math.log(0.25), math.log(0.25)]]  # Twinkle's ragged per-sequence list
    >>> metric.accumulate({"labels": torch.tensor([[3, 4]])}, {"logps": logps}, old_logps=old, advantages=[1.0])
    >>> result = metric.calculate()
    >>> result["train/clip_ratio_high"], round(result["train/token_ratio_max"], 6)  # ratio 2 > 1.2 with A > 0
    (0.5, 2.0)
    """

    call_keywords = ("old_logps", "advantages", "rollout_logps", "vocab_size", "logits_layout", "group_ids")
    output_keys = ("logps",)
    token_statistics = ("entropy",)  # train/entropy, when the outputs bring no entropies
    reports_positions = True

    def __init__(self, device_mesh: Any = None, process_group: Any = None, ignore_index: int = -100,
                 temperature: float = 1.0, epsilon: float = 0.2, epsilon_high: Optional[float] = None,
                 top_k_kl: int = 0, vocab_size: Optional[int] = None, logits_layout: Optional[str] = None,
                 rollout_threshold: float = 0.5, **kwargs: Any) -> None:
        super().__init__(device_mesh, process_group, **kwargs)
        self.ignore_index = ignore_index
        self.temperature = float(temperature)
        self.epsilon = float(epsilon)
        self.epsilon_high = float(epsilon_high) if epsilon_high is not None else float(epsilon)
        self.top_k_kl = int(top_k_kl)
        self.vocab_size = check_vocab_size(vocab_size)
        self.logits_layout = logits_layout
        self.rollout_threshold = check_threshold(rollout_threshold)
        declare_mismatch_states(self)
        for name in ("tokens", "new_logp_sum", "entropy_tokens", "entropy_sum", "old_tokens", "old_logp_sum",
                     "logp_diff_sum", "approx_kl_sum", "clip_low", "clip_high", "clip_total"):
            self.add_state(name, "sum", grouped=True)
        for name in ("nonfinite_tokens", "misaligned_arrays"):
            self.add_state(name, "sum")
        self.add_state("token_kl_max", "max", grouped=True)
        self.add_state("token_ratio_max", "max", grouped=True)
        self._high_kl = HighKLRecords(self.top_k_kl)
        self._warned_entropy = False

    # ------------------------------------------------------------ accumulate

    def accumulate_call(self, call: SharedCall) -> None:
        """Add a call's microbatches; ``old_logps``, ``advantages``, ``vocab_size``, ``logits_layout``
        are per-call values (keyword first, then ``outputs``, then the constructor's)."""
        outputs, kwargs = call.outputs, call.kwargs
        if outputs is None or not given(outputs.get("logps")):
            return
        vocab_size = check_vocab_size(call_value("vocab_size", kwargs, outputs, self.vocab_size))
        layout = call_value("logits_layout", kwargs, outputs, self.logits_layout)
        # Advantages count only next to old log-probs: without these, they are not read at all.
        with_old = given(kwargs.get("old_logps")) or given(outputs.get("old_logps"))
        spec = ViewSpec(type(self).__name__, "logps", per_token=("entropies",), paired=("logits", "token_stats"),
                        per_sequence=("old_logps", "advantages", "rollout_logps") if with_old else ("rollout_logps",),
                        positions=self.top_k_kl > 0 or self.position_buckets is not None,
                        ignore_index=self.ignore_index, cp_gathered=self.cp_gathered,
                        group_key=self.group_key if self.group_names else None)
        views = call.views(spec, self.context)
        for view in views:  # every check before any state changes
            stats = view.output.get("token_stats")
            if stats is not None and "entropies" not in view.tensors:
                check_same_shape("logps", view.tensors["logps"], "token_stats", as_rows(stats.entropy))
        for view in views:
            if view.counts_here:
                self._accumulate_microbatch(call, view, vocab_size, layout)
        self._high_kl.end_call(sum(view.sequence_count for view in views))

    def token_statistics_for(self, outputs: Any) -> tuple[str, ...]:
        """None of the logits' statistics when the call brings ``entropies`` (Twinkle's model forward computes
        them) or ``token_stats``: ``train/entropy`` comes from those."""
        if isinstance(outputs, Mapping) and (given(outputs.get("entropies")) or given(outputs.get("token_stats"))):
            return ()
        return self.token_statistics

    def _logits_for_entropy(self, batch: MicrobatchView, layout: Optional[str]) -> Optional[torch.Tensor]:
        """The microbatch's logits if they cover the same positions as its (aligned) log-probs.

        Logits are always this CP rank's chunks; log-probs gathered over CP
        (Twinkle's Megatron model) hold whole sequences, so no entropy can be
        paired with them here: then ``train/entropy`` needs ``outputs['entropies']``
        gathered like the log-probs, and a warning says so once.
        """
        logits = batch.output.get("logits")
        if logits is None:
            return None
        labels = batch.tensors["labels"]
        check_layout_declared(self, logits, labels, layout)
        if logits.shape[logits_sequence_dim(logits, labels, layout)] == labels.shape[-1]:
            return logits
        if not self._warned_entropy:
            self._warned_entropy = True
            warnings.warn(f"{type(self).__name__}: the logits hold this context-parallel rank's chunks but the logps "
                          "whole sequences; train/entropy is not computed from them (pass outputs['entropies'] "
                          "gathered like the logps)", RuntimeWarning, stacklevel=4)
        return None

    def _accumulate_microbatch(self, call: SharedCall, batch: MicrobatchView, vocab_size: Optional[int],
                               layout: Optional[str]) -> None:
        selected = batch.selected
        positions = batch.sequence_positions if self.position_buckets is not None else None
        groups = self._token_groups(batch.group_ids, selected, selected, positions)
        # GRPO, GSPO, CISPO and PPO of one call read the same microbatch view alike but for their clip counts:
        # the per-token terms and their totals are computed once per call, under the view's key and every
        # option they depend on (the methods that make them: a subclass may make them its own way).
        key = ("grpo_terms", batch.key, self._token_terms.__func__, self._entropy.__func__, self.context,
               self.ignore_index, self.temperature, self.rollout_threshold, vocab_size, layout, self.group_names,
               self.position_buckets)
        terms = call.shared(key, lambda: self._token_terms(call, batch, selected, groups, vocab_size, layout))
        sums = terms.sums
        if terms.log_ratio is not None and terms.advantages is not None:
            low, high, total = self.clip_counts(terms, batch)
            # Token-level clip counts group like the tokens; GSPO's per-sequence ones by each sequence's group.
            clip_groups = groups if low.dim() == 2 or groups is None else groups.of_sequences()
            sums = {**sums, **sum_totals(self.state_specs, {"clip_low": low, "clip_high": high, "clip_total": total},
                                         None, clip_groups)}
        self._apply_totals(sums, terms.maxima)  # this metric's states: one add, one max
        if not isinstance(terms.misaligned, torch.Tensor):  # a host number (no per-sequence arrays)
            self._add("misaligned_arrays", terms.misaligned)
        if self.top_k_kl > 0 and terms.log_ratio is not None:
            self._high_kl.keep(terms.kl, terms.ratio, terms.new, terms.old, terms.labels, terms.counted,
                               batch.first_sequence, batch.positions)

    def _token_terms(self, call: SharedCall, batch: MicrobatchView, selected: torch.Tensor,
                     groups: Optional[TokenSlices], vocab_size: Optional[int], layout: Optional[str]) -> TokenTerms:
        """The microbatch's per-token terms and the totals of every state but the clip counts: each statistic
        masked by ``counted`` (selected, every input finite) and reduced together (see :mod:`..state.token_sums`)."""
        logps = batch.tensors["logps"]
        labels = to_device(batch.labels, logps.device)
        scale = self.temperature if self.temperature > 0 and self.temperature != 1.0 else 1.0
        new = logps.to(torch.float64) * scale if scale != 1.0 else logps.to(torch.float64)
        entropy = self._entropy(call, batch, labels, vocab_size, layout)
        per_token, misaligned = {}, batch.misaligned_arrays
        for name, key, factor in (("rollout", "rollout_logps", 1.0), ("old", "old_logps", scale),
                                  ("advantages", "advantages", 1.0)):
            values = batch.values.get(key)  # advantages come only with old log-probs (see accumulate)
            if values is not None:
                per_token[name] = values * factor if factor != 1.0 else values  # old log-probs: T·logp_old
        finite = all_finite([new, *([] if entropy is None else [entropy]), *per_token.values()])
        counted = selected & finite
        sums: dict[str, torch.Tensor] = {"tokens": counted, "new_logp_sum": new}
        maxima: dict[str, torch.Tensor] = {}
        if entropy is not None:
            sums.update(entropy_tokens=counted, entropy_sum=entropy)
        if "rollout" in per_token:  # the log-probs as given: Δ is the engines' difference, not the temperature's
            mismatch_sums, maxima[MISMATCH_MAX] = mismatch_terms(logps, per_token["rollout"], counted,
                                                                 self.rollout_threshold)
            sums.update(mismatch_sums)
        old = log_ratio = ratio = kl = None
        if "old" in per_token:
            old = per_token["old"]
            log_ratio = torch.where(counted, new - old, 0.0)
            ratio = torch.exp(log_ratio)
            kl = ratio - log_ratio - 1.0
            sums.update(old_tokens=counted, old_logp_sum=old, logp_diff_sum=log_ratio, approx_kl_sum=kl)
            maxima.update(token_kl_max=kl, token_ratio_max=ratio)
        totals = sum_totals(self.state_specs, sums, counted, groups)
        totals["nonfinite_tokens"] = (selected & ~finite).sum(dtype=torch.float64)
        if isinstance(misaligned, torch.Tensor):  # a device count: added with the rest
            totals["misaligned_arrays"] = misaligned
        return TokenTerms(totals, max_totals(self.state_specs, maxima, counted, groups) if maxima else {},
                          misaligned, counted, labels, new, old, per_token.get("advantages"), log_ratio, ratio, kl)

    def _entropy(self, call: SharedCall, batch: MicrobatchView, labels: torch.Tensor, vocab_size: Optional[int],
                 layout: Optional[str]) -> Optional[torch.Tensor]:
        """Per-token entropy shaped like ``labels``: given, or from the (vocab-parallel) logits (the call's
        statistics of the microbatch, see :func:`.call_token_stats`)."""
        if "entropies" in batch.tensors:
            return to_device(batch.tensors["entropies"], labels.device)
        if batch.output.get("token_stats") is not None:
            return to_device(batch.output["token_stats"].entropy.reshape(labels.shape), labels.device)
        logits = self._logits_for_entropy(batch, layout)
        if logits is None:
            return None
        stats = call_token_stats(call, batch, logits, self.context, vocab_size, layout, self.ignore_index,
                                 self.token_statistics)
        return to_device(stats.entropy.reshape(labels.shape), labels.device)

    def clip_counts(self, terms: TokenTerms, batch: MicrobatchView) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(clipped low, clipped high, out of) per token (``[b, s]``), gated by the advantage sign.

        Subclasses may count per sequence instead (``[sequences]``): the caller sums either.
        """
        counted = terms.counted
        low = counted & (terms.ratio < 1 - self.epsilon) & (terms.advantages < 0)
        high = counted & (terms.ratio > 1 + self.epsilon_high) & (terms.advantages > 0)
        return low, high, counted

    def sync_records(self) -> Optional[list]:
        return self._high_kl.records(self.context.dp_rank) if self.top_k_kl > 0 else None

    # --------------------------------------------------------------- results

    def compute(self, states: SyncedStates) -> dict[str, Number]:
        results: dict[str, Any] = mismatch_results(states)
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
        results.update(states.counts(("nonfinite_tokens", "misaligned_arrays"), prefix="train/"))
        if self.top_k_kl > 0 and tokens > 0:
            records = global_top_kl(states.records, self.top_k_kl)
            if records:
                results["_high_kl_records"] = records
        return results

    def reset(self) -> None:
        super().reset()
        self._high_kl.reset()

    def extra_state(self, states: SyncedStates) -> dict[str, Any]:
        """The global top-K tokens so far (sequence indices in the global batch) and the sequences seen."""
        return saved_state(states.records, self.top_k_kl) if self.top_k_kl > 0 else {}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Continue under any layout: the saved top-K and sequence count become one earlier call of
        the primary rank (see :meth:`Metric.load_state_dict`), so new sequences are numbered after them."""
        super().load_state_dict(state_dict)
        self._high_kl.reset()
        if self.top_k_kl > 0 and "sequences" in state_dict:
            self._high_kl.load(state_dict, counts_loaded_sums_here(self), self._state_device())


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

    def clip_counts(self, terms: TokenTerms, batch: MicrobatchView) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        weights = terms.counted.to(torch.float64)
        partial = torch.stack([batch.sequence_sum(terms.log_ratio * weights), batch.sequence_sum(weights),
                               batch.sequence_sum(terms.advantages * weights)], -1)
        log_ratio_sum, tokens, advantage_sum = sum_over_context_parallel(partial, self.context,
                                                                         batch.cp_gathered).unbind(-1)
        ratio = torch.exp(log_ratio_sum / tokens.clamp(min=1.0))
        # Every CP rank holds the completed sequences: CP rank 0 counts them.
        counted = (tokens > 0) & counts_sequences_here(self.context, batch.cp_gathered)
        low = counted & (ratio < 1 - self.epsilon) & (advantage_sum < 0)
        high = counted & (ratio > 1 + self.epsilon_high) & (advantage_sum > 0)
        return low, high, counted


class CISPOMetric(GRPOMetric):
    r"""Twinkle's ``CISPOMetric``: :class:`GRPOMetric` with the clip rate not gated by the advantage.

        clip_ratio_low = Σ [r < 1 − ε] / N_clip,     clip_ratio_high = Σ [r > 1 + ε_high] / N_clip

    over the tokens that have old log-probs and advantages (as in Twinkle, the
    clip rate is only reported when advantages are passed).
    """

    def clip_counts(self, terms: TokenTerms, batch: MicrobatchView) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        low = terms.counted & (terms.ratio < 1 - self.epsilon)
        high = terms.counted & (terms.ratio > 1 + self.epsilon_high)
        return low, high, terms.counted


class PPOMetric(GRPOMetric):
    """Twinkle's ``PPOMetric``: the policy side of PPO, with :class:`GRPOMetric`'s token-level keys."""
