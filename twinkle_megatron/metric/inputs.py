"""The one place that turns what ``accumulate`` receives into microbatches and masks.

``inputs`` is one ``InputFeature`` (any mapping) or a list of them, one per
microbatch (what Megatron's pipeline schedules produce). Each output value is
either a list with one entry per microbatch or one value for the whole batch;
in the second case the microbatches' inputs are concatenated along the batch
dimension so that inputs and outputs describe the same tokens.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import torch

MicroBatch = tuple[Mapping[str, Any], dict[str, Any]]


def microbatches(inputs: Any, outputs: Optional[Mapping[str, Any]], keys: Sequence[str]) -> list[MicroBatch]:
    """Pair inputs with the output ``keys`` present, one pair per microbatch.

    Raises ``ValueError`` when a per-microbatch output list and the inputs list
    differ in length, or when per-microbatch lists and whole-batch values are mixed.
    """
    batches = list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]
    for index, batch in enumerate(batches):
        if not isinstance(batch, Mapping):
            raise ValueError(f"inputs[{index}] is a {type(batch).__name__}; expected a mapping (InputFeature)")
    outputs = outputs or {}
    present = {key: outputs[key] for key in keys if key in outputs and outputs[key] is not None}
    listed = {k: v for k, v in present.items() if _per_microbatch(v)}
    whole = {k: v for k, v in present.items() if k not in listed}
    for key, value in listed.items():
        if len(value) != len(batches):
            raise ValueError(f"outputs[{key!r}] has {len(value)} microbatch entries but inputs has "
                             f"{len(batches)} microbatches")
    if listed and whole and len(batches) > 1:
        raise ValueError(f"outputs mix per-microbatch lists ({sorted(listed)}) with whole-batch values "
                         f"({sorted(whole)}); give all of them per microbatch or all for the whole batch")
    if whole and len(batches) > 1:
        return [(concatenate_batches(batches), dict(whole))]
    return [
        (batch, {**whole, **{key: value[index] for key, value in listed.items()}})
        for index, batch in enumerate(batches)
    ]


def _per_microbatch(value: Any) -> bool:
    # A named tuple (TokenStats) is one value, not a list of microbatches.
    return isinstance(value, (list, tuple)) and not hasattr(value, "_fields")


def concatenate_batches(batches: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Concatenate microbatch inputs along dim 0 (tensors) or by extension (lists)."""
    merged: dict[str, Any] = {}
    for key in batches[0]:
        values = [batch.get(key) for batch in batches]
        if all(isinstance(v, torch.Tensor) and v.dim() > 0 for v in values):
            trailing = {tuple(v.shape[1:]) for v in values}
            if len(trailing) > 1:
                raise ValueError(f"inputs[*][{key!r}] cannot be concatenated over microbatches: shapes "
                                 f"{[tuple(v.shape) for v in values]} differ beyond the batch dimension")
            merged[key] = torch.cat(values, dim=0)
        elif all(isinstance(v, (list, tuple)) for v in values):
            merged[key] = [item for v in values for item in v]
        else:
            merged[key] = values[0]
    return merged


def token_mask(labels: torch.Tensor, completion_mask: Optional[torch.Tensor] = None,
               ignore_index: int = -100) -> torch.Tensor:
    """Tokens that count: ``labels != ignore_index`` and ``completion_mask`` where given."""
    mask = labels != ignore_index
    if completion_mask is not None:
        check_same_shape("labels", labels, "completion_mask", completion_mask)
        mask = mask & completion_mask.to(torch.bool)
    return mask


def check_same_shape(name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> None:
    """``ValueError`` naming both tensors and shapes when the shapes differ (shapes only, no sync)."""
    if tuple(a.shape) != tuple(b.shape):
        raise ValueError(f"{name_a} has shape {tuple(a.shape)} but {name_b} has shape {tuple(b.shape)}")
