"""Where the language model sits in a Megatron model chunk: the module whose ``output_layer`` makes the logits."""

from __future__ import annotations

from typing import Sequence

import torch


def language_models(chunks: Sequence[torch.nn.Module]) -> list[torch.nn.Module]:
    """The modules with an ``output_layer`` (GPTModel on the last stage), through any wrappers."""
    found = []
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(getattr(module, "output_layer", None), torch.nn.Module) and \
                    getattr(module, "post_process", True):
                found.append(module)
    return found


def mtp_heads(gpt: torch.nn.Module) -> int:
    """How many multi-token-prediction heads call ``output_layer`` before the main head does."""
    config = getattr(gpt, "config", None)
    return int(getattr(config, "mtp_num_layers", None) or 0)
