"""Stage 2 of the input pipeline (:mod:`.view`): the call's per-sequence values, per microbatch.

Twinkle passes ``old_logps``, ``advantages``, ``rollout_logps``, ``old_values``, ``returns``… for every
sequence of an ``accumulate`` call, in one of these forms:

* a list with one entry per sequence: a number (the sequence's value, spread over its selected tokens) or a
  1-D array with the values of the sequence's selected tokens in order (the ``i``-th value goes to the
  ``i``-th selected token, like Twinkle's ``align_logps_to_mask``);
* a 1-D tensor with one number per sequence;
* a tensor shaped like the logps of the whole call, or a list with one tensor per microbatch shaped like
  that microbatch's logps.

:func:`per_sequence_values` splits them by microbatch and returns, for each, either a ``[sequences]``
vector (numbers: the view spreads them over the tokens) or a per-token tensor (given per token, or a
ragged list laid onto the selected tokens). Ragged arrays are laid onto the labels *as given*, before the
context-parallel cut (stage 3): which selected tokens a CP chunk holds is known only from whole sequences,
so the per-token result is then cut with the labels, like every other per-token tensor. A ragged array
that does not hold one value per selected token of its sequence (shorter or longer) is *misaligned*: it is
counted (``misaligned``), and its sequence is marked not aligned (``aligned``) so that the view leaves that
sequence's tokens out of the metric's keys; no value is invented for it (nor cut off it). A packed
microbatch (``cu_seqlens``) is one row: its per-sequence values must be given per token.
"""

from __future__ import annotations

import numbers
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch

from .tensors import host_float64, is_host_number, to_device


class SequenceValues(NamedTuple):
    """One microbatch's share of a per-sequence value: per sequence or per token, and its ragged misfits."""

    per_sequence: Optional[torch.Tensor]  # float64 [sequences] (numbers), or None
    per_token: Optional[torch.Tensor]  # [sequences, length] as given or laid onto the labels, or None
    misaligned: Any  # ragged arrays whose length is not their sequence's selected tokens: a device count, or 0.0
    ragged: bool  # laid onto the labels as given (then they must hold whole sequences)
    # bool [sequences]: the sequences whose values fit their selected tokens (ragged only; None: all of them).
    # The view leaves the others' tokens out (:mod:`.view`): their values would be invented.
    aligned: Optional[torch.Tensor] = None


def per_sequence_values(values_by_name: dict[str, Any], selected: Sequence[torch.Tensor],
                        share: Optional[Callable[[tuple, Callable[[], Any]], Any]] = None
                        ) -> list[dict[str, SequenceValues]]:
    """Each microbatch's share of each per-call value (None values are left out).

    ``selected``: each microbatch's selected tokens as given (``[sequences, length]``, before any CP cut), on
    the device the values go to. Raises ``ValueError`` when the number of sequences or a tensor's rows do not match.
    ``share``: the call's :meth:`.SharedCall.shared`, through which its metrics share each value's pieces on the
    device (a per-call value of a name is the same for every metric of the call, so the name, the microbatches'
    sequence counts and devices name them: host lists cross to the device once per call).
    """
    rows = tuple(tokens.shape[0] for tokens in selected)
    devices = tuple(tokens.device for tokens in selected)
    result: list[dict[str, SequenceValues]] = [{} for _ in selected]
    for name, values in values_by_name.items():
        if values is None:
            continue
        pieces = share(("sequence_values", name, rows, devices),
                       lambda v=values, n=name: _pieces_on(v, n, rows, devices)) if share is not None \
            else _pieces_on(values, name, rows, devices)
        for index, (piece, tokens) in enumerate(zip(pieces, selected)):
            result[index][name] = _microbatch_values(piece, tokens, tokens.device)
    return result


def _pieces_on(values: Any, name: str, rows: Sequence[int], devices: Sequence[torch.device]) -> list[Any]:
    """Each microbatch's piece of ``values``: a tensor as split, or a list's numbers and arrays on its device
    (:func:`_values_on`)."""
    return [piece if isinstance(piece, torch.Tensor) else _values_on(piece, device)
            for piece, device in zip(split_per_microbatch(values, name, rows), devices)]


def _microbatch_values(piece: Any, selected: torch.Tensor, device: torch.device) -> SequenceValues:
    if isinstance(piece, torch.Tensor):
        if piece.dim() == 1:
            return SequenceValues(piece.to(device=device, dtype=torch.float64), None, 0.0, False)
        return SequenceValues(None, piece, 0.0, False)
    scalars, arrays = piece
    if arrays is None:
        return SequenceValues(scalars, None, 0.0, False)
    bordered, lengths, is_scalar = arrays
    # The i-th selected token of a sequence (i from 1: the running count of selected tokens) takes column i of
    # its bordered row: its i-th value, or a 0 of the border before the first selected token and past the
    # row's values. Three ops, no comparison: the border holds what a mask would have to put there. A row
    # whose array is shorter or longer than its selected tokens is marked not aligned: its zeros past the
    # values (or its cut-off tail) are no data, and the view leaves the row's tokens out.
    count = selected.cumsum(-1)
    tokens = bordered.gather(1, count.clamp(max=bordered.shape[1] - 1))
    wrong_length = count[:, -1] != lengths if count.shape[-1] else lengths != 0
    if is_scalar is not None:  # numbers among the arrays: spread over their sequence's tokens, never misaligned
        tokens = torch.where(is_scalar[:, None], scalars[:, None].expand(selected.shape), tokens)
        wrong_length = wrong_length & ~is_scalar
    misaligned = wrong_length.sum(dtype=torch.float64)
    return SequenceValues(None, tokens, misaligned, True, ~wrong_length)


