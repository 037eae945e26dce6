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

from typing import Any, NamedTuple, Optional, Union

import torch
import torch.distributed as dist

from ..parallel import ParallelContext

SequenceTensors = dict[str, tuple[torch.Tensor, int]]  # name -> (tensor, its sequence dimension)
GROUP_IDS = "group_ids"  # the key of per-token group ids in a CP alignment


class CPAlignment(NamedTuple):
    """The microbatch's per-token tensors, all local or all complete, and which of the two."""

    tensors: dict[str, torch.Tensor]
    cp_gathered: bool  # every tensor holds whole sequences: count on CP rank 0 only, no CP partial sums

    def counts_here(self, context: ParallelContext) -> bool:
        """Whether this rank adds the microbatch to its states (complete data: CP rank 0 only)."""
        return not self.cp_gathered or context.cp_rank == 0


def per_token_tensors(labels: torch.Tensor, completion_mask: Optional[torch.Tensor] = None, group_ids: Any = None,
                      first: Optional[SequenceTensors] = None,
                      more: Optional[SequenceTensors] = None) -> SequenceTensors:
    """The tensors of one microbatch that :func:`align_to_cp_rank` matches, by name: ``first`` (the metric's own:
    logits, losses), ``labels``, ``completion_mask`` when given, ``more``, and ``group_ids`` when they are per
    token (shaped like labels of more than one dimension; per-sample ids need no matching). The sequence
    dimension is the last one, except in ``first`` and ``more`` (given with theirs).
    :func:`aligned_group_ids` takes the group ids back out of the alignment."""
    tensors: SequenceTensors = dict(first or {})
    tensors["labels"] = (labels, labels.dim() - 1)
    if completion_mask is not None:
        tensors["completion_mask"] = (completion_mask, completion_mask.dim() - 1)
    tensors.update(more or {})
    if isinstance(group_ids, torch.Tensor) and group_ids.dim() == labels.dim() > 1:
        tensors[GROUP_IDS] = (group_ids, group_ids.dim() - 1)
    return tensors


def aligned_group_ids(aligned: CPAlignment, group_ids: Any) -> Any:
    """The group ids after :func:`align_to_cp_rank`: per token ones as matched (taken out of ``aligned.tensors``,
    so that only the metric's tensors stay there), per-sample ones (or None) as given."""
    return aligned.tensors.pop(GROUP_IDS, group_ids)


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
        return CPAlignment(plain, cp_gathered=True)
    cp = context.cp_size
    lengths = {name: tensor.shape[dim] for name, (tensor, dim) in tensors.items()}
    shortest, longest = min(lengths.values()), max(lengths.values())
    if shortest == longest:
        if cp_gathered is None:
            gathered = local_length is not None and shortest == cp * local_length
        else:
            gathered = cp_gathered
        return CPAlignment(plain, gathered)
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
    return CPAlignment(aligned, cp_gathered=False)


def sum_over_context_parallel(tensor: torch.Tensor, context: ParallelContext, cp_gathered: bool) -> torch.Tensor:
    """``tensor`` summed over the CP group when each CP rank holds chunks of the sequences.

    One all-reduce (no host sync) when ``cp_size > 1`` and the data is not
    ``cp_gathered``; otherwise ``tensor`` itself. Every CP rank of the group must
    call it for the same microbatch, as every CP rank runs the same microbatches.
    """
    if context.cp_size == 1 or cp_gathered or not context.distributed:
        return tensor
    tensor = tensor.contiguous().clone()
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=context.cp_group)
    return tensor


def once_per_sequence(context: ParallelContext, cp_gathered: bool) -> float:
    """The weight (1.0 or 0.0) of a sequence-level value completed by :func:`sum_over_context_parallel`, so
    that each sequence counts once: after the sum every CP rank holds it, so CP rank 0 alone counts it;
    ``cp_gathered`` data reaches the metric's states on CP rank 0 only already (:meth:`CPAlignment.counts_here`)."""
    return 1.0 if cp_gathered or context.cp_rank == 0 else 0.0


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
