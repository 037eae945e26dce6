"""The one input pipeline: an ``accumulate`` call's microbatches as every metric reads them.

A metric declares what it reads (:class:`ViewSpec`) and gets one :class:`MicrobatchView` per microbatch,
validated, matched under context parallelism, on the device, with its per-sequence values spread over its
tokens. Its own math then reads only the view. The data passes each stage once, in this order:

1. :mod:`.microbatches`: the microbatches, each paired with its outputs; the per-call values (keyword first,
   then ``outputs``);
2. :mod:`.sequences`: each microbatch's share of the per-sequence values; ragged per-token arrays laid onto
   the labels as given;
3. :mod:`.context_parallel`: every per-token tensor cut to this CP rank's chunks where some are whole
   sequences (:func:`.align_to_cp_rank`), the tokens' positions;
4. :mod:`.packed`: the sub-sequences of packed rows;
5. here: the selected tokens (without the sequences whose ragged arrays are misaligned: their values
   would be invented), the per-sequence values over the tokens, the view.

Every check runs before the view is returned, so a metric changes no state for a call that raises.
Metrics read their views through the call's :class:`.SharedCall` (:meth:`.SharedCall.views`): the metrics of
one call that declare the same spec (GRPO, GSPO, CISPO, PPO's policy side; Accuracy and TokenStatsMetric) read
one list of views, and the pipeline runs once for all of them.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple, Optional

import torch

from ...parallel import ParallelContext
from .context_parallel import CPAlignment, align_microbatches
from .microbatches import call_microbatches
from .packed import PackedSequences, packed_microbatches
from .sequences import per_sequence_values
from .tensors import as_rows, check_same_shape, to_device, token_mask

Share = Callable[[tuple, Callable[[], Any]], Any]  # a call's SharedCall.shared: compute once per key, per call

LOGITS = "logits"  # the one per-token output whose sequence dimension depends on its layout
GROUP_IDS = "group_ids"  # per-token group ids, matched under CP with the other per-token tensors


class ViewSpec(NamedTuple):
    """What a metric reads from a call (the same spec gives the same views)."""

    metric: str  # its name, for error messages
    anchor: str  # the per-token output it is about: 'logps', 'values', 'logits', 'loss'
    per_token: tuple[str, ...] = ()  # more per-token outputs, matched with the anchor under CP
    paired: tuple[str, ...] = ()  # outputs paired per microbatch and read as given
    instead: tuple[str, ...] = ()  # paired outputs that stand for a missing anchor ('token_stats')
    per_sequence: tuple[str, ...] = ()  # per-call values, one per sequence, spread over its tokens
    rows: bool = True  # labels and per-token tensors as [sequences, length]; False: as given
    positions: bool = False  # each token's position in its row (CP chunks mapped back)
    ignore_index: int = -100
    cp_gathered: Optional[bool] = None
    group_key: Optional[str] = None  # the inputs key of group ids (None: the metric keeps no groups)
    layout: Optional[str] = None  # the logits' layout ('bsv', 'sbv', None: from the shapes)


class MicrobatchView(NamedTuple):
    """One microbatch, normalised: what a metric's math reads."""

    tensors: dict[str, torch.Tensor]  # the anchor, labels, completion_mask, per-token outputs, CP-matched
    output: Mapping[str, Any]  # the microbatch's outputs as given (the paired ones: logits, token_stats)
    selected: torch.Tensor  # the selected tokens: labels != ignore_index, completion_mask, real (not padding),
    # and not of a sequence whose ragged per-sequence array is misaligned (the metric's checks then make them counted)
    values: dict[str, torch.Tensor]  # each given per-sequence value per token: float64, 0 off the selected tokens
    misaligned_arrays: Any  # ragged arrays not one value per selected token (counted on CP rank 0)
    group_ids: Any  # per sample, or per token (CP-matched)
    positions: Optional[torch.Tensor]  # the tokens' positions in their rows, when the spec asks for them
    packed: Optional[PackedSequences]  # a packed row's sub-sequences (None: each row is a sequence)
    first_sequence: int  # the index of its first sequence among the call's sequences
    cp_gathered: bool  # whole sequences on every CP rank (see :class:`.CPAlignment`)
    counts_here: bool  # this rank adds the microbatch to its states
    index: int  # the microbatch's position among the call's microbatches (0 for a whole-batch call)
    # The rule ``selected`` follows, as a value: ``("token_mask", ignore_index)`` when it is exactly
    # :func:`.token_mask` of the labels and completion mask as given (no CP cut, no packing, no misaligned
    # sequence left out), so the microbatch's token classes under that rule serve it; else the view's ``key``.
    selected_rule: tuple
    key: tuple  # names this view among the call's (its spec less the metric's name, the CP rank, ``index``)

    @property
    def labels(self) -> torch.Tensor:
        return self.tensors["labels"]

    @property
    def sequence_count(self) -> int:
        """The number of sequences: rows, or a packed row's sub-sequences (a shape: no host sync)."""
        return self.packed.count if self.packed is not None else self.labels.shape[0]

    def sequence_sum(self, values: torch.Tensor) -> torch.Tensor:
        """``[sequences]``: Σ of per-token ``values`` (``[rows, length]``) over each sequence."""
        return self.packed.sum(values) if self.packed is not None else values.sum(-1)

    @property
    def sequence_positions(self) -> Optional[torch.Tensor]:
        """Each token's position in its own sequence (packed sub-sequences from 0), broadcasting to the labels."""
        if self.packed is not None:
            return self.packed.positions.reshape(self.labels.shape)
        return self.positions