def split_per_microbatch(values: Any, name: str, rows: Sequence[int]) -> list[Any]:
    """Per-sequence or per-token ``values`` of a whole ``accumulate`` call, one entry per microbatch.

    ``rows`` are the microbatches' numbers of sequences. Raises ``ValueError`` when the number of sequences,
    or a tensor's rows, do not match (shapes only, no host sync); lengths are matched with the labels later,
    under context parallelism (stage 3).
    """
    total = sum(rows)
    if isinstance(values, torch.Tensor):
        if values.dim() == 1 and len(rows) == 1 and total == 1 and values.shape[0] != 1:
            values = values.unsqueeze(0)  # the tokens of one packed sequence
        if values.dim() == 0 or values.shape[0] != total:
            raise ValueError(f"{name} has shape {tuple(values.shape)}, i.e. {values.shape[0] if values.dim() else 0} "
                             f"sequences, but the inputs hold {total} sequences")
        return list(values.split(list(rows)))
    if not isinstance(values, (list, tuple)):
        raise ValueError(f"{name} must be a list (one entry per sequence) or a tensor, got {type(values).__name__}")
    if values and len(values) == len(rows) and all(isinstance(v, torch.Tensor) and v.dim() >= 2 for v in values):
        for index, (value, count) in enumerate(zip(values, rows)):
            if value.shape[0] != count:
                raise ValueError(f"{name}[{index}] has shape {tuple(value.shape)} but microbatch {index} holds "
                                 f"{count} sequences")
        return list(values)
    if len(values) != total:
        raise ValueError(f"{name} has {len(values)} sequences but the inputs hold {total} sequences")
    pieces, start = [], 0
    for count in rows:
        pieces.append(list(values[start:start + count]))
        start += count
    return pieces


def _values_on(values: Any, device: torch.device) -> tuple[torch.Tensor, Optional[tuple]]:
    """A list of per-sequence values on ``device``: the numbers (0 for arrays) as a ``[sequences]`` vector, and
    unless every entry is a number, ``(bordered arrays, lengths, is_scalar)``.

    Row ``s`` of the bordered arrays is ``[0, v_1 … v_n, 0 …]``: a 0, sequence ``s``'s values, and zeros to one
    column past the longest array. ``lengths`` (float64) holds each ``n`` (0 for a number); ``is_scalar`` which
    entries are numbers, None when none is (known on the host: then no op reads it).
    """
    scalar_row = [_is_number(item) for item in values]
    if all(scalar_row):
        # Host values (Twinkle's lists) cross to the device in one copy; device tensors stay where they are.
        return _stack_on(device, list(values)), None
    if all(is_host_number(item) if is_scalar else isinstance(item, list) and (not item or is_host_number(item[0]))
           for item, is_scalar in zip(values, scalar_row)):
        return _host_lists_on(values, scalar_row, device)
    scalars = _stack_on(device, [item if is_scalar else 0.0 for item, is_scalar in zip(values, scalar_row)])
    arrays = [torch.as_tensor([] if is_scalar else item, dtype=torch.float64).reshape(-1)
              for item, is_scalar in zip(values, scalar_row)]
    lengths = to_device(torch.tensor([float(len(a)) for a in arrays], dtype=torch.float64), device)
    zero = torch.zeros(1, dtype=torch.float64)
    bordered = torch.nn.utils.rnn.pad_sequence([torch.cat([zero.to(a.device), a, zero.to(a.device)]).to(device)
                                                for a in arrays], batch_first=True)
    return scalars, (bordered, lengths, to_device(torch.tensor(scalar_row), device) if any(scalar_row) else None)


def _host_lists_on(values: Any, scalar_row: list[bool], device: torch.device) -> tuple[torch.Tensor, tuple]:
    """Twinkle's form (Python lists of numbers, and numbers): bordered on the host (see :func:`_values_on`),
    then one copy to ``device`` of the bordered rows followed by a ``[3, sequences]`` block of the numbers,
    the lengths and which entries are numbers."""
    lengths = [0 if is_scalar else len(item) for item, is_scalar in zip(values, scalar_row)]
    width = max(lengths) + 2
    flat: list = []
    for item, is_scalar, length in zip(values, scalar_row, lengths):
        flat.append(0.0)
        if not is_scalar:
            flat.extend(item)
        flat.extend([0.0] * (width - 1 - length))
    flat.extend(item if is_scalar else 0.0 for item, is_scalar in zip(values, scalar_row))
    flat.extend(lengths)
    flat.extend(scalar_row)
    rows = len(lengths)
    copied = host_float64(flat, device)
    arrays, block = copied[:rows * width].view(rows, width), copied[rows * width:].view(3, rows)
    return block[0], (arrays, block[1], block[2] > 0 if any(scalar_row) else None)


def _stack_on(device: torch.device, items: list) -> torch.Tensor:
    """Numbers and 0-d tensors as one float64 vector on ``device`` (one copy for host numbers)."""
    if all(not isinstance(item, torch.Tensor) for item in items):
        return host_float64(items, device)
    return torch.stack([torch.as_tensor(item, dtype=torch.float64).reshape(()).to(device) for item in items])


def _is_number(item: Any) -> bool:
    return isinstance(item, numbers.Number) or getattr(item, "ndim", None) == 0
