"""LossMetric: the token-weighted training loss, pooled over microbatches and ranks."""

from __future__ import annotations

import math
from typing import Any, Mapping, NamedTuple, Optional

import torch

from ..inputs.microbatches import call_value, count_tokens, microbatches, with_call_values
from ..inputs.tensors import all_finite, is_host_number, to_device
from ..inputs.view import ViewSpec, microbatch_views_of
from ..state.base import Metric, Number, SyncedStates
from ..state.groups import TokenSlices
from ..state.token_sums import sum_totals

_REDUCTIONS = ("mean", "sum")


class LossMetric(Metric):
    """Loss and gradient norm, Twinkle's ``LossMetric`` with Megatron's pooling.

    ``loss_reduction='sum'`` (Megatron-LM's per-token loss, and what Twinkle's
    Transformers model passes as a keyword): each microbatch passes the *sum* of
    its token losses and its token count ``num_tokens`` (from outputs, the
    ``num_tokens`` keyword, or ``labels != ignore_index``):

        loss = Σ loss_sum / Σ num_tokens     (sum over microbatches and DP×CP ranks)

    ``loss_reduction='mean'`` (the default, as in Twinkle): each microbatch passes
    a mean; they are averaged with equal weight (no counts exist to weight
    them), so a loss already averaged over DP×CP (Twinkle's Megatron model
    passes one) stays the same:

        loss = Σ loss_mean / number of values passed

    Per-token losses shaped like ``labels`` are pooled over the unmasked tokens
    whatever ``loss_reduction`` says. Only the last pipeline stage and TP rank 0
    count (TP ranks repeat the loss).

    Per-token losses next to a microbatch's value (``outputs['token_losses']``,
    shaped like ``labels``: what ``instrument()`` passes, GPTModel's per-token
    losses beside Megatron's ``[sum, count]`` report) serve two purposes. They
    slice the loss: per group (``group_names``, ``loss/<group>``: a microbatch's
    value with one group id goes to that group; per-sample or per-token ids need
    per-token losses) and per position bucket (``position_buckets``,
    ``loss/pos_<first>-<last>``). And they stand in for a non-finite value: the
    value counts in ``loss`` while it is finite; when it is not, the microbatch
    adds its counted tokens instead (Σ loss and tokens; for a mean, their
    mean with weight 1), so the healthy samples of a microbatch with one NaN
    sample still count in ``loss`` and ``loss/<group>``. In a packed microbatch
    (``cu_seqlens``) per-token losses of padding never count.

    Non-finite values are left out and counted in ``nonfinite_losses``: one per
    value (a microbatch's value without per-token losses, or a Python number),
    one per selected token with a non-finite loss where per-token losses are
    given (at least one for a non-finite value whose per-token losses are all
    finite).
    ``grad_norm`` is the latest finite value passed (max over ranks), a
    non-finite one is counted in ``nonfinite_grad_norms``.

    ``accumulate(inputs, outputs, *, loss_reduction=None, num_tokens=None, grad_norm=None)``:
    each keyword wins over ``outputs[...]`` of the same name, which wins over the
    constructor's default; any other keyword (Twinkle passes ``lr``, ``step``…)
    is ignored.

    Results: ``loss`` (when any token or value counted; NaN when every value
    passed was non-finite), ``grad_norm`` (when given), ``nonfinite_losses`` /
    ``nonfinite_grad_norms`` (when > 0); ``{}`` when nothing was passed.

    >>> from twinkle_megatron import LossMetric
    >>> metric = LossMetric()
    >>> # Megatron-LM's reports of two microbatches: [sum, count] = [6, 3] and [2, 1]
    >>> metric.accumulate([{}, {}], {"loss": [6.0, 2.0], "num_tokens": [3, 1]}, loss_reduction="sum",
    ...                   grad_norm=0.5)
    >>> metric.calculate()
    {'loss': 2.0, 'grad_norm': 0.5}
    """

    token_statistics = ()  # reads no logits

    nonfinite_loss_state = "nonfinite_losses"
    call_keywords = ("loss", "loss_reduction", "num_tokens", "grad_norm", "group_ids")
    output_keys = ("loss",)
    reports_positions = True

    def __init__(self, device_mesh: Any = None, process_group: Any = None, loss_reduction: str = "mean",
                 ignore_index: int = -100, **kwargs: Any) -> None:
        super().__init__(device_mesh, process_group, **kwargs)
        self.loss_reduction = _check_reduction(loss_reduction)
        self.ignore_index = ignore_index
        self.add_state("loss_sum", "sum", grouped=True)
        self.add_state("weight", "sum", grouped=True)  # tokens ('sum') or values ('mean') behind loss_sum
        self.add_state("nonfinite_losses", "sum")
        self.add_state("nonfinite_grad_norms", "sum")
        self.add_state("grad_norm", "max")

    def accumulate(self, inputs: Any, outputs: Any, **kwargs: Any) -> None:
        """Add the loss of each microbatch (one value per microbatch, a list of them, or per-token losses)."""
        grad_norm = call_value("grad_norm", kwargs, outputs)
        if grad_norm is not None:
            self._assign_finite("grad_norm", grad_norm, "nonfinite_grad_norms")
        loss = call_value("loss", kwargs, outputs)
        if loss is None:
            return
        reduction = _check_reduction(call_value("loss_reduction", kwargs, outputs, self.loss_reduction))
        given = with_call_values({"loss": loss}, kwargs, outputs, ("num_tokens", "group_ids"))
        token_losses = outputs.get("token_losses") if hasattr(outputs, "get") else None
        given.update({} if token_losses is None else {"token_losses": token_losses})
        per_token = []  # (inputs, outputs for the view, the microbatch's report that the losses stand beside)
        for batch, output in microbatches(inputs, given, ("loss", "num_tokens", "group_ids", "token_losses")):
            loss = output["loss"]
            if _one_value(loss) and not self._sliced(batch, output):
                # A microbatch's value with nothing to slice it by: counted when finite (held back until the states
                # are read, see Metric._add_finite).
                weight = 1.0 if reduction == "mean" else self._num_tokens(batch, output.get("num_tokens"))
                if isinstance(weight, torch.Tensor) and weight.numel() != 1:  # a count given per sample
                    weight = weight.sum()
                self._add_finite({"loss_sum": loss, "weight": weight}, "nonfinite_losses")
                continue
            loss = self._as_state("loss_sum", loss)
            ids = output.get("group_ids")
            if loss.numel() > 1:
                per_token.append((batch, {"loss": loss, "group_ids": ids}, None))
                continue
            ids = self.group_ids_of(batch, output)
            loss = loss.reshape(())
            weight = (self._as_state("weight", self._num_tokens(batch, output.get("num_tokens")))
                      if reduction == "sum" else torch.ones_like(loss))
            if output.get("token_losses") is not None:
                # The report is the total while it is finite; its per-token losses slice it (groups, buckets)
                # and stand in for it when it is not (_add_token_losses).
                token_losses = self._as_state("loss_sum", output["token_losses"])
                report = _Report(loss, weight.sum() if weight.shape != loss.shape else weight, reduction)
                per_token.append((batch, {"loss": token_losses, "group_ids": output.get("group_ids")}, report))
                continue
            finite = all_finite([loss])
            if ids is not None and torch.as_tensor(ids).dim() > 0:
                raise ValueError("a loss value for the whole microbatch needs one group id for the whole "
                                 "microbatch (or pass per-token losses with per-sample or per-token ids)")
            # Invalid ids are counted in tokens (as every metric counts them): a mean's tokens from its labels.
            grouped = self.group_names and ids is not None
            selected = count_tokens(batch) if grouped and reduction == "mean" and "labels" in batch else weight
            self._add_loss(loss, weight, finite, ~finite, self._token_groups(ids, finite, selected))
        if per_token:
            self._add_token_losses(per_token)

    def _sliced(self, batch: Any, output: Mapping[str, Any]) -> bool:
        """Whether a microbatch's loss goes to groups or position buckets too (per-token losses or group ids)."""
        return output.get("token_losses") is not None or self.group_ids_of(batch, output) is not None

    def _add_loss(self, loss: torch.Tensor, weight: torch.Tensor, counted: torch.Tensor, nonfinite: torch.Tensor,
                  groups: Optional[TokenSlices]) -> None:
        """Add a microbatch's counted losses and weights (a value or per token) and its non-finite count, in one
        op (see :meth:`Metric._add_token_sums`)."""
        if weight.shape != loss.shape:  # a count given as [1] (or more) next to a microbatch's 0-d loss
            weight = weight.sum()
        self._add_token_sums({"loss_sum": loss, "weight": weight}, counted, groups,
                             {"nonfinite_losses": nonfinite.sum(dtype=torch.float64)})

    def _add_token_losses(self, per_token: list[tuple[Any, dict, Optional[_Report]]]) -> None:
        """Per-token losses, matched under CP by the microbatches' views: Σ over the counted tokens and
        per slice, the selected non-finite tokens in ``nonfinite_losses``. Next to a microbatch's report, the
        slices come from the per-token losses and the total from the report while it is finite; a non-finite
        report gives way to the per-token totals (:func:`_report_or_tokens`): the healthy samples of the
        microbatch still count, its non-finite tokens are counted, never averaged in."""
        spec = ViewSpec("LossMetric", "loss", rows=False, positions=self.position_buckets is not None,
                        ignore_index=self.ignore_index, cp_gathered=self.cp_gathered,
                        group_key=self.group_key if self.group_names else None)
        views = microbatch_views_of([(batch, output) for batch, output, _ in per_token], spec, self.context)
        for view, (_, _, report) in zip(views, per_token):
            if not view.counts_here:
                continue
            loss = view.tensors["loss"]
            selected = to_device(view.selected, loss.device)
            counted = selected & all_finite([loss])
            groups = self._token_groups(view.group_ids, counted, selected, view.sequence_positions)
            if report is None:
                self._add_loss(loss, counted.to(torch.float64), counted, selected & ~counted, groups)
                continue
            # One stack, one reduction: [Σ finite loss, finite tokens, non-finite tokens] of the selected tokens.
            tokens = torch.stack([torch.where(counted, loss, 0.0), counted, selected & ~counted]).sum(
                tuple(range(1, loss.dim() + 1)), dtype=torch.float64)
            totals = dict(zip(("loss_sum", "weight", "nonfinite_losses"), _report_or_tokens(report, tokens)))
            if groups is not None:  # the per-group and per-position twins, from the per-token losses
                totals.update(sum_totals(self._specs, {"loss_sum": loss, "weight": counted}, counted, groups,
                                         slices_only=True))
            self._apply_totals(totals)

    def _num_tokens(self, batch: Any, num_tokens: Optional[Any]) -> Any:
        if num_tokens is not None:
            return num_tokens
        if "labels" not in batch:
            raise ValueError("loss_reduction='sum' without num_tokens (in outputs or as a keyword) needs "
                             "inputs['labels'] to count the tokens")
        return count_tokens(batch, self.ignore_index)

    @staticmethod
    def pooled_loss(states: SyncedStates) -> Optional[float]:
        """Σ loss_sum / Σ weight over the synced states, or None without counted tokens or values."""
        return states["loss_sum"] / states["weight"] if states["weight"] > 0 else None

    def compute(self, states: SyncedStates) -> dict[str, Number]:
        results: dict[str, Number] = {}
        loss = self.pooled_loss(states)
        if loss is not None:
            results["loss"] = loss
        elif states["nonfinite_losses"] > 0:  # every loss of the interval was non-finite: NaN, not absent
            results["loss"] = math.nan
        if states["grad_norm"] != float("-inf"):
            results["grad_norm"] = states["grad_norm"]
        results.update(states.counts(("nonfinite_losses", "nonfinite_grad_norms")))
        return results


