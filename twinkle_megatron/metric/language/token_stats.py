"""TokenStatsMetric: mean label log-probability and mean entropy of the model's predictions."""

from __future__ import annotations

from typing import Any

import torch

from ..inputs.shared_call import SharedCall
from ..state.base import Number, SyncedStates
from ..tokens.logits_metric import LogitsMetric


class TokenStatsMetric(LogitsMetric):
    """Mean log-probability of the labels and mean predictive entropy, from vocab-parallel logits.

    Over the counted tokens t (see :class:`LogitsMetric`), sums over tokens,
    microbatches and DP×CP ranks:

        logprob = Σ_t log p(label_t) / Σ_t 1        (−logprob is the cross-entropy in nats)
        entropy = Σ_t −Σ_v p_v log p_v / Σ_t 1

    computed without gathering the vocabulary (two TP collectives per
    microbatch, shared with :class:`Accuracy` inside a ``MetricCollection``).

    Results: ``logprob``, ``entropy``, and ``nonfinite_tokens`` / ``invalid_labels``
    when non-zero.

    >>> import math, torch
    >>> from twinkle_megatron import TokenStatsMetric
    >>> metric = TokenStatsMetric()
    >>> metric.accumulate({"labels": torch.tensor([[1, 3]])}, {"logits": torch.zeros(1, 2, 4)})  # uniform over 4
    >>> result = metric.calculate()
    >>> round(result["logprob"], 6) == round(-math.log(4), 6) and round(result["entropy"], 6) == round(math.log(4), 6)
    True
    """

    def __init__(self, device_mesh: Any = None, process_group: Any = None, **kwargs: Any) -> None:
        super().__init__(device_mesh, process_group, **kwargs)
        self.add_state("logprob_sum", "sum", grouped=True)
        self.add_state("entropy_sum", "sum", grouped=True)
        self.add_state("tokens", "sum", grouped=True)

    def accumulate_call(self, call: SharedCall) -> None:
        for batch, classes, groups in self._token_batches(call):
            stats = batch.stats
            problems = {name: tokens.sum(dtype=torch.float64) for name, tokens in self.problem_counts(classes).items()}
            self._add_token_sums({"logprob_sum": stats.logprobs, "entropy_sum": stats.entropy,
                                  "tokens": classes.counted}, classes.counted, groups, problems)

    def compute(self, states: SyncedStates) -> dict[str, Number]:
        results = self._token_problems(states)
        tokens = states["tokens"]
        if tokens > 0:
            results.update(logprob=states["logprob_sum"] / tokens, entropy=states["entropy_sum"] / tokens)
        return results