def microbatch_views(inputs: Any, outputs: Any, kwargs: Mapping[str, Any], spec: ViewSpec,
                     context: ParallelContext, share: Optional[Share] = None,
                     key: tuple = ()) -> list[MicrobatchView]:
    """The views of one ``accumulate`` call (microbatches without the anchor or an ``instead`` output are left
    out); ``ValueError`` for any mismatch, before the caller changes a state.

    ``share``: how the call's metrics share the per-sequence values laid on the device
    (:meth:`.SharedCall.views` passes its :meth:`~.SharedCall.shared`, and ``key``, the name of its list of
    views); without it nothing is shared.
    """
    # 1. The microbatches and the per-call values.
    pairs, per_call = call_microbatches(inputs, outputs, kwargs, (spec.anchor, *spec.per_token, *spec.paired),
                                        spec.per_sequence)
    return _views_of(pairs, per_call, spec, context, share, key)


def microbatch_views_of(pairs: list[tuple[Mapping[str, Any], Mapping[str, Any]]], spec: ViewSpec,
                        context: ParallelContext) -> list[MicrobatchView]:
    """The views of microbatches a metric has already paired with their outputs (stage 1 done by the metric:
    :class:`.LossMetric` reads its microbatch values first and hands on those with per-token losses)."""
    return _views_of(pairs, {}, spec, context, None, ())


def _views_of(pairs: list[tuple[Mapping[str, Any], Mapping[str, Any]]], per_call: dict[str, Any], spec: ViewSpec,
              context: ParallelContext, share: Optional[Share], key: tuple) -> list[MicrobatchView]:
    indices = [index for index, (_, output) in enumerate(pairs)
               if spec.anchor in output or any(name in output for name in spec.instead)]
    pairs = [pairs[index] for index in indices]
    ids = [_group_ids(batch, output, spec) for batch, output in pairs]
    given = [_as_given(batch, output, group_ids, spec) for (batch, output), group_ids in zip(pairs, ids)]
    # 2. The per-sequence values, per microbatch: ragged arrays onto the labels as given.
    selected_as_given = [_selected_as_given(tensors, spec) for tensors in given] \
        if any(v is not None for v in per_call.values()) else []
    sequence_values = per_sequence_values(per_call, selected_as_given, share) if selected_as_given \
        else [{} for _ in given]
    for tensors, values in zip(given, sequence_values):
        tensors.update({name: (value.per_token, 1) for name, value in values.items() if value.per_token is not None})
    # 3. Context parallelism: only microbatches with the anchor have tensors to match.
    aligned = align_microbatches(given, [batch for batch, _ in pairs], context, spec.cp_gathered,
                                 [spec.anchor in output for _, output in pairs], spec.positions)
    # 4. Packed rows.
    packed = packed_microbatches([batch for batch, _ in pairs], [cp.tensors["labels"].shape[-1] for cp in aligned],
                                 context, [cp.cp_gathered for cp in aligned],
                                 [_device(cp.tensors, spec) for cp in aligned])
    # 5. The views.
    views, first_sequence = [], 0
    for index, ((_, output), tensors, cp, values, rows) in enumerate(
            zip(pairs, given, aligned, sequence_values, packed)):
        view = _view(output, tensors, cp, values, rows, selected_as_given[index] if selected_as_given else None,
                     ids[index], first_sequence, spec, context, indices[index], key)
        views.append(view)
        first_sequence += view.sequence_count
    return views


