"""The opt-in fused loss: GPTModel's language-model loss and the token statistics from one pass.

``instrument(..., fused_loss=True)`` replaces, on each language model instance
(never on the class, never globally), ``compute_language_model_loss(labels,
logits)`` — the method ``GPTModel.forward(..., labels=...)`` calls with the
output layer's ``[s, b, V/tp]`` logits — by
:func:`~twinkle_megatron.ops.fused_cross_entropy.vocab_parallel_cross_entropy_with_stats`:
the same loss and gradient as megatron-core's ``vocab_parallel_cross_entropy``
(see that module), with the argmax, label log-prob and entropy of the same pass
handed to the metrics. :meth:`FusedLoss.detach` puts the model's own method back.

What it reproduces is the loss megatron-core 0.13–0.19 computes when
``config.cross_entropy_loss_fusion`` is off: ``vocab_parallel_cross_entropy(logits,
labels)`` over the TP group (no label smoothing: GPTModel passes none). Anything
else is **refused at** ``instrument()`` **time**, with a ``ValueError`` saying
why (every rank holds the same config, so every rank refuses alike):

* ``cross_entropy_loss_fusion=True``: TE's kernel (``'te'``) writes the
  gradient into the logits during the forward and treats out-of-range labels its
  own way, and it cannot run here (no TE without CUDA) to be checked; the
  ``'native'`` one computes the same formulas, but replacing a kernel the user
  chose is not this option's call: turn the fusion off to use the fused loss.
* multi-token prediction (``mtp_num_layers``): the MTP heads' losses go through
  the same method with shifted labels and their own scaling; telling their calls
  from the main head's differs between releases.
* a class that overrides ``compute_language_model_loss`` (its loss is not
  megatron-core's, so ours would silently change training).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from ..ops.fused_cross_entropy import vocab_parallel_cross_entropy_with_stats
from ..ops.token_stats import TokenStats

METHOD = "compute_language_model_loss"
StatsSink = Callable[[torch.Tensor, TokenStats], None]  # (labels [b, s], statistics shaped like them)


def check_fused_loss(chunks: Sequence[torch.nn.Module]) -> None:
    """``ValueError`` saying why, when the fused loss cannot reproduce these model chunks' loss exactly."""
    refusal = fused_loss_refusal(chunks)
    if refusal:
        raise ValueError(f"instrument(fused_loss=True): {refusal}")


def fused_loss_refusal(chunks: Sequence[torch.nn.Module]) -> Optional[str]:
    """Why the fused loss cannot reproduce these model chunks' loss exactly, or None when it can."""
    from megatron.core.models.common.language_module.language_module import LanguageModule

    for chunk in chunks:
        for module in chunk.modules():
            if not isinstance(module, LanguageModule):
                continue
            config = module.config
            if getattr(config, "cross_entropy_loss_fusion", False):
                impl = getattr(config, "cross_entropy_fusion_impl", "native")
                return (f"config.cross_entropy_loss_fusion=True (cross_entropy_fusion_impl={impl!r}): the fused loss "
                        "reproduces megatron-core's unfused vocab_parallel_cross_entropy only (TE's kernel writes "
                        "gradients into the logits and treats out-of-range labels its own way); set "
                        "cross_entropy_loss_fusion=False to use fused_loss=True")
            if getattr(config, "mtp_num_layers", None):
                return (f"multi-token prediction (mtp_num_layers={config.mtp_num_layers}): the MTP heads' losses go "
                        "through compute_language_model_loss too, with shifted labels; fused_loss=True supports the "
                        "main head alone")
            if getattr(type(module), METHOD) is not LanguageModule.compute_language_model_loss:
                return (f"{type(module).__name__} overrides {METHOD}: its loss is not megatron-core's "
                        "vocab_parallel_cross_entropy, which is all fused_loss=True reproduces")
    return None


class FusedLoss:
    """The fused loss on the language models given to :meth:`attach`; :meth:`detach` restores them.

    ``on_stats(labels, stats)`` receives each call's statistics in the labels' ``[b, s]`` layout.
    The TP group is the model's own ``tp_group`` (megatron-core 0.15+ passes it to the loss), else
    ``default_group()`` (parallel_state's, what older releases use).
    """

    def __init__(self, on_stats: StatsSink, default_group: Callable[[], Any], vocab_size: Optional[int] = None,
                 ignore_index: int = -100) -> None:
        self.on_stats, self.default_group = on_stats, default_group
        self.vocab_size, self.ignore_index = vocab_size, ignore_index
        self._restore: list[tuple[torch.nn.Module, Any]] = []

    def attach(self, model: torch.nn.Module) -> None:
        """The fused loss on ``model`` (a language model: GPTModel on the last stage), until :meth:`detach`."""
        own = model.__dict__.get(METHOD)  # an instance attribute someone set before us, if any
        model.__dict__[METHOD] = self._loss_of(model, self.on_stats, self.default_group)
        self._restore.append((model, own))

    def _loss_of(self, model: torch.nn.Module, on_stats: StatsSink, default_group: Callable[[], Any]) -> Callable:
        def compute_language_model_loss(labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
            group = getattr(model, "tp_group", None)
            group = default_group() if group is None else group
            # megatron-core's own steps around the cross-entropy: [b, s] labels -> [s, b], loss back to [b, s].
            loss, stats = vocab_parallel_cross_entropy_with_stats(
                logits, labels.transpose(0, 1).contiguous(), group, self.vocab_size, self.ignore_index)
            on_stats(labels, TokenStats(*(s.transpose(0, 1) for s in stats)))
            return loss.transpose(0, 1).contiguous()

        return compute_language_model_loss

    def detach(self) -> None:
        """Give every model its own ``compute_language_model_loss`` back."""
        for model, own in self._restore:
            if own is None:
                model.__dict__.pop(METHOD, None)
            else:
                model.__dict__[METHOD] = own
        self._restore.clear()
