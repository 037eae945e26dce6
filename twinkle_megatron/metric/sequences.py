"""Per-sequence data: Twinkle's ragged per-sequence lists as per-token device tensors.

The one place for what sequence-level metrics (GRPO/GSPO/CISPO, PPO, DPO)
share: turning ``old_logps`` / ``advantages`` given per sequence into per-token
device tensors, and splitting a whole call's per-sequence values by microbatch.
Context parallelism is in :mod:`.context_parallel`, packed sequences (THD,
``cu_seqlens``) in :mod:`.packed`: a packed microbatch is one row of tokens
whose sub-sequences are the sequences (per-sequence sums by
:meth:`SequenceBatch.sequence_sum`, padding out of :meth:`SequenceBatch.token_mask`);
its per-sequence values must be given per token (tensors shaped like its logps).
"""

from __future__ import annotations

import numbers
from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence

import torch

from ..parallel import ParallelContext
from .call_cache import shared_value
from .context_parallel import (
    SequenceTensors,
    align_to_cp_rank,
    aligned_group_ids,
    global_positions,
    local_sequence_length,
    per_token_tensors,
    this_rank_chunks,
)
from .inputs import check_same_shape, microbatches, to_device, token_mask
from .packed import PackedSequences, packed_cu_seqlens, packed_sequences


def split_per_microbatch(values: Any, name: str, shapes: Sequence[tuple[int, ...]],
                         whole_sequences: bool = True) -> list[Any]:
    """Per-sequence or per-token ``values`` of a whole ``accumulate`` call, one entry per microbatch.

    ``shapes`` are the microbatches' logps shapes ``(sequences, length)``.
    Raises ``ValueError`` when the number of sequences, or a tensor's shape,
    does not match (shapes only, no host sync), and for per-token arrays
    when the sequences are not ``whole_sequences`` on this rank (CP chunks:
    which counted tokens a chunk holds is only known on all CP ranks together).
    """
    if values is None:
        return [None] * len(shapes)
    rows = [shape[0] for shape in shapes]
    total = sum(rows)
    if isinstance(values, torch.Tensor):
        packed_tokens = values.dim() == 1 and len(shapes) == 1 and total == 1 and shapes[0][1] == values.shape[0]
        if packed_tokens and values.shape[0] != 1:
            values = values.unsqueeze(0)  # the tokens of one packed sequence
        if values.dim() == 0 or values.shape[0] != total:
            raise ValueError(f"{name} has shape {tuple(values.shape)}, i.e. {values.shape[0] if values.dim() else 0} "
                             f"sequences, but the inputs hold {total} sequences")
        pieces = list(values.split(rows))
        if values.dim() > 1:
            for index, (piece, shape) in enumerate(zip(pieces, shapes)):
                if tuple(piece.shape) != tuple(shape):
                    raise ValueError(f"{name} has shape {tuple(values.shape)} but logps has shape {tuple(shape)} "
                                     f"(microbatch {index})")
        return pieces
    if not isinstance(values, (list, tuple)):
        raise ValueError(f"{name} must be a list (one entry per sequence) or a tensor, got {type(values).__name__}")
    if values and len(values) == len(shapes) and all(isinstance(v, torch.Tensor) and v.dim() >= 2 for v in values):
        for index, (value, shape) in enumerate(zip(values, shapes)):
            if tuple(value.shape) != tuple(shape):
                raise ValueError(f"{name}[{index}] has shape {tuple(value.shape)} but logps of microbatch {index} "
                                 f"has shape {tuple(shape)}")
        return list(values)
    if len(values) != total:
        raise ValueError(f"{name} has {len(values)} sequences but the inputs hold {total} sequences")
    if not whole_sequences and not all(_is_number(item) for item in values):
        raise ValueError(f"{name}: per-token arrays need whole sequences, but each context-parallel rank holds "
                         "chunks of them; pass a tensor shaped like this rank's logps, one number per sequence, "
                         "or the labels gathered over CP (whole sequences) with them")
    pieces, start = [], 0
    for count in rows:
        pieces.append(list(values[start:start + count]))
        start += count
    return pieces