def _as_given(batch: Mapping[str, Any], output: Mapping[str, Any], ids: Any, spec: ViewSpec) -> dict[str, tuple]:
    """The microbatch's per-token tensors by name (its group ids too when per token), with their sequence
    dimensions, before any CP cut."""
    labels = batch.get("labels")
    if labels is None:
        raise ValueError(f"{spec.metric} needs inputs['labels']")
    labels = as_rows(labels) if spec.rows else torch.as_tensor(labels)
    tensors: dict[str, tuple] = {}
    for name in (spec.anchor, *spec.per_token):
        value = output.get(name)
        if value is None:
            continue
        value = as_rows(value) if spec.rows else value
        tensors[name] = (value, logits_sequence_dim(value, labels, spec.layout) if name == LOGITS
                         else value.dim() - 1)
    tensors["labels"] = (labels, labels.dim() - 1)
    completion_mask = batch.get("completion_mask")
    if completion_mask is not None:
        completion_mask = as_rows(completion_mask) if spec.rows else completion_mask
        tensors["completion_mask"] = (completion_mask, completion_mask.dim() - 1)
    if isinstance(ids, torch.Tensor) and ids.dim() == labels.dim() > 1:
        tensors[GROUP_IDS] = (ids, ids.dim() - 1)
    logits = output.get(LOGITS) if spec.anchor == LOGITS else None
    if logits is not None and logits.dim() == 2 and len({t.shape[d] for t, d in tensors.values()}) > 1:
        raise ValueError(f"packed logits {tuple(logits.shape)} and labels {tuple(labels.shape)} differ in length: "
                         "under context parallelism packed sequences are split per sequence, so pass the labels "
                         "of this rank's chunks")
    return tensors


def _group_ids(batch: Mapping[str, Any], output: Mapping[str, Any], spec: ViewSpec) -> Any:
    """The group ids of a microbatch: the ``group_ids`` keyword's entry, else ``inputs[group_key]``."""
    if spec.group_key is None:
        return None
    ids = output.get("group_ids")
    return ids if ids is not None else batch.get(spec.group_key)


def _device(tensors: Mapping[str, Any], spec: ViewSpec) -> torch.device:
    """Where the view's per-token results live: the anchor's device (the labels' without an anchor).
    ``tensors``: by name, tensors or (tensor, sequence dimension) pairs."""
    found = tensors.get(spec.anchor, tensors["labels"])
    return (found[0] if isinstance(found, tuple) else found).device


def _selected_as_given(tensors: Mapping[str, tuple], spec: ViewSpec) -> torch.Tensor:
    """The selected tokens of the labels as given (before any CP cut): the completion mask where it covers
    the same tokens (a CP chunk's mask next to whole labels is applied after the cut)."""
    labels = to_device(tensors["labels"][0], _device(tensors, spec))
    completion_mask = tensors.get("completion_mask", (None,))[0]
    if completion_mask is not None and tuple(completion_mask.shape) != tuple(labels.shape):
        completion_mask = None
    return token_mask(labels, None if completion_mask is None else to_device(completion_mask, labels.device),
                      spec.ignore_index)


