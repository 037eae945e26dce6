"""GRPO's variants: GSPO (sequence-level clip rate), CISPO (clip rate not gated by the advantage), PPO's policy side.

Each is :class:`~.grpo.GRPOMetric` with its own ``clip_counts``; every other key
(and the rollout mismatch, :mod:`.rollout_mismatch`) is GRPO's.
"""

from __future__ import annotations

import torch

from .grpo import GRPOMetric, TokenTerms
from .microbatch_view import MicrobatchView
from .sequence_totals import once_per_sequence, sum_over_context_parallel


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
        weights = terms.valid.to(torch.float64)
        partial = torch.stack([batch.sequence_sum(terms.log_ratio * weights), batch.sequence_sum(weights),
                               batch.sequence_sum(terms.advantages * weights)], -1)
        log_ratio_sum, tokens, advantage_sum = sum_over_context_parallel(partial, self.context,
                                                                         batch.cp_gathered).unbind(-1)
        ratio = torch.exp(log_ratio_sum / tokens.clamp(min=1.0))
        counted = tokens > 0
        low = counted & (ratio < 1 - self.epsilon) & (advantage_sum < 0)
        high = counted & (ratio > 1 + self.epsilon_high) & (advantage_sum > 0)
        once = once_per_sequence(self.context, batch.cp_gathered)  # CP ranks share each sequence
        return low * once, high * once, counted * once


class CISPOMetric(GRPOMetric):
    r"""Twinkle's ``CISPOMetric``: :class:`GRPOMetric` with the clip rate not gated by the advantage.

        clip_ratio_low = Σ [r < 1 − ε] / N_clip,     clip_ratio_high = Σ [r > 1 + ε_high] / N_clip

    over the tokens that have old log-probs and advantages (as in Twinkle, the
    clip rate is only reported when advantages are passed).
    """

    def clip_counts(self, terms: TokenTerms, batch: MicrobatchView) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        low = terms.valid & (terms.ratio < 1 - self.epsilon)
        high = terms.valid & (terms.ratio > 1 + self.epsilon_high)
        return low, high, terms.valid


class PPOMetric(GRPOMetric):
    """Twinkle's ``PPOMetric``: the policy side of PPO, with :class:`GRPOMetric`'s token-level keys."""
