"""The one place that turns what ``accumulate`` receives into microbatches and masks.

``inputs`` is one ``InputFeature`` (any mapping) or a list of them, one per
microbatch (what Megatron's pipeline schedules produce). Each output value is
either a list with one entry per microbatch or one value for the whole batch;
in the second case the microbatches' inputs are concatenated along the batch
dimension so that inputs and outputs describe the same tokens. An empty list
(what Twinkle's Megatron model gives earlier pipeline stages for ``logits``)
or ``None`` means "not given".

Per-call values (``lr``, ``step``, ``grad_norm``, ``loss_reduction``,
``old_logps``, rewards, ...) are read by :func:`call_value`: the ``accumulate``
keyword first (Twinkle's models pass them so), then ``outputs``, then the
metric's constructor default.
"""

from __future__ import annotations

import sys
from typing import Any, Iterator, Mapping, Optional, Sequence

import torch

from .tensors import token_mask

MicroBatch = tuple[Mapping[str, Any], dict[str, Any]]


def given(value: Any) -> bool:
    """A value was passed: not None, not an empty list, not Twinkle's ``...`` placeholder."""
    if value is None or value is Ellipsis:
        return False
    return not (isinstance(value, (list, tuple)) and len(value) == 0 and not hasattr(value, "_fields"))


def arrays_as_tensors(value: Any, depth: int = 4) -> Any:
    """``value`` with the numpy arrays in it (itself, or inside mappings, lists and tuples up to ``depth``
    levels) as tensors; ``value`` itself, not a copy, when it holds none.

    Called once per ``accumulate`` at the input boundary, so that every metric reads tensors. A list is
    homogeneous: one whose first item is a tensor, a number or a string (per-microbatch logits, rewards,
    completions) is taken to hold no arrays and is not walked.
    """
    numpy = sys.modules.get("numpy")  # numpy arrays exist only once numpy is imported
    return value if numpy is None else _arrays_as_tensors(value, numpy.ndarray, depth)


_LEAVES = frozenset({torch.Tensor, int, float, bool, str, type(None)})  # types that hold no array


def _arrays_as_tensors(value: Any, ndarray: type, depth: int) -> Any:
    # Type identity first: isinstance against torch.Tensor or an ABC costs ~0.5 us when it fails.
    kind = type(value)
    if kind in _LEAVES:
        return value
    if isinstance(value, ndarray):
        if value.dtype.kind not in "biufc":
            return value  # object and string arrays: no tensor dtype
        # Shared memory where torch can share it; a copy of a read-only or strided array.
        return torch.from_numpy(value) if value.flags.writeable and value.flags.c_contiguous else torch.tensor(value)
    if depth == 0:
        return value
    if kind is dict or (kind is not list and kind is not tuple and isinstance(value, Mapping)):
        converted = None
        for key, item in value.items():
            if type(item) in _LEAVES:  # most values of a call (tensors, numbers): no call
                continue
            new = _arrays_as_tensors(item, ndarray, depth - 1)
            if new is not item:
                converted = dict(value) if converted is None else converted
                converted[key] = new
        return value if converted is None else converted
    if isinstance(value, (list, tuple)) and value and type(value[0]) not in _LEAVES:
        converted = None
        for index, item in enumerate(value):
            if type(item) in _LEAVES:
                continue
            new = _arrays_as_tensors(item, ndarray, depth - 1)
            if new is not item:
                converted = list(value) if converted is None else converted
                converted[index] = new
        if converted is None:
            return value
        if hasattr(value, "_fields"):
            return type(value)(*converted)
        return tuple(converted) if isinstance(value, tuple) else converted
    return value


def call_value(name: str, kwargs: Mapping[str, Any], outputs: Optional[Mapping[str, Any]] = None,
               default: Any = None, aliases: Sequence[str] = ()) -> Any:
    """A per-call value: ``kwargs[name]`` first, then ``outputs[name]``, then ``default``.

    ``aliases`` are other names of the same value, looked up after ``name`` in
    each place (Twinkle's docs and code differ: ``generation_time`` /
    ``generate_time``). Values that are not :func:`given` are skipped.
    """
    for source in (kwargs, outputs if outputs is not None else {}):
        for key in (name, *aliases):
            value = source.get(key)
            if given(value):
                return value
    return default


def with_call_values(source: Mapping[str, Any], kwargs: Mapping[str, Any], outputs: Optional[Mapping[str, Any]],
                     names: Sequence[str]) -> dict[str, Any]:
    """``source`` (the outputs a metric splits per microbatch) plus each of ``names`` that has a per-call value
    (:func:`call_value`: the keyword first, then ``outputs``), so that :func:`microbatches` pairs keyword values
    with the microbatches like outputs (one value for the whole call, or one per microbatch)."""
    found = {name: call_value(name, kwargs, outputs) for name in names}
    return {**source, **{name: value for name, value in found.items() if value is not None}}


