r"""PPOValueMetric: PPO critic statistics, correct under tensor, pipeline, context and data parallelism.

Twinkle's ``PPOValueMetric`` keeps every token's value on the host and gathers
the lists; here each statistic is a sum in the collection's one sync, so the
variances and the explained variance cover all tokens of all ranks exactly.
(Twinkle's policy-side ``PPOMetric`` is :class:`~.grpo.GRPOMetric` under
another name, as in Twinkle.)
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..inputs.microbatches import call_value, given
from ..inputs.shared_call import SharedCall
from ..inputs.tensors import all_finite
from ..inputs.view import MicrobatchView, ViewSpec
from ..state.base import Metric, Number, SyncedStates

_SUMS = ("tokens", "value_sum", "return_sum", "return_square_sum", "residual_sum", "residual_square_sum",
         "clipped", "advantage_tokens", "advantage_sum", "advantage_square_sum", "nonfinite_tokens",
         "misaligned_arrays")


class PPOValueMetric(Metric):
    r"""Twinkle's ``PPOValueMetric``: value-head diagnostics over the counted response tokens.

    Over counted tokens ``t`` (``labels != ignore_index`` and
    ``completion_mask``, all inputs finite), ``v`` the critic's values
    (``outputs['values']``), ``v_old`` the rollout's (``old_values``), ``R`` the
    returns and ``A`` the advantages; sums over tokens, microbatches and DP×CP
    ranks, ``N`` tokens:

    ============================ =============================================================
    ``train/value_mean``         Σ v / N
    ``train/return_mean``        Σ R / N
    ``train/value_clip_ratio``   Σ [|v − v_old| > ε] / N
    ``train/explained_variance`` 1 − Var(R − v) / max(Var(R), 1e-8)   (population variances)
    ``train/advantage_mean``     Σ A / N_A                             (with ``advantages``)
    ``train/advantage_std``      sqrt(Σ A² / N_A − mean²)               (population, as Twinkle)
    ============================ =============================================================

    with ``Var(x) = Σ x² / N − (Σ x / N)²`` in float64. Tokens with a non-finite
    input are left out and counted in ``train/nonfinite_tokens``; per-sequence
    arrays that do not hold one value per selected token in
    ``train/misaligned_arrays``, their sequences left out of every key (both
    when > 0).

    ``accumulate(inputs, outputs, *, old_values, returns, advantages=None)``:
    ``outputs['values']`` shaped like ``labels`` (one tensor or a list per
    microbatch); ``old_values``, ``returns`` and ``advantages`` in the forms
    :class:`~.grpo.GRPOMetric` accepts for ``old_logps`` (Twinkle's ragged
    per-sequence lists included). Without ``old_values`` or ``returns`` the call
    adds nothing (as in Twinkle).

    >>> import torch
    >>> from twinkle_megatron import PPOValueMetric
    >>> metric = PPOValueMetric(epsilon=0.2)
    >>> metric.accumulate({"labels": torch.tensor([[1, 2]])}, {"values": torch.tensor([[0.5, 1.5]])},
    ...                   old_values=[[0.5, 1.0]], returns=[[1.0, 1.0]])
    >>> result = metric.calculate()
    >>> result["train/value_mean"], result["train/value_clip_ratio"]
    (1.0, 0.5)
    """

    call_keywords = ("old_values", "returns", "advantages")
    output_keys = ("values",)

    def __init__(self, device_mesh: Any = None, process_group: Any = None, epsilon: float = 0.2,
                 ignore_index: int = -100, **kwargs: Any) -> None:
        super().__init__(device_mesh, process_group, **kwargs)
        self.epsilon = float(epsilon)
        self.ignore_index = ignore_index
        for name in _SUMS:
            self.add_state(name, "sum")

    def accumulate_call(self, call: SharedCall) -> None:
        outputs, kwargs = call.outputs, call.kwargs
        per_sequence = {name: call_value(name, kwargs, outputs) for name in ("old_values", "returns", "advantages")}
        if outputs is None or not given(outputs.get("values")) or per_sequence["old_values"] is None \
                or per_sequence["returns"] is None:
            return
        spec = ViewSpec("PPOValueMetric", "values", per_sequence=tuple(name for name, value in per_sequence.items()
                                                                       if value is not None),
                        ignore_index=self.ignore_index, cp_gathered=self.cp_gathered)
        for view in call.views(spec, self.context):
            if view.counts_here:
                self._accumulate_microbatch(view)

    def _accumulate_microbatch(self, batch: MicrobatchView) -> None:
        values = batch.tensors["values"].to(torch.float64)
        selected = batch.selected
        misaligned = batch.misaligned_arrays
        per_token = batch.values
        finite = all_finite([values, *per_token.values()])
        counted = selected & finite
        returns, residual = per_token["returns"], per_token["returns"] - values
        # Every per-token statistic masked by ``counted`` and added in one op (see Metric._add_token_sums).
        sums = {"tokens": counted, "value_sum": values, "return_sum": returns, "return_square_sum": returns * returns,
                "residual_sum": residual, "residual_square_sum": residual * residual,
                "clipped": (values - per_token["old_values"]).abs() > self.epsilon}
        if "advantages" in per_token:
            advantages = per_token["advantages"]
            sums.update(advantage_tokens=counted, advantage_sum=advantages,
                        advantage_square_sum=advantages * advantages)
        self._add_token_sums(sums, counted, None, {"nonfinite_tokens": (selected & ~finite).sum(dtype=torch.float64),
                                                   "misaligned_arrays": misaligned})

    def compute(self, states: SyncedStates) -> dict[str, Number]:
        results: dict[str, Number] = states.counts(("nonfinite_tokens", "misaligned_arrays"), prefix="train/")
        tokens = states["tokens"]
        if tokens == 0:
            return results
        return_mean = states["return_sum"] / tokens
        return_variance = states["return_square_sum"] / tokens - return_mean ** 2
        residual_mean = states["residual_sum"] / tokens
        residual_variance = states["residual_square_sum"] / tokens - residual_mean ** 2
        results.update({
            "train/value_mean": states["value_sum"] / tokens,
            "train/return_mean": return_mean,
            "train/value_clip_ratio": states["clipped"] / tokens,
            "train/explained_variance": 1.0 - max(residual_variance, 0.0) / max(return_variance, 1e-8),
        })
        advantage_tokens = states["advantage_tokens"]
        if advantage_tokens > 0:
            mean = states["advantage_sum"] / advantage_tokens
            results["train/advantage_mean"] = mean
            results["train/advantage_std"] = math.sqrt(max(states["advantage_square_sum"] / advantage_tokens
                                                           - mean ** 2, 0.0))
        return results
