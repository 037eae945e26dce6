"""Context parallelism (CP) in one place: which chunks a rank holds, matching gathered and local data.

Megatron splits each sequence into ``2·cp`` equal chunks and gives CP rank ``i``
chunks ``i`` and ``2·cp−1−i`` (load balancing causal attention; Megatron-LM's
``get_batch_on_this_cp_rank``, Twinkle's ``split_cp``). A metric can receive
per-token tensors in either state:

* **local**: this rank's two chunks (Megatron-LM passes everything so; the
  logits of every model are local);
* **complete** (gathered over CP): Twinkle's Megatron model gathers ``labels``
  and ``logps`` over CP before its metrics see them, while ``input_ids``,
  ``completion_mask`` and the logits stay local.

:func:`align_to_cp_rank` matches them per microbatch. Local data is counted by
every CP rank (the chunks add up to the sequence); complete data by CP rank 0
only, like duplicated TP ranks. When some tensors are complete and others
local, the complete ones are cut to this rank's chunks, so the result equals
the single-process one either way.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence, Union

import torch

from ...parallel import ParallelContext

SequenceTensors = dict[str, tuple[torch.Tensor, int]]  # name -> (tensor, its sequence dimension)


class CPAlignment(NamedTuple):
    """The microbatch's per-token tensors, all local or all complete, and which of the two."""

    tensors: dict[str, torch.Tensor]
    cp_gathered: bool  # every tensor holds whole sequences: count on CP rank 0 only, no CP partial sums
    counts_here: bool  # this rank adds the microbatch to its states (complete data: CP rank 0 only)
    positions: Optional[torch.Tensor] = None  # each local position's in the whole row, when asked for


def _alignment(tensors: dict[str, torch.Tensor], cp_gathered: bool, context: ParallelContext) -> CPAlignment:
    return CPAlignment(tensors, cp_gathered, not cp_gathered or context.cp_rank == 0)


def this_rank_chunks(tensor: torch.Tensor, dim: int, context: ParallelContext) -> torch.Tensor:
    """This CP rank's chunks ``i`` and ``2·cp−1−i`` of a complete ``tensor`` (along ``dim``); a copy."""
    cp, rank = context.cp_size, context.cp_rank
    length = tensor.shape[dim]
    if length % (2 * cp):
        raise ValueError(f"a sequence of {length} positions cannot be split into 2·cp = {2 * cp} equal chunks")
    chunk = length // (2 * cp)
    index = torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk),
                       torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)]).to(tensor.device)
    return tensor.index_select(dim, index)


def align_to_cp_rank(tensors: SequenceTensors, context: ParallelContext, cp_gathered: Optional[bool] = None,
                     local_length: Optional[int] = None) -> CPAlignment:
    """Match one microbatch's per-token tensors under context parallelism.

    ``tensors`` maps names to ``(tensor, sequence dim)``; ``local_length`` is the
    sequence length of this rank's chunks when known (the microbatch's
    ``input_ids``, which every model keeps local). With ``cp_size > 1``:

    * equal lengths: the data is complete when ``cp_gathered`` says so, or, with
      ``cp_gathered=None``, when the length is ``cp × local_length``; else local;
    * some ``cp`` times longer than the others: those are complete, the others
      local; the complete ones are cut to this rank's chunks (all local), which
      ``cp_gathered=True`` forbids (it promises whole sequences);
    * anything else: ``ValueError`` naming every tensor's length.
    """
    plain = {name: tensor for name, (tensor, _) in tensors.items()}
    if context.cp_size == 1 or not tensors:
        return _alignment(plain, True, context)
    cp = context.cp_size
    lengths = {name: tensor.shape[dim] for name, (tensor, dim) in tensors.items()}
    shortest, longest = min(lengths.values()), max(lengths.values())
    if shortest == longest:
        if cp_gathered is None:
            gathered = local_length is not None and shortest == cp * local_length
        else:
            gathered = cp_gathered
        return _alignment(plain, gathered, context)
    described = ", ".join(f"{name} {length}" for name, length in lengths.items())
    if longest != cp * shortest or any(length not in (shortest, longest) for length in lengths.values()):
        raise ValueError(f"per-token tensors of one microbatch have sequence lengths {described}; under context "
                         f"parallelism (cp={cp}) each must be this rank's chunks or the whole sequence ({cp}× "
                         "longer)")
    gathered = sorted(name for name, length in lengths.items() if length == longest)
    local = sorted(name for name, length in lengths.items() if length == shortest)
    if cp_gathered:
        raise ValueError(f"cp_gathered=True, but {local} hold this CP rank's chunks ({shortest} positions) while "
                         f"{gathered} hold whole sequences ({longest}); pass all of them gathered over CP, or "
                         "leave cp_gathered unset to have the whole ones cut to this rank's chunks")
    aligned = {name: this_rank_chunks(tensor, dim, context) if lengths[name] == longest else tensor
               for name, (tensor, dim) in tensors.items()}
    return _alignment(aligned, False, context)


def align_microbatches(microbatches: Sequence[SequenceTensors], batches: Sequence[Any], context: ParallelContext,
                       cp_gathered: Optional[bool], matched: Sequence[bool], positions: bool = False
                       ) -> list[CPAlignment]:
    """Stage 3 of the input pipeline (:mod:`.view`): :func:`align_to_cp_rank` for each ``matched``
    microbatch of a call (``batches``: their inputs, for the local length of :func:`local_sequence_length`);
    the others' tensors as given, complete as ``cp_gathered`` declares (statistics a hook computed from this
    rank's logits). With each token's position in the whole row (:func:`global_positions`) when ``positions``."""
    aligned = []
    for tensors, batch, match in zip(microbatches, batches, matched):
        if match:
            cp = align_to_cp_rank(tensors, context, cp_gathered, local_sequence_length(batch))
        else:
            cp = _alignment({name: tensor for name, (tensor, _) in tensors.items()}, bool(cp_gathered), context)
        if positions:
            labels = cp.tensors["labels"]
            cp = CPAlignment(cp.tensors, cp.cp_gathered, cp.counts_here,
                             global_positions(labels.shape[-1], context, cp.cp_gathered, labels.device))
        aligned.append(cp)
    return aligned


def global_positions(local_length: int, context: ParallelContext, cp_gathered: bool,
                     device: Union[str, torch.device, None] = None) -> torch.Tensor:
    """Position in the whole sequence of each local position (Megatron's CP chunks ``i`` and ``2·cp−1−i``)."""
    positions = torch.arange(local_length, device=device)
    if context.cp_size == 1 or cp_gathered:
        return positions
    if local_length % 2:
        raise ValueError(f"a context-parallel rank holds two equal chunks of each sequence, but the local "
                         f"sequence length is {local_length} (odd)")
    half, cp_rank = local_length // 2, context.cp_rank
    second = 2 * context.cp_size - 1 - cp_rank
    return torch.where(positions < half, cp_rank * half + positions, second * half + positions - half)


def local_sequence_length(batch: object) -> Optional[int]:
    """The length of this rank's chunks, from the microbatch's ``input_ids`` (kept local by every model)."""
    if hasattr(batch, "parts"):  # a concatenation of microbatches: read one part, never concatenate input_ids
        batch = batch.parts[0]
    input_ids = batch.get("input_ids") if hasattr(batch, "get") else None
    if isinstance(input_ids, torch.Tensor) and input_ids.dim() >= 1:
        return int(input_ids.shape[-1])
    return None