class _Report(NamedTuple):
    """A microbatch's loss report (0-d float64 device values) that per-token losses stand beside."""

    loss: torch.Tensor  # Σ token losses ('sum') or their mean ('mean')
    weight: torch.Tensor  # its tokens ('sum'), 1 ('mean')
    reduction: str


def _report_or_tokens(report: _Report, tokens: torch.Tensor) -> torch.Tensor:
    """``[loss_sum, weight, nonfinite_losses]`` to add for a microbatch: its report while it is finite, else its
    per-token totals (``tokens``: Σ finite counted losses, their count, the counted non-finite tokens).

    A non-finite report adds the finite tokens' sum and count (``'sum'``), or their mean with weight 1 when any
    is finite (``'mean'``), and counts its non-finite tokens, at least 1 (a non-finite loss outside the counted
    tokens still made the report non-finite). Device selects only: no host sync.
    """
    token_sum, token_count, nonfinite = tokens.unbind(0)
    if report.reduction == "mean":
        token_sum, token_count = token_sum / token_count.clamp(min=1), (token_count > 0).to(torch.float64)
    finite = all_finite([report.loss])
    zero = torch.zeros((), dtype=torch.float64, device=tokens.device)
    return torch.where(finite, torch.stack([report.loss, report.weight.to(tokens.device), zero]),
                       torch.stack([token_sum, token_count, nonfinite.clamp(min=1)]))


def _one_value(loss: Any) -> bool:
    """A microbatch's loss as one value: a Python number or a one-element tensor (not per-token losses)."""
    return is_host_number(loss) or (isinstance(loss, torch.Tensor) and loss.numel() == 1)


def _check_reduction(loss_reduction: str) -> str:
    if loss_reduction not in _REDUCTIONS:
        raise ValueError(f"loss_reduction must be one of {_REDUCTIONS}, got {loss_reduction!r}")
    return loss_reduction