def _view(output: Mapping[str, Any], given: Mapping[str, tuple], cp: CPAlignment, values: Mapping[str, Any],
          packed: Optional[PackedSequences], selected_as_given: Optional[torch.Tensor], ids: Any, first_sequence: int,
          spec: ViewSpec, context: ParallelContext, index: int, views_key: tuple) -> MicrobatchView:
    tensors = dict(cp.tensors)
    ids = tensors.pop(GROUP_IDS, ids)  # per-token ids as matched under CP, per-sample ones as given
    labels = tensors["labels"]
    cut = labels.shape[-1] != given["labels"][0].shape[-1]  # whole sequences cut to this rank's chunks
    _check(tensors, values, packed, ids, cut, cp.cp_gathered, spec, context)
    device = _device(tensors, spec)
    real = None if packed is None else packed.real.to(device).reshape(labels.shape)
    same_tokens = not cut and real is None and selected_as_given is not None and (
        "completion_mask" not in tensors or tuple(tensors["completion_mask"].shape) == tuple(labels.shape))
    if same_tokens:
        selected = selected_as_given
    else:
        completion_mask = tensors.get("completion_mask")
        selected = token_mask(to_device(labels, device), None if completion_mask is None else
                              to_device(completion_mask, device), spec.ignore_index, real)
    # The one rule for misaligned arrays: a sequence whose ragged array does not fit its selected tokens is left
    # out of the view (every key of the metric reading it), as if absent; the array is still counted.
    for value in values.values():
        if value.aligned is not None:
            selected = selected & to_device(value.aligned, device)[:, None]
    spread = {}
    zero = torch.zeros((), dtype=torch.float64, device=device) if values else None
    for name, value in values.items():
        per_token = tensors.pop(name) if value.per_token is not None else value.per_sequence[:, None]
        spread[name] = torch.where(selected, per_token.to(device=device, dtype=torch.float64), zero)
    misaligned = [value.misaligned for value in values.values() if value.ragged]
    counts_arrays_here = context.cp_rank == 0  # every CP rank lays the same whole arrays: CP rank 0 counts them
    key = (*views_key, index)
    plain = not cut and packed is None and all(value.aligned is None for value in values.values())
    return MicrobatchView(tensors, output, selected, spread,
                          sum(misaligned) * float(counts_arrays_here) if misaligned else 0.0, ids,
                          cp.positions, packed, first_sequence, cp.cp_gathered, cp.counts_here, index,
                          ("token_mask", spec.ignore_index) if plain else key, key)


def _check(tensors: Mapping[str, torch.Tensor], values: Mapping[str, Any], packed: Optional[PackedSequences],
           ids: Any, cut: bool, cp_gathered: bool, spec: ViewSpec, context: ParallelContext) -> None:
    """Shapes after the CP cut (per-sequence tensors like the anchor, per-token tensors like the labels), ragged
    arrays only on whole sequences, and what a packed row cannot hold."""
    labels = tensors["labels"]
    for name, value in values.items():
        if value.per_token is not None and spec.anchor in tensors:
            check_same_shape(name, tensors[name], spec.anchor, tensors[spec.anchor])
    for name, tensor in tensors.items():
        if spec.rows and name != "labels" and tensor.dim() == 2:
            check_same_shape("labels", labels, name, tensor)
        elif not spec.rows and name not in ("labels", "completion_mask", LOGITS):
            check_same_shape(name, tensor, "labels", labels)
    ragged = [name for name, value in values.items() if value.ragged]
    if ragged and context.cp_size > 1 and not cp_gathered and not cut:
        raise ValueError(f"{ragged[0]}: per-token arrays need whole sequences, but each context-parallel rank holds "
                         "chunks of them; pass a tensor shaped like this rank's logps, one number per sequence, "
                         "or the labels gathered over CP (whole sequences) with them")
    if packed is None:
        return
    if labels.dim() == 2 and labels.shape[0] != 1:
        raise ValueError(f"{spec.metric}: a packed microbatch (cu_seqlens) holds one row of tokens, but its labels "
                         f"have shape {tuple(labels.shape)}")
    if ids is not None and spec.rows:
        raise ValueError(f"{spec.metric}: group ids of packed sub-sequences are not supported (one group per packed "
                         "row would be applied to all of its sequences); pass unpacked rows for per-group keys")
    if cut:
        raise ValueError(f"{spec.metric}: a packed microbatch's per-token tensors must all be this CP rank's pieces "
                         "of its sequences or all whole (gathered over CP); some are each")


def logits_sequence_dim(logits: torch.Tensor, labels: torch.Tensor, layout: Optional[str]) -> int:
    """The logits' sequence dimension: 1 for ``[b, s, v]``, 0 for ``[s, b, v]`` and packed ``[t, v]``."""
    if logits.dim() != 3 or labels.dim() != 2:
        return 0
    if layout is None and tuple(logits.shape[:2]) != tuple(labels.shape):
        # Lengths may differ by the CP factor; the batch dimension tells the layout apart.
        layout = "sbv" if logits.shape[1] == labels.shape[0] and logits.shape[0] != labels.shape[0] else "bsv"
    return 0 if layout == "sbv" else 1
