"""FLOPs against hand-computed Megatron-LM formula values, and the peak-TFLOP/s table.

The hand computations follow megatron/training/training.py:num_floating_point_operations
(Megatron-LM): FLOPs = batch · seq · (per-token terms), every GEMM counted
6 times per weight element and token (3 passes × 2 FLOPs per multiply-add).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from twinkle_megatron.tracker import flops_coefficients, num_floating_point_operations, peak_tflops


def dense_gqa_swiglu() -> TransformerConfig:
    return TransformerConfig(num_layers=4, hidden_size=512, num_attention_heads=8, num_query_groups=2,
                             ffn_hidden_size=1536, gated_linear_unit=True)


def test_dense_gqa_swiglu_matches_hand_computation():
    # h = 512, 8 heads of kv_channels 64 (512 / 8), 2 query groups, ffn 1536, SwiGLU, L = 4.
    # Attention, per layer and token:
    #   Q = 64·8 = 512, K = V = 64·2 = 128
    #   QKV projection  h·(Q + K + V) = 512·768              = 393,216
    #   output proj.    Q·h           = 512·512              = 262,144
    #   QKᵀ and (QKᵀ)V  Q·S/2·2 (causal) = 512·1024          = 524,288
    #   × 6                                                   = 7,077,888
    # MLP (SwiGLU: 3 GEMMs of h·ffn), per layer and token: 6·512·1536·3 = 14,155,776
    # Output layer, per token: 6·512·32000                   = 98,304,000
    # Per token: 4·(7,077,888 + 14,155,776) + 98,304,000     = 183,238,656
    # Batch 2 × 1024 tokens: 2048 · 183,238,656              = 375,272,767,488
    assert num_floating_point_operations(dense_gqa_swiglu(), 2, 1024, 32000) == 375_272_767_488


def test_megatron_lm_args_give_the_same_flops():
    args = SimpleNamespace(num_layers=4, hidden_size=512, num_attention_heads=8, group_query_attention=True,
                           num_query_groups=2, kv_channels=64, ffn_hidden_size=1536, swiglu=True,
                           num_experts=None, mtp_num_layers=None)
    assert num_floating_point_operations(args, 2, 1024, 32000) == 375_272_767_488
    # group_query_attention=False means MHA whatever num_query_groups says: K = V = 512.
    mha = SimpleNamespace(**{**vars(args), "group_query_attention": False})
    extra_kv_per_token = 4 * 6 * 512 * (2 * 512 - 2 * 128)  # 4 layers, 6·h·ΔK+ΔV
    assert num_floating_point_operations(mha, 2, 1024, 32000) == 375_272_767_488 + 2048 * extra_kv_per_token


def test_moe_with_shared_experts_and_mtp_matches_hand_computation():
    config = TransformerConfig(num_layers=4, hidden_size=256, num_attention_heads=4, num_query_groups=2,
                               ffn_hidden_size=1024, gated_linear_unit=True, num_moe_experts=8, moe_router_topk=2,
                               moe_ffn_hidden_size=128, moe_shared_expert_intermediate_size=256,
                               moe_layer_freq=[0, 1, 1, 1], mtp_num_layers=1,
                               add_bias_linear=False)  # megatron-core < 0.15 refuses biases in MoE layers
    # Layers: pattern [0, 1, 1, 1] has 3 MoE layers; the last layer is MoE, so the
    # MTP layer is too: 4 MoE, 1 dense, 5 attention layers.
    # Attention (kv_channels 64: Q = 256, K = V = 128), per layer and token:
    #   6·(256·512 + 256·256 + 256·512) = 6·327,680          = 1,966,080;  × 5 = 9,830,400
    # MLP, per token: 6·h·(ffn·3·dense + (moe_ffn·top-k·3 + shared·3)·MoE layers)
    #   = 6·256·(1024·3·1 + (128·2·3 + 256·3)·4) = 6·256·9216 = 14,155,776
    # MTP norms and projection: 6·1·(3·256 + 2·256²)         = 791,040
    # Output layers (main + 1 MTP): 6·256·1000·2             = 3,072,000
    # Per token: 14,155,776 + 9,830,400 + 791,040 + 3,072,000 = 27,849,216
    # Batch 3 × 512 tokens: 1536 · 27,849,216                 = 42,776,395,776
    assert num_floating_point_operations(config, 3, 512, 1000) == 42_776_395_776


def test_moe_counts_routed_experts_not_the_dense_ffn():
    # KempnerForge's bug: fine-grained experts counted at the dense FFN size.
    common = dict(num_layers=2, hidden_size=256, num_attention_heads=4, ffn_hidden_size=4096, num_moe_experts=64,
                  moe_router_topk=4, add_bias_linear=False)  # megatron-core < 0.15 refuses biases in MoE layers
    fine = TransformerConfig(**common, moe_ffn_hidden_size=128)
    coarse = TransformerConfig(**common, moe_ffn_hidden_size=4096)
    per_token_difference = 6 * 256 * (4096 - 128) * 4 * 2 * 2  # 6·h·Δffn·top-k·2 GEMMs·2 layers
    assert (flops_coefficients(coarse, 1000).per_token - flops_coefficients(fine, 1000).per_token
            == per_token_difference)


def test_multi_latent_attention_matches_hand_computation():
    config = MLATransformerConfig(num_layers=2, hidden_size=256, num_attention_heads=4, q_lora_rank=64,
                                  kv_lora_rank=32, qk_head_dim=32, qk_pos_emb_head_dim=16, v_head_dim=32,
                                  ffn_hidden_size=512)
    # Per layer and token (S = 128):
    #   query  q_lora·(h + heads·(qk + rope) + 1) = 64·449     = 28,736
    #   kv     kv_lora·(h + heads·(qk + v) + 1) + h·rope       = 16,416 + 4,096
    #   output heads·v·h = 4·32·256                            = 32,768
    #   core   S·heads·(qk + rope)/2 + S·heads·v/2             = 12,288 + 8,192
    #   × 6 = 614,976; × 2 layers                              = 1,229,952
    # MLP (not gated): 6·256·512·2 · 2 layers                  = 3,145,728
    # Output layer: 6·256·1000                                 = 1,536,000
    # 128 tokens · 5,911,680                                   = 756,695,040
    assert num_floating_point_operations(config, 1, 128, 1000) == 756_695_040


def test_packed_sequences_use_the_sum_of_squared_lengths():
    config = dense_gqa_swiglu()
    lengths = [100, 300, 624]
    # Token-linear part per token: everything of the dense case except core attention:
    #   4·6·(393,216 + 262,144) + 4·14,155,776 + 98,304,000 = 170,655,744
    # Core attention per squared length: 4 layers · 6 · Q = 4·6·512 = 12,288
    expected = 170_655_744 * sum(lengths) + 12_288 * sum(s * s for s in lengths)
    assert num_floating_point_operations(config, 1, 1024, 32000, seq_lengths=lengths) == expected
    assert expected < num_floating_point_operations(config, 1, 1024, 32000)
    # Full-length sequences give Megatron's number.
    assert (num_floating_point_operations(config, 2, 1024, 32000, seq_lengths=[1024, 1024])
            == num_floating_point_operations(config, 2, 1024, 32000))
    with pytest.raises(ValueError, match="more than batch_size"):
        num_floating_point_operations(config, 1, 1024, 32000, seq_lengths=[1000, 100])


def test_unsupported_architectures_are_refused_not_guessed():
    hybrid = SimpleNamespace(**{**vars(dense_gqa_swiglu()), "is_hybrid_model": True})
    with pytest.raises(NotImplementedError, match="hybrid"):
        num_floating_point_operations(hybrid, 1, 128, 1000)


@pytest.mark.parametrize("name, precision, expected", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.5),
    ("NVIDIA H100 PCIe", "bf16", 756.5),
    ("NVIDIA H100 80GB HBM3", "fp8", 1979.0),
    ("NVIDIA H100 PCIe", "fp8", 1513.0),
    ("NVIDIA H100 NVL", "bf16", 835.5),
    ("NVIDIA H200", "bf16", 989.5),
    ("NVIDIA H20", "bf16", 148.0),
    ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
    ("NVIDIA A100-SXM4-80GB", "fp16", 312.0),
    ("NVIDIA B200", "bf16", 2250.0),
    ("AMD Instinct MI300X", "fp8", 2614.9),
    (" NVIDIA L40S ", "bf16", 362.05),
])
def test_peak_by_exact_device_name(name, precision, expected):
    assert peak_tflops(name, precision) == expected


@pytest.mark.parametrize("name, precision", [
    (None, "bf16"),  # no GPU
    ("NVIDIA GeForce RTX 4090", "bf16"),  # not in the table
    ("H100", "bf16"),  # a substring is not a device name
    ("NVIDIA H100 80GB HBM3 (MIG 1g.10gb)", "bf16"),
    ("NVIDIA A100-SXM4-80GB", "fp8"),  # Ampere has no FP8
])
def test_unknown_devices_have_no_peak(name, precision):
    assert peak_tflops(name, precision) is None


def test_unknown_precision_is_an_error():
    with pytest.raises(ValueError, match="precision"):
        peak_tflops("NVIDIA H100 PCIe", "int8")
