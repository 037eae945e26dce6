"""Training FLOPs of a GPT model, exactly as Megatron-LM counts them.

Megatron-LM (``megatron/training/training.py:num_floating_point_operations``)
counts the matrix multiplications of one forward and backward pass:

* every GEMM runs 3 times (forward, weight gradient, input gradient) and a
  GEMM of ``[m, n] @ [n, k]`` costs ``2·m·n·k``: a factor ``6`` per weight
  element and token;
* attention (MHA, GQA or MLA) per layer and token: the Q/K/V (and optional
  output gate) projections, the output projection, and the two ``s × s``
  products ``QKᵀ`` and ``(QKᵀ)V`` halved for the causal mask;
* MLP per layer and token: ``h × ffn`` weights, three GEMMs when the MLP is
  gated (SwiGLU: ``h → 2·ffn`` stacked and ``ffn → h``), else two; MoE layers
  count ``moe_ffn_hidden_size × top-k`` routed experts plus the shared experts;
* multi-token prediction (MTP) layers are transformer layers too (MoE or dense
  like the last layer), plus their norms and ``2h → h`` projection, plus one
  more output-layer (logit) GEMM each;
* the output layer: ``h × padded_vocab_size``.

Everything is linear in the number of tokens except causal attention, which
is linear in the squared sequence length. So the FLOPs of any batch are

    FLOPs = per_token · Σ sᵢ + per_squared_length · Σ sᵢ²

over its sequences of lengths ``sᵢ`` (``batch_size`` sequences of
``seq_length`` in Megatron's formula; the real lengths for packed sequences).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

# Each GEMM runs three times (forward, backward for weights, backward for inputs)...
FORWARD_BACKWARD = 3
# ...and costs two FLOPs (a multiply and an add) per multiply-accumulate.
FMA = 2
GEMM_FACTOR = FORWARD_BACKWARD * FMA


@dataclass(frozen=True)
class FlopsCoefficients:
    """``FLOPs = per_token · tokens + per_squared_length · Σ (sequence length)²``."""

    per_token: float
    per_squared_length: float

    def flops(self, tokens: float, squared_lengths: float) -> float:
        return self.per_token * tokens + self.per_squared_length * squared_lengths


def num_floating_point_operations(config: Any, batch_size: int, seq_length: int, padded_vocab_size: int,
                                  seq_lengths: Optional[Sequence[int]] = None) -> float:
    """FLOPs of one forward + backward pass over ``batch_size`` sequences, Megatron-LM's formula.

    Args:
        config: a megatron-core ``TransformerConfig`` (or ``MLATransformerConfig``),
            or any object with its field names; Megatron-LM's ``args`` work too
            (``num_experts``, ``swiglu``, ``group_query_attention``).
        batch_size: sequences in the batch (Megatron passes the global batch size).
        seq_length: tokens per sequence.
        padded_vocab_size: the vocabulary size of the output layer, with padding.
        seq_lengths: for packed variable-length sequences, the real length of every
            sequence in the batch (they must fit in ``batch_size · seq_length``
            tokens). Then the token-linear terms use ``Σ sᵢ`` tokens and causal
            attention ``Σ sᵢ²`` instead of ``batch_size · seq_length²``: a packed
            sequence attends only within itself.
    """
    coefficients = flops_coefficients(config, padded_vocab_size)
    if seq_lengths is None:
        return coefficients.flops(batch_size * seq_length, batch_size * seq_length ** 2)
    lengths = [int(length) for length in seq_lengths]
    if sum(lengths) > batch_size * seq_length:
        raise ValueError(f"seq_lengths hold {sum(lengths)} tokens, more than batch_size × seq_length = "
                         f"{batch_size} × {seq_length}")
    return coefficients.flops(sum(lengths), sum(length ** 2 for length in lengths))


def flops_coefficients(config: Any, padded_vocab_size: int) -> FlopsCoefficients:
    """The per-token and per-squared-length FLOPs of ``config`` (see the module docstring)."""
    if getattr(config, "is_hybrid_model", False) or getattr(config, "hybrid_layer_pattern", None):
        raise NotImplementedError("FLOPs of hybrid (Mamba) models are not implemented; pass flops_per_step")
    if getattr(config, "experimental_attention_variant", None) is not None:
        raise NotImplementedError(f"FLOPs of attention variant {config.experimental_attention_variant!r} are not "
                                  "implemented; pass flops_per_step")
    layers = _LayerCounts.of(config)
    hidden = config.hidden_size
    attention_per_token, attention_per_squared_length = _attention_flops(config)
    mlp = _mlp_flops_per_token(config, layers)
    # MTP: the norms of the embedding and hidden state and the final norm (3h),
    # and the projection of their concatenation back to h (2h·h).
    mtp = GEMM_FACTOR * layers.mtp * (3 * hidden + 2 * hidden * hidden)
    # One output layer for the model and one for every MTP depth.
    logits = GEMM_FACTOR * hidden * padded_vocab_size * (layers.mtp + 1)
    return FlopsCoefficients(
        per_token=mlp + attention_per_token * layers.attention + mtp + logits,
        per_squared_length=attention_per_squared_length * layers.attention,
    )


@dataclass(frozen=True)
class _LayerCounts:
    """How many layers of each kind run, MTP layers included (they repeat the last layer's kind)."""

    dense: int
    moe: int
    attention: int
    mtp: int

    @classmethod
    def of(cls, config: Any) -> _LayerCounts:
        num_layers = config.num_layers
        mtp = getattr(config, "mtp_num_layers", None) or 0
        if _num_experts(config) is None:
            return cls(dense=num_layers + mtp, moe=0, attention=num_layers + mtp, mtp=mtp)
        pattern = _moe_layer_pattern(config.moe_layer_freq, num_layers)
        moe = sum(pattern) + pattern[-1] * mtp
        return cls(dense=num_layers + mtp - moe, moe=moe, attention=num_layers + mtp, mtp=mtp)


def _num_experts(config: Any) -> Optional[int]:
    # TransformerConfig calls it num_moe_experts, Megatron-LM's args num_experts.
    experts = getattr(config, "num_moe_experts", None)
    return experts if experts is not None else getattr(config, "num_experts", None)


def _moe_layer_pattern(moe_layer_freq: Any, num_layers: int) -> list[int]:
    """1 for an MoE layer, 0 for a dense one: every ``freq``-th layer from layer 0, or an explicit list."""
    if isinstance(moe_layer_freq, int):
        return [1 if index % moe_layer_freq == 0 else 0 for index in range(num_layers)]
    pattern = [int(flag) for flag in moe_layer_freq]
    if len(pattern) != num_layers:
        raise ValueError(f"moe_layer_freq has {len(pattern)} entries for {num_layers} layers")
    return pattern


def _gemms_per_mlp(config: Any) -> int:
    """3 for a gated MLP (SwiGLU and other GLUs: h → 2·ffn stacked, ffn → h), else 2."""
    swiglu = getattr(config, "swiglu", None)  # Megatron-LM's args
    gated = swiglu if swiglu is not None else getattr(config, "gated_linear_unit", False)
    return 3 if gated else 2


def _mlp_flops_per_token(config: Any, layers: _LayerCounts) -> float:
    hidden, gemms = config.hidden_size, _gemms_per_mlp(config)
    dense = config.ffn_hidden_size * gemms * layers.dense
    if layers.moe == 0:
        return GEMM_FACTOR * hidden * dense
    moe_ffn = config.moe_ffn_hidden_size if config.moe_ffn_hidden_size is not None else config.ffn_hidden_size
    top_k = config.moe_router_topk
    latent = getattr(config, "moe_latent_size", None)
    if latent is None:
        routed = moe_ffn * top_k * gemms
    else:  # routed experts run at the latent size, plus the projections h → latent → h
        routed = moe_ffn * top_k * gemms * latent / hidden + 2 * latent
    shared = (getattr(config, "moe_shared_expert_intermediate_size", None) or 0) * gemms
    return GEMM_FACTOR * hidden * (dense + (routed + shared) * layers.moe)


def _attention_flops(config: Any) -> tuple[float, float]:
    """(per token, per squared sequence length) FLOPs of one attention layer."""
    if getattr(config, "multi_latent_attention", False):
        return _mla_flops(config)
    hidden, heads = config.hidden_size, config.num_attention_heads
    head_dim = config.kv_channels if config.kv_channels is not None else hidden // heads
    groups = config.num_query_groups if config.num_query_groups is not None else heads
    if getattr(config, "group_query_attention", True) is False:  # Megatron-LM's args: plain MHA
        groups = heads
    query = head_dim * heads
    key = value = head_dim * groups
    gate = query if getattr(config, "attention_output_gate", False) else 0
    projections = hidden * (query + key + value + gate) + query * hidden
    # QKᵀ and (QKᵀ)V each cost query·s per token; the causal mask halves both.
    core = query / 2 * 2
    return GEMM_FACTOR * projections, GEMM_FACTOR * core


def _mla_flops(config: Any) -> tuple[float, float]:
    """Multi-latent attention (DeepSeek-V2/V3), as Megatron-LM counts it."""
    hidden, heads = config.hidden_size, config.num_attention_heads
    qk_dim, rope_dim, v_dim = config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim
    if config.q_lora_rank is None:
        query = hidden * heads * (qk_dim + rope_dim)
    else:  # down-projection, norm, up-projection
        query = config.q_lora_rank * (hidden + heads * (qk_dim + rope_dim) + 1)
    key_value = config.kv_lora_rank * (hidden + heads * (qk_dim + v_dim) + 1) + hidden * rope_dim
    output = heads * v_dim * hidden
    core = heads * (qk_dim + rope_dim) / 2 + heads * v_dim / 2  # causal: half of QKᵀ and of (QKᵀ)V
    return GEMM_FACTOR * (query + key_value + output), GEMM_FACTOR * core
