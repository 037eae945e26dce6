r"""The train–inference mismatch of RL: the trainer's log-probs against the inference engine's.

An RL rollout samples with an inference engine (vLLM, SGLang) whose
log-probabilities of the sampled tokens differ from the trainer's recomputation
(kernels, precision, batch invariance, MoE routing). With ``rollout_logps=``
(the engine's log-probs, in every form ``old_logps`` is accepted, see
:mod:`.grpo`) GRPO, GSPO, CISPO and PPO also report, over the counted tokens
``t`` (those of the other keys: selected, every input finite, not of a sequence
whose ragged array is misaligned: see :mod:`..inputs.sequences`) with
``Δ_t = logπ_train(t) − logπ_rollout(t)`` (the log-probs as given, before any
temperature scaling), sums over tokens, microbatches and DP×CP ranks, ``N``
tokens, maxima over all of them:

================================== ===================================================================
``train/token_mult_prob_error``    Σ exp(|Δ|) / N            (NeMo-RL's ``token_mult_prob_error``; ≥ 1)
``train/rollout_kl``               Σ (e^Δ − Δ − 1) / N       (Schulman's k3 estimate of KL(rollout ‖ train),
                                                              the tokens being samples of the rollout)
``train/rollout_logp_diff_max``    max |Δ|
``train/rollout_mismatch_ratio``   Σ [|Δ| > threshold] / N   (``rollout_threshold``, default 0.5 nats)
================================== ===================================================================

A rollout identical to the trainer gives exactly 1.0, 0.0, 0.0 and 0.0. The
states are sums and a maximum, per group and position bucket too, in the
collection's one sync; nothing here synchronises with the host.
"""

from __future__ import annotations

import torch

from ..state.base import Metric, Number, SyncedStates

MISMATCH_SUMS = ("rollout_tokens", "rollout_mult_error_sum", "rollout_kl_sum", "rollout_over_threshold")
MISMATCH_MAX = "rollout_abs_diff_max"
MISMATCH_KEYS = ("train/token_mult_prob_error", "train/rollout_kl", "train/rollout_logp_diff_max",
                 "train/rollout_mismatch_ratio")


def check_threshold(threshold: float) -> float:
    """``rollout_threshold`` as a float > 0."""
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not threshold > 0:
        raise ValueError(f"rollout_threshold must be a number > 0 (nats of |Δ log-prob|), got {threshold!r}")
    return float(threshold)


def declare_mismatch_states(metric: Metric) -> None:
    """The mismatch's states: four sums and a maximum (per group and position bucket too)."""
    for name in MISMATCH_SUMS:
        metric.add_state(name, "sum", grouped=True)
    metric.add_state(MISMATCH_MAX, "max", grouped=True)


def mismatch_terms(train: torch.Tensor, rollout: torch.Tensor, counted: torch.Tensor, threshold: float
                   ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One microbatch's per-token terms: ({sum state: values, 0 where not counted}, |Δ| with -inf where not
    counted, for the maximum); ``counted``: the counted tokens."""
    zero = torch.zeros((), dtype=torch.float64, device=train.device)
    delta = torch.where(counted, train.to(torch.float64) - rollout.to(torch.float64), zero)
    magnitude = delta.abs()
    sums = {
        "rollout_tokens": counted.to(torch.float64),
        "rollout_mult_error_sum": torch.where(counted, torch.exp(magnitude), zero),
        "rollout_kl_sum": torch.where(counted, torch.expm1(delta) - delta, zero),  # >= 0, exactly 0 at Δ = 0
        "rollout_over_threshold": (counted & (magnitude > threshold)).to(torch.float64),
    }
    return sums, torch.where(counted, magnitude, float("-inf"))


def mismatch_results(states: SyncedStates) -> dict[str, Number]:
    """The four keys when any token had a rollout log-prob; else nothing."""
    tokens = states["rollout_tokens"]
    if not tokens > 0:
        return {}
    return dict(zip(MISMATCH_KEYS, (states["rollout_mult_error_sum"] / tokens, states["rollout_kl_sum"] / tokens,
                                    states[MISMATCH_MAX], states["rollout_over_threshold"] / tokens)))
