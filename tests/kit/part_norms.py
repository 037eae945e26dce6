"""The float64 reference of the per-layer norms: each step-health part's gradient and parameter norm.

Read from the single-process model's reduced gradients (``main_grad`` after Megatron's ``finalize_model_grads``)
and its weights, by the parameter names of the single-process model (``kit.megatron_gpt.canonical_names``):
``decoder.layers.<i>.*`` is ``layer_<i>`` (``keys.layer_part``), then ``embedding``, ``output_layer``,
``final_norm`` (``decoder.final_layernorm``) and ``other`` — the parts of docs/step-health.md.
"""

from __future__ import annotations

import math
import re
from typing import Sequence

import torch

from kit.megatron_gpt import canonical_names
from twinkle_megatron import keys

_PREFIXES = (("embedding.", "embedding"), ("output_layer.", "output_layer"), ("decoder.final_layernorm.", "final_norm"))


def part_of(canonical: str, num_layers: int) -> str:
    """The step-health part of a parameter of the single-process model."""
    layer = re.match(r"decoder\.layers\.(\d+)\.", canonical)
    if layer:
        return keys.layer_part(int(layer.group(1)), num_layers)
    return next((part for prefix, part in _PREFIXES if canonical.startswith(prefix)), "other")


def part_norms(chunks: Sequence[torch.nn.Module]) -> dict[str, tuple[float, float]]:
    """Each part's (gradient norm, parameter norm), in float64, of DDP-wrapped single-process ``chunks``."""
    squares: dict[str, list[float]] = {}
    for chunk in chunks:
        num_layers = chunk.module.config.num_layers
        names = canonical_names(chunk.module)
        for name, param in chunk.module.named_parameters():
            entry = squares.setdefault(part_of(names[name], num_layers), [0.0, 0.0])
            entry[0] += float(param.main_grad.double().square().sum())
            entry[1] += float(param.detach().double().square().sum())
    return {part: (math.sqrt(grad), math.sqrt(value)) for part, (grad, value) in squares.items()}