def token_values(values: Any, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``values`` of one microbatch as a float64 tensor shaped like ``mask`` (0 where not counted).

    ``values``: a tensor shaped like ``mask``; a 1-D tensor with one number per
    sequence (spread over its counted tokens); or a list with one entry per
    sequence, a number (spread) or a 1-D array of the counted tokens' values in
    order (the ``i``-th value goes to the ``i``-th counted token, like Twinkle's
    ``align_logps_to_mask``). Also returns the number of sequences whose array
    length differs from their counted tokens (a device count: no host sync).
    """
    device = mask.device
    misaligned = torch.zeros((), dtype=torch.float64, device=device)
    if isinstance(values, torch.Tensor):
        values = values.to(device=device, dtype=torch.float64)
        if values.dim() == 1:
            values = values[:, None].expand(mask.shape)
        return torch.where(mask, values, torch.zeros((), dtype=torch.float64, device=device)), misaligned
    # The metrics of a collection read the same lists: they cross to the device once per call.
    scalars, arrays = shared_value(("token_values", id(values), device), lambda: _values_on(values, device),
                                   keep=(values,))
    spread = scalars[:, None].expand(mask.shape)
    if arrays is None:
        return torch.where(mask, spread, torch.zeros((), dtype=torch.float64, device=device)), misaligned
    padded, lengths, is_scalar = arrays
    rank_among_counted = mask.long().cumsum(-1) - 1
    scattered = padded.gather(1, rank_among_counted.clamp(0, padded.shape[1] - 1))
    scattered = torch.where(rank_among_counted < lengths[:, None], scattered, torch.zeros_like(scattered))
    result = torch.where(is_scalar[:, None], spread, scattered)
    misaligned = (~is_scalar & (mask.sum(-1) != lengths)).sum().to(torch.float64)
    return torch.where(mask, result, torch.zeros_like(result)), misaligned


def _values_on(values: Any, device: torch.device) -> tuple[torch.Tensor, Optional[tuple]]:
    """A list of per-sequence values on ``device``: the numbers (0 for arrays) as a ``[sequences]`` vector, and
    unless every entry is a number, ``(padded arrays [sequences, longest], lengths, is_scalar)``."""
    scalar_row = [_is_number(item) for item in values]
    # Host values (Twinkle's lists) cross to the device in one copy; device tensors stay where they are.
    scalars = _stack_on(device, [item if is_scalar else 0.0 for item, is_scalar in zip(values, scalar_row)])
    if all(scalar_row):
        return scalars, None
    arrays = [torch.as_tensor([] if is_scalar else item, dtype=torch.float64).reshape(-1)
              for item, is_scalar in zip(values, scalar_row)]
    lengths = to_device(torch.tensor([len(a) for a in arrays]), device)
    if all(a.device.type == "cpu" for a in arrays):
        padded = to_device(torch.nn.utils.rnn.pad_sequence(arrays, batch_first=True), device)
    else:
        padded = torch.nn.utils.rnn.pad_sequence([a.to(device) for a in arrays], batch_first=True)
    if padded.shape[1] == 0:
        padded = torch.zeros(len(arrays), 1, dtype=torch.float64, device=device)
    return scalars, (padded, lengths, to_device(torch.tensor(scalar_row), device))


def _stack_on(device: torch.device, items: list) -> torch.Tensor:
    """Numbers and 0-d tensors as one float64 vector on ``device`` (one copy for host numbers)."""
    if all(not isinstance(item, torch.Tensor) for item in items):
        return to_device(torch.tensor([float(item) for item in items], dtype=torch.float64), device)
    return torch.stack([torch.as_tensor(item, dtype=torch.float64).reshape(()).to(device) for item in items])


def _is_number(item: Any) -> bool:
    return isinstance(item, numbers.Number) or getattr(item, "ndim", None) == 0


def as_rows(tensor: Any) -> torch.Tensor:
    """A per-token tensor as ``[sequences, length]`` (a packed ``[t]`` is one sequence)."""
    tensor = tensor if isinstance(tensor, torch.Tensor) else torch.as_tensor(tensor)
    return tensor.unsqueeze(0) if tensor.dim() == 1 else tensor


def labels_2d(batch: Any, metric: str) -> torch.Tensor:
    labels = batch.get("labels")
    if labels is None:
        raise ValueError(f"{metric} needs inputs['labels']")
    return as_rows(labels)


class SequenceBatch(NamedTuple):
    """One microbatch of a sequence-level metric, matched under CP, with its share of per-sequence values."""

    tensors: dict[str, torch.Tensor]  # the anchor, labels, completion_mask, extras: [sequences, length]
    output: Mapping[str, Any]
    per_sequence: dict[str, Any]  # this microbatch's entries of each per-call per-sequence value
    first_sequence: int  # index of its first sequence among the call's sequences
    cp_gathered: bool  # whole sequences on every CP rank (see CPAlignment)
    counts_here: bool
    group_ids: Any = None  # per sample, or per token (then matched under CP with the rest)
    # Sequences whose ragged array was matched to whole gathered labels before the cut to this CP rank's
    # chunks (see sequence_batches) and did not have one value per counted token: counted on CP rank 0.
    misaligned_arrays: Any = 0.0
    packed: Optional[PackedSequences] = None  # a packed row's sub-sequences (None: each row is a sequence)

    def token_mask(self, anchor: str, ignore_index: int) -> torch.Tensor:
        """The tokens that count (``labels != ignore_index`` and ``completion_mask``, not packing's padding),
        on the anchor's device."""
        device = self.tensors[anchor].device
        completion_mask = self.tensors.get("completion_mask")
        mask = token_mask(to_device(self.tensors["labels"], device),
                          None if completion_mask is None else to_device(completion_mask, device), ignore_index)
        return mask if self.packed is None else mask & self.packed.real.to(device).reshape(mask.shape)

    @property
    def sequence_count(self) -> int:
        """The number of sequences: rows, or a packed row's sub-sequences (a shape: no host sync)."""
        return self.packed.count if self.packed is not None else self.tensors["labels"].shape[0]

    def sequence_sum(self, values: torch.Tensor) -> torch.Tensor:
        """``[sequences]``: Σ of per-token ``values`` (``[rows, length]``) over each sequence."""
        return self.packed.sum(values) if self.packed is not None else values.sum(-1)

    def positions(self, context: ParallelContext) -> torch.Tensor:
        """Each token's position in its own sequence (CP chunks mapped back, packed sub-sequences from 0),
        broadcasting to the tokens' shape."""
        labels = self.tensors["labels"]
        if self.packed is not None:
            return self.packed.positions.reshape(labels.shape)
        return global_positions(labels.shape[-1], context, self.cp_gathered, labels.device)


ExtraTensors = Callable[[Mapping[str, Any], Mapping[str, Any], torch.Tensor], SequenceTensors]


def sequence_batches(inputs: Any, outputs: Mapping[str, Any], anchor: str, output_keys: Sequence[str],
                     per_sequence: Mapping[str, Any], context: ParallelContext, cp_gathered: Optional[bool],
                     metric: str, extra: Optional[ExtraTensors] = None,
                     group_ids: Optional[Callable[[Any, Any], Any]] = None,
                     ignore_index: int = -100) -> list[SequenceBatch]:
    """The microbatches of one ``accumulate`` call of a sequence-level metric, all checked first.

    ``anchor`` is the per-token output the metric is about (``logps``,
    ``values``), ``output_keys`` other outputs to pair per microbatch,
    ``per_sequence`` the call's per-sequence values by name (split with
    :func:`split_per_microbatch`), ``extra(batch, output, labels)`` more per-token
    tensors to match under CP, ``group_ids(batch, output)`` the microbatch's group
    ids (per token ones are matched under CP too). Every shape is checked
    (``ValueError``) before the caller changes any state.

    Twinkle's Megatron model under CP hands whole (gathered) ``labels`` and
    ``logps`` next to a ``completion_mask`` of this rank's chunks, so the whole
    tensors are cut to the chunks; a ragged per-sequence array (one value per
    counted token, counted by ``labels != ignore_index`` like Twinkle's
    ``align_logps_to_mask``) is then laid onto the whole labels first and cut
    with them.
    """
    pairs = microbatches(inputs, outputs, (anchor, *output_keys, "group_ids"))
    aligned, ids_of, whole_labels, packed_of = [], [], [], []
    for batch, output in pairs:
        labels = labels_2d(batch, metric)
        cu_seqlens = packed_cu_seqlens(batch)
        if cu_seqlens is not None and labels.shape[0] != 1:
            raise ValueError(f"{metric}: a packed microbatch (cu_seqlens) holds one row of tokens, but its labels "
                             f"have shape {tuple(labels.shape)}")
        ids = group_ids(batch, output) if group_ids is not None else None
        if ids is not None and cu_seqlens is not None:
            raise ValueError(f"{metric}: group ids of packed sub-sequences are not supported (one group per packed "
                             "row would be applied to all of its sequences); pass unpacked rows for per-group keys")
        mask = batch.get("completion_mask")
        tensors = per_token_tensors(labels, None if mask is None else as_rows(mask), ids,
                                    first={anchor: (as_rows(output[anchor]), 1)},
                                    more=extra(batch, output, labels) if extra is not None else None)
        cp = align_to_cp_rank(tensors, context, cp_gathered, local_sequence_length(batch))
        ids_of.append(aligned_group_ids(cp, ids))
        whole_labels.append(labels if labels.shape[-1] != cp.tensors["labels"].shape[-1] else None)
        labels = cp.tensors["labels"]
        for name, tensor in cp.tensors.items():
            if name != "labels" and tensor.dim() == 2:
                check_same_shape("labels", labels, name, tensor)
        aligned.append(cp)
        if cu_seqlens is not None and whole_labels[-1] is not None:
            raise ValueError(f"{metric}: a packed microbatch's per-token tensors must all be this CP rank's pieces "
                             "of its sequences or all whole (gathered over CP); some are each")
        packed_of.append(None if cu_seqlens is None else packed_sequences(
            cu_seqlens, labels.shape[-1], context, cp.cp_gathered, cp.tensors[anchor].device))
    shapes = [tuple(cp.tensors[anchor].shape) for cp in aligned]
    # Ragged arrays can be laid onto whole sequences: labels that are whole here, or were before the cut.
    whole_sequences = all(cp.cp_gathered or whole is not None for cp, whole in zip(aligned, whole_labels))
    # Every metric of a collection gets the same pieces (so that they cross to the device once, see token_values);
    # the list of them is its own, as the loop below replaces entries.
    pieces = {name: list(shared_value(("split", id(values), name, tuple(shapes), whole_sequences),
                                      lambda v=values, n=name: split_per_microbatch(v, n, shapes, whole_sequences),
                                      keep=(values,)))
              for name, values in per_sequence.items()}
    misaligned: list[Any] = [0.0] * len(aligned)
    for index, whole in enumerate(whole_labels):
        if whole is None:
            continue
        for piece in pieces.values():
            if isinstance(piece[index], list) and not all(_is_number(item) for item in piece[index]):
                whole_mask = token_mask(to_device(whole, aligned[index].tensors[anchor].device), None, ignore_index)
                tokens, count = token_values(piece[index], whole_mask)
                piece[index] = this_rank_chunks(tokens, 1, context)
                misaligned[index] = misaligned[index] + count * (1.0 if context.cp_rank == 0 else 0.0)
    batches, first_sequence = [], 0
    for index, ((_, output), cp) in enumerate(zip(pairs, aligned)):
        batches.append(SequenceBatch(cp.tensors, output, {name: piece[index] for name, piece in pieces.items()},
                                     first_sequence, cp.cp_gathered, cp.counts_here(context), ids_of[index],
                                     misaligned[index], packed_of[index]))
        first_sequence += batches[-1].sequence_count
    return batches
