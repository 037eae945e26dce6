"""The base of every metric that reads logits: shared statistics, masking and value checks."""

from __future__ import annotations

from typing import Any, Iterator, NamedTuple, Optional

import torch

from ..inputs.keywords import check_layout_declared
from ..inputs.microbatches import call_value
from ..inputs.shared_call import SharedCall
from ..inputs.tensors import check_same_shape
from ..inputs.view import ViewSpec
from ..state.base import Metric, Number, SyncedStates
from ..state.groups import TokenSlices
from .logits_pass import Statistics, TokenClasses, call_token_classes, call_token_stats, check_vocab_size


class TokenBatch(NamedTuple):
    """One microbatch's labels (as the metric sees them, CP-matched) and their token statistics."""

    labels: torch.Tensor
    stats: Statistics


class LogitsMetric(Metric):
    """Walks the microbatches of ``accumulate`` and yields each one's token statistics and classes.

    ``outputs`` carry ``logits`` (this rank's vocab shard, ``[b, s, V/tp]`` or
    ``[s, b, V/tp]``) or ``token_stats`` precomputed by a hook. The selected tokens are
    ``labels != ignore_index`` and ``completion_mask``; of those, tokens with a
    non-finite logit are counted in ``nonfinite_tokens`` and labels outside
    ``[0, vocab_size)`` in ``invalid_labels``, the others are the counted tokens; in a
    packed microbatch (``cu_seqlens``, see :mod:`..inputs.packed`) padding is never selected. With
    ``strict=True`` (default) ``calculate()`` raises ``ValueError`` on every rank
    when any rank saw an invalid label (the count is global, so all ranks agree).
    """

    call_keywords = ("vocab_size", "logits_layout", "group_ids")
    output_keys = ("logits", "token_stats")
    reports_positions = True

    def __init__(self, device_mesh: Any = None, process_group: Any = None, ignore_index: int = -100,
                 vocab_size: Optional[int] = None, logits_layout: Optional[str] = None, strict: bool = True,
                 **kwargs: Any) -> None:
        super().__init__(device_mesh, process_group, **kwargs)
        self.ignore_index = ignore_index
        self.vocab_size = check_vocab_size(vocab_size)
        self.logits_layout = logits_layout
        self.strict = strict
        self.add_state("nonfinite_tokens", "sum")
        self.add_state("invalid_labels", "sum")

    def _token_batches(self, call: SharedCall) -> Iterator[tuple[TokenBatch, TokenClasses, Optional[TokenSlices]]]:
        """(labels and statistics, classes, partitions) for each microbatch that has logits or statistics and
        counts here (partitions: groups and position buckets, see :meth:`Metric._token_groups`). The metric adds
        the classes' :meth:`problem_counts` with its own sums (one op for all, see :meth:`Metric._add_token_sums`).

        The views, the statistics and the classes are the call's (:meth:`.SharedCall.views`,
        :func:`.call_token_stats`, :func:`.call_token_classes`): made once for all the metrics of the call.
        ``vocab_size``, ``logits_layout`` and ``group_ids`` are per-call values
        (keyword, then outputs, then the constructor's).
        """
        outputs, kwargs = call.outputs, call.kwargs
        if outputs is None:
            return
        vocab_size = check_vocab_size(call_value("vocab_size", kwargs, outputs, self.vocab_size))
        layout = call_value("logits_layout", kwargs, outputs, self.logits_layout)
        spec = ViewSpec(type(self).__name__, "logits", paired=("token_stats",), instead=("token_stats",), rows=False,
                        positions=self.position_buckets is not None, ignore_index=self.ignore_index,
                        cp_gathered=self.cp_gathered, group_key=self.group_key if self.group_names else None,
                        layout=layout)
        views = call.views(spec, self.context)
        for view in views:  # every check before any state changes
            check_layout_declared(self, view.output.get("logits"), view.labels, layout)
            stats = view.output.get("token_stats")
            if stats is not None and "logits" not in view.tensors:
                check_same_shape("labels", view.labels, "token_stats", stats.argmax)
        for view in views:
            if not view.counts_here:
                continue
            if "logits" in view.tensors:
                source = ("logits", vocab_size, layout, self.ignore_index)
                stats = call_token_stats(call, view, view.tensors["logits"], self.context, vocab_size, layout,
                                         self.ignore_index, self.token_statistics)
            else:
                source, stats = ("given",), view.output["token_stats"]
            classes = call_token_classes(call, view, stats, source)
            groups = self._token_groups(view.group_ids, classes.counted, view.selected, view.sequence_positions)
            yield TokenBatch(view.labels, stats), classes, groups

    @staticmethod
    def problem_counts(classes: TokenClasses) -> dict[str, torch.Tensor]:
        """The states ``nonfinite_tokens`` and ``invalid_labels`` -> their tokens of a microbatch (bool, per
        token)."""
        return {"nonfinite_tokens": classes.nonfinite, "invalid_labels": classes.invalid_label}

    def _token_problems(self, states: SyncedStates) -> dict[str, Number]:
        """``nonfinite_tokens`` / ``invalid_labels`` when non-zero; raises on invalid labels if strict."""
        invalid = int(states["invalid_labels"])
        if invalid and self.strict:
            raise ValueError(f"{type(self).__name__}: {invalid} label(s) outside [0, vocab_size) were seen across "
                             "all ranks (pass vocab_size, or strict=False to report the count instead)")
        problems: dict[str, Number] = {}
        if states["nonfinite_tokens"]:
            problems["nonfinite_tokens"] = int(states["nonfinite_tokens"])
        if invalid:
            problems["invalid_labels"] = invalid
        return problems
