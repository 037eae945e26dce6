"""A small MoE routing metric and hand-made routing maps, for the tests of its formulas and outputs."""

from __future__ import annotations

from typing import Any, Iterable

import torch

from twinkle_megatron.metric.language.moe_routing import MoERoutingMetric

NUM_EXPERTS = 4


def small_moe_metric(**kwargs: Any) -> MoERoutingMetric:
    """3 layers of 4 experts, top-2."""
    return MoERoutingMetric(num_layers=3, num_experts=NUM_EXPERTS, topk=2, **kwargs)


def routing_map(pairs: Iterable[Iterable[int]]) -> torch.Tensor:
    """``[tokens, experts]`` booleans: token ``t`` routed to the experts ``pairs[t]``."""
    pairs = list(pairs)
    result = torch.zeros(len(pairs), NUM_EXPERTS, dtype=torch.bool)
    for token, experts in enumerate(pairs):
        result[token, list(experts)] = True
    return result
