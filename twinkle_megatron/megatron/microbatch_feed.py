"""One microbatch as the metrics receive it: the ``(inputs, outputs)`` pair of ``MetricCollection.accumulate``.

Both ways into :class:`~.instrumentation.MegatronInstrumentation` end here: its
hooks (the labels, loss mask and token statistics captured in the model, the
loss report of the ``loss_func``) and :meth:`~.instrumentation.MegatronInstrumentation.record_microbatch`
(the same values passed by hand). Twinkle's keys: ``inputs`` holds ``labels``,
``completion_mask`` (the loss mask, shaped like the labels), the group ids under
the metrics' ``group_key`` and, for packed (THD) rows, ``packed_seq_params``;
``outputs`` holds ``token_stats`` (the vocab-parallel statistics, computed once
and shared by every metric), Megatron's loss ``[sum, count]`` as ``loss`` and
``num_tokens``, and the per-token losses for the per-group, per-position and
per-sample losses. :func:`microbatch_call` makes the pair the one
:class:`~twinkle_megatron.metric.SharedCall` every metric reads, holding the
token classes the hooks made (so the tokens are classified once).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from ..metric import SharedCall, TokenClasses, give_token_classes
from ..ops import TokenStats


def microbatch_feed(*, labels: Optional[torch.Tensor] = None, loss_mask: Optional[torch.Tensor] = None,
                    stats: Optional[TokenStats] = None, group_key: str = "dataset_id", group_ids: Any = None,
                    loss: Any = None, num_tokens: Any = None, token_losses: Optional[torch.Tensor] = None,
                    more_inputs: Optional[Mapping[str, Any]] = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``(inputs, outputs)`` of one microbatch; ``loss_mask`` and ``stats`` count only with ``labels``,
    ``num_tokens`` only with ``loss``; ``more_inputs`` join ``inputs`` as they are."""
    inputs: dict[str, Any] = {}
    outputs: dict[str, Any] = {}
    if labels is not None:
        inputs["labels"] = labels
        if loss_mask is not None:
            inputs["completion_mask"] = loss_mask.reshape(labels.shape)
        if stats is not None:
            outputs["token_stats"] = stats
    if group_ids is not None:
        inputs[group_key] = group_ids
    if loss is not None:
        outputs.update(loss=loss, num_tokens=num_tokens)
    if token_losses is not None:
        outputs["token_losses"] = token_losses.detach()
    inputs.update(more_inputs or {})
    return inputs, outputs


def microbatch_call(inputs: Mapping[str, Any], outputs: Mapping[str, Any], kwargs: Mapping[str, Any],
                    classes: Optional[TokenClasses] = None, ignore_index: int = -100) -> SharedCall:
    """The call the metrics read for one microbatch; ``classes``: its tokens' classes over the loss mask's tokens
    with ``ignore_index`` (see :func:`.give_token_classes`), made from ``outputs['token_stats']``."""
    call = SharedCall(inputs, outputs, kwargs)
    if classes is not None:
        give_token_classes(call, classes, ignore_index)
    return call


def per_token_losses(output_tensor: Any, labels: torch.Tensor) -> Optional[torch.Tensor]:
    """GPTModel's output with ``labels=`` (one loss per token) shaped like ``labels``; None for anything else."""
    if isinstance(output_tensor, torch.Tensor) and output_tensor.numel() == labels.numel():
        return output_tensor.detach().reshape(labels.shape)
    return None
