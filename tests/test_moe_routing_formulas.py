"""MoE routing health, the metric alone: its formulas on hand-made intervals, padding, non-finite logits,
ties, the router losses' weights, bad input, resume and the no-host-sync recording path.

The same metric inside a real megatron-core model under every layout: tests/test_moe_routing.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from kit.moe_cases import routing_map, small_moe_metric

from twinkle_megatron import keys
from twinkle_megatron.metric.language.moe_routing import MoERoutingMetric
from twinkle_megatron.testing.guards import forbid_host_sync


def test_formulas_on_a_hand_made_interval():
    metric = small_moe_metric(per_layer=True)
    # Layer 1 (row 0): 4 tokens, loads [3, 2, 2, 1]; layer 3 (row 2): loads [4, 4, 0, 0]; layer 2 unseen.
    metric.record_routing(1, routing_map([(0, 1), (0, 2), (0, 3), (1, 2)]))
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0]] * 2 + [[10.0, 10.0, -30.0, -30.0]] * 2)
    metric.record_routing(3, routing_map([(0, 1)] * 4), logits=logits)
    result = metric.calculate()
    assert result[keys.MOE_LAYERS] == 2 and result[keys.MOE_TOKENS] == 4.0
    b = 4 * 2 / 4
    assert result["moe/layer_0/utilization_min"] == 1 / b and result["moe/layer_0/utilization_max"] == 3 / b
    loads = torch.tensor([3.0, 2.0, 2.0, 1.0])
    assert result["moe/layer_0/utilization_cv"] == pytest.approx(float(loads.std(unbiased=False) / loads.mean()))
    assert result["moe/layer_0/dead_expert_fraction"] == 0 and result["moe/layer_2/dead_expert_fraction"] == 0.5
    assert "moe/layer_1/utilization_min" not in result, "a layer without tokens reports nothing"
    assert "moe/layer_0/routing_entropy_norm" not in result, "no logits, no entropy"
    # Two uniform tokens (H = log 4) and two split evenly over two experts (H = log 2).
    assert result["moe/layer_2/routing_entropy_norm"] == pytest.approx(math.exp((math.log(4) + math.log(2)) / 2) / 4)
    assert result[keys.MOE_ROUTING_ENTROPY_NORM] == result["moe/layer_2/routing_entropy_norm"]
    assert result[keys.MOE_IMBALANCE_MAX] == 2.0 and result[keys.MOE_IMBALANCE_WORST_LAYER] == 2
    assert result[keys.MOE_IMBALANCE_MEAN] == pytest.approx((1.5 + 2.0) / 2)
    assert result[keys.MOE_IMBALANCE_P50] == pytest.approx(1.75) and result[keys.MOE_IMBALANCE_P90] == \
        pytest.approx(1.95)
    assert result[keys.MOE_DEAD_EXPERT_FRACTION] == 0.25 and result[keys.MOE_UTILIZATION_MIN] == 0.0
    assert result["moe/layer_2/expert_0_utilization"] == 2.0
    assert all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in result.values())
    assert metric.calculate() == {}, "calculate() resets"


def test_padding_and_nonfinite_logits_are_left_out_and_counted():
    metric = small_moe_metric()
    padding = torch.tensor([False, True, False, True])
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [5.0, 1.0, 0.0, 0.0], [float("nan"), 0.0, 0.0, 0.0],
                           [float("inf"), 0.0, 0.0, 0.0]])
    metric.record_routing(2, routing_map([(0, 1), (2, 3), (0, 2), (2, 3)]), logits=logits, padding_mask=padding)
    result = metric.calculate()
    assert result[keys.MOE_TOKENS] == 2.0, "padding tokens are not counted"
    assert result[keys.MOE_UTILIZATION_MIN] == 0.0  # loads [2, 1, 1, 0]: expert 3 only had padding
    assert result[keys.MOE_IMBALANCE_MAX] == 2.0
    assert result[keys.MOE_NONFINITE_ROUTER_TOKENS] == 1, "the NaN token counts, the padded inf one does not"
    assert result[keys.MOE_ROUTING_ENTROPY_NORM] == pytest.approx(1.0), "only the uniform token is averaged"


def test_ties_percentiles_and_worst_layer():
    metric = small_moe_metric()
    for layer in (1, 2, 3):
        metric.record_routing(layer, routing_map([(0, 1), (0, 1)]))  # every layer: loads [2, 2, 0, 0]
    result = metric.calculate()
    assert result[keys.MOE_IMBALANCE_WORST_LAYER] == 0, "ties go to the lowest layer"
    assert result[keys.MOE_IMBALANCE_P50] == result[keys.MOE_IMBALANCE_P90] == 2.0


def test_router_losses_are_weighted_by_their_reduce_group():
    metric = small_moe_metric()
    metric.record_routing(1, routing_map([(0, 1)]))
    # Two ranks of one TP×CP group each hold half of a microbatch's loss 1.2; another microbatch: 0.8.
    metric.record_router_loss("load_balancing_loss", 1, torch.tensor(0.5, dtype=torch.float64), 0.5)
    metric.record_router_loss("load_balancing_loss", 1, 0.7, 0.5)
    metric.record_router_loss("load_balancing_loss", 1, 0.8, 1.0)
    result = metric.calculate()
    assert result["moe/load_balancing_loss"] == pytest.approx(1.0)
    assert "moe/z_loss" not in result, "a loss Megatron did not compute is not reported"
    with pytest.raises(ValueError, match="unknown router loss"):
        metric.record_router_loss("aux", 1, 0.1, 1.0)


def test_bad_input_raises_with_both_shapes():
    metric = small_moe_metric()
    with pytest.raises(ValueError, match=r"routing_map has shape \(3, 5\), expected \[tokens, 4\]"):
        metric.record_routing(1, torch.zeros(3, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="padding_mask has shape"):
        metric.record_routing(1, torch.zeros(3, 4, dtype=torch.bool), padding_mask=torch.zeros(4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"layer number 4 outside 1\.\.3"):
        metric.record_routing(4, torch.zeros(3, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="topk"):
        MoERoutingMetric(num_layers=2, num_experts=4, topk=5)


def test_resume_continues_the_interval():
    metric = small_moe_metric()
    metric.record_routing(1, routing_map([(0, 1), (0, 2)]))
    saved = metric.state_dict()
    resumed = small_moe_metric()
    resumed.load_state_dict(saved)
    resumed.record_routing(1, routing_map([(2, 3), (1, 3)]))
    assert torch.equal(saved["states"]["load"][0], torch.tensor([2.0, 1.0, 1.0, 0.0], dtype=torch.float64)), \
        "the checkpoint is not changed by the resumed run"
    assert resumed.calculate()[keys.MOE_IMBALANCE_MAX] == 1.0  # loads [2, 2, 2, 2]


def _guarded_record(metric: MoERoutingMetric) -> None:
    with forbid_host_sync():
        metric.record_routing(2, routing_map([(0, 1), (1, 2)]), logits=torch.randn(2, 4),
                              padding_mask=torch.tensor([False, True]))
        metric.record_router_loss("z_loss", 2, torch.tensor(3.0), 1.0)


def test_recording_makes_no_host_sync():
    metric = small_moe_metric()
    _guarded_record(metric)
    assert metric.calculate()[keys.MOE_TOKENS] == 1.0