def call_microbatches(inputs: Any, outputs: Optional[Mapping[str, Any]], kwargs: Mapping[str, Any],
                      keys: Sequence[str], per_call: Sequence[str] = ()) -> tuple[list[MicroBatch], dict[str, Any]]:
    """Stage 1 of the input pipeline (:mod:`.view`): the call's microbatches, each paired with the
    output ``keys`` present and its ``group_ids`` (the keyword first, then ``outputs``), and the per-call values
    named in ``per_call`` (:func:`call_value`; None where not given)."""
    values = {name: call_value(name, kwargs, outputs) for name in per_call}
    source = with_call_values(outputs or {}, kwargs, outputs, ("group_ids",))
    return microbatches(inputs, source, (*keys, "group_ids")), values


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
    present = {key: outputs[key] for key in keys if key in outputs and given(outputs[key])}
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
        return [(ConcatenatedBatch(batches), dict(whole))]
    return [
        (batch, {**whole, **{key: value[index] for key, value in listed.items()}})
        for index, batch in enumerate(batches)
    ]


def _per_microbatch(value: Any) -> bool:
    # A named tuple (TokenStats) is one value, not a list of microbatches.
    return isinstance(value, (list, tuple)) and not hasattr(value, "_fields")


class ConcatenatedBatch(Mapping):
    """The microbatches' inputs as one batch, each key concatenated along dim 0 when first read.

    Lazily, so that keys a metric never reads (``input_ids`` padded to another
    length in each microbatch) cannot fail; ``parts`` keeps the microbatches for
    what needs no concatenation (token counts).
    """

    def __init__(self, parts: Sequence[Mapping[str, Any]]) -> None:
        self.parts = list(parts)
        self._merged: dict[str, Any] = {}

    def __getitem__(self, key: str) -> Any:
        if key not in self:
            raise KeyError(key)
        if key not in self._merged:
            self._merged[key] = _concatenate([part.get(key) for part in self.parts], key, self.parts)
        return self._merged[key]

    def __contains__(self, key: object) -> bool:
        return any(key in part for part in self.parts)

    def __iter__(self) -> Iterator[str]:
        return iter(dict.fromkeys(key for part in self.parts for key in part))

    def __len__(self) -> int:
        return len(dict.fromkeys(key for part in self.parts for key in part))


def _concatenate(values: list, key: str, parts: Sequence[Mapping[str, Any]]) -> Any:
    """One microbatch key over the whole call: tensors and lists concatenated along the batch, a number
    per microbatch (a ``dataset_id``) repeated for each of that microbatch's rows; never one part's value
    for all of them."""
    if all(v is None for v in values):
        return None
    if any(v is None for v in values):
        raise ValueError(f"inputs[*][{key!r}] is given for some microbatches only; the outputs are one value for "
                         "the whole batch, so it cannot be applied to the microbatches that have it")
    if all(isinstance(v, (list, tuple)) for v in values):
        return [item for v in values for item in v]
    if not all(isinstance(v, torch.Tensor) and v.dim() > 0 for v in values):
        batched = all(_is_scalar(v) or (isinstance(v, torch.Tensor) and v.dim() > 0) for v in values)
        if batched and all(_rows(part) is not None for v, part in zip(values, parts) if _is_scalar(v)):
            values = [torch.as_tensor(v).reshape(1).expand(_rows(part)) if _is_scalar(v) else v
                      for v, part in zip(values, parts)]
        elif all(isinstance(v, (bool, int, float, str)) for v in values) and len(set(values)) == 1:
            return values[0]  # the same value for every microbatch, and no rows to repeat it over
        else:
            raise ValueError(f"inputs[*][{key!r}] ({[type(v).__name__ for v in values]}) cannot be concatenated "
                             "over microbatches for outputs given for the whole batch; give the outputs per "
                             "microbatch, or per-sample tensors")
    if len({tuple(v.shape[1:]) for v in values}) > 1:
        raise ValueError(f"inputs[*][{key!r}] cannot be concatenated over microbatches: shapes "
                         f"{[tuple(v.shape) for v in values]} differ beyond the batch dimension")
    return torch.cat(values, dim=0)


def _is_scalar(value: Any) -> bool:
    return isinstance(value, (bool, int, float)) or (isinstance(value, torch.Tensor) and value.dim() == 0)


def _rows(part: Mapping[str, Any]) -> Optional[int]:
    """A microbatch's number of sequences: the batch dimension of its labels (or input ids)."""
    for key in ("labels", "input_ids"):
        value = part.get(key)
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return value.shape[0] if value.dim() > 1 else 1
    return None


def count_tokens(batch: Mapping[str, Any], ignore_index: int = -100) -> torch.Tensor:
    """The number of selected tokens in ``batch`` (see :func:`token_mask`), without concatenating microbatches."""
    parts = batch.parts if isinstance(batch, ConcatenatedBatch) else [batch]
    counts = []
    for part in parts:
        labels = part.get("labels")
        if labels is None:
            raise ValueError("counting tokens needs inputs['labels'] (or pass num_tokens)")
        labels = labels if isinstance(labels, torch.Tensor) else torch.as_tensor(labels)
        counts.append(token_mask(labels, part.get("completion_mask"), ignore_index).sum())
    return torch.stack(counts).sum()
