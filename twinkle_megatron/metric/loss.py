"""LossMetric: the token-weighted training loss, pooled over microbatches and ranks."""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional

import torch

from .base import Metric, Number, SyncedStates
from .groups import TokenSlices
from .host_values import all_host_numbers, is_host_number
from .inputs import call_value, count_tokens, microbatches, with_call_values
from .microbatch_view import ViewSpec, microbatch_views_of
from .tensors import all_finite, host_float64, to_device

_REDUCTIONS = ("mean", "sum")
PENDING_REPORTS = 64  # microbatch loss reports (copies of device values) kept before they are folded into the states


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

    Per group (``group_names``): a microbatch's value with one group id goes to
    that group; per-sample or per-token ids need per-token losses, either as
    ``loss`` or, next to a microbatch's ``[sum, count]`` report, as
    ``outputs['token_losses']`` (what ``instrument()`` passes: GPTModel's
    per-token losses), which feed only the per-group ``loss/<group>`` so that
    ``loss`` stays the report's. Per position bucket (``position_buckets``,
    ``loss/pos_<first>-<last>``) likewise, from per-token losses only. In a
    packed microbatch (``cu_seqlens``) per-token losses of padding never count.

    A non-finite loss value (or token loss) is left out and counted in
    ``nonfinite_losses``; ``grad_norm`` is the latest finite value passed (max
    over ranks), a non-finite one is counted in ``nonfinite_grad_norms``.

    ``accumulate(inputs, outputs, *, loss_reduction=None, num_tokens=None, grad_norm=None)``:
    each keyword wins over ``outputs[...]`` of the same name, which wins over the
    constructor's default; any other keyword (Twinkle passes ``lr``, ``step``…)
    is ignored.

    Results: ``loss`` (when any token or value counted), ``grad_norm`` (when
    given), ``nonfinite_losses`` / ``nonfinite_grad_norms`` (when > 0); ``{}``
    when nothing was passed.

    >>> from twinkle_megatron import LossMetric
    >>> metric = LossMetric()
    >>> # Megatron-LM's reports of two microbatches: [sum, count] = [6, 3] and [2, 1]
    >>> metric.accumulate([{}, {}], {"loss": [6.0, 2.0], "num_tokens": [3, 1]}, loss_reduction="sum",
    ...                   grad_norm=0.5)
    >>> metric.calculate()
    {'loss': 2.0, 'grad_norm': 0.5}
    """

    token_statistics = ()  # reads no logits

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
        self._reports: list[tuple[torch.Tensor, Any]] = []  # pending microbatch reports (see _pend_report)

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
        sliced = self.group_names or self.position_buckets is not None
        token_losses = outputs.get("token_losses") if sliced and hasattr(outputs, "get") else None
        given.update({} if token_losses is None else {"token_losses": token_losses})
        per_token = []  # (inputs, outputs for the view, whether the losses only slice a microbatch's report)
        for batch, output in microbatches(inputs, given, ("loss", "num_tokens", "group_ids", "token_losses")):
            if self._add_host_loss(batch, output, reduction):
                continue
            loss = output["loss"]
            if isinstance(loss, torch.Tensor) and loss.numel() == 1 and self._pend_report(batch, output, reduction):
                continue
            loss = self._as_state("loss_sum", loss)
            ids = output.get("group_ids")
            if loss.numel() > 1:
                per_token.append((batch, {"loss": loss, "group_ids": ids}, False))
                continue
            ids = self.group_ids_of(batch, output)
            loss = loss.reshape(())
            valid = all_finite([loss])
            weight = (self._as_state("weight", self._num_tokens(batch, output.get("num_tokens")))
                      if reduction == "sum" else torch.ones_like(loss))
            if output.get("token_losses") is not None and (ids is not None or self.position_buckets):
                # The report is the total; the per-token losses next to it give the groups and buckets only.
                self._add_loss(loss, weight, valid, ~valid, None)
                token_losses = self._as_state("loss_sum", output["token_losses"])
                per_token.append((batch, {"loss": token_losses, "group_ids": output.get("group_ids")}, True))
                continue
            if ids is not None and torch.as_tensor(ids).dim() > 0:
                raise ValueError("a loss value for the whole microbatch needs one group id for the whole "
                                 "microbatch (or pass per-token losses with per-sample or per-token ids)")
            # Invalid ids are counted in tokens (as every metric counts them): a mean's tokens from its labels.
            grouped = self.group_names and ids is not None
            counted = count_tokens(batch) if grouped and reduction == "mean" and "labels" in batch else weight
            self._add_loss(loss, weight, valid, ~valid, self._token_groups(ids, valid, counted))
        if per_token:
            self._add_token_losses(per_token)

    def _add_host_loss(self, batch: Any, output: Mapping[str, Any], reduction: str) -> bool:
        """A microbatch's loss given as a Python number (Twinkle's Megatron model passes one) with its weight a
        number too ('mean', or a ``num_tokens`` number), and nothing to slice it by: added on the host (no launch
        per call; see :mod:`.host_values`). False when the loss takes the device path."""
        loss, weight = output["loss"], 1.0 if reduction == "mean" else output.get("num_tokens")
        if not is_host_number(loss) or not is_host_number(weight) or self._sliced(batch, output):
            return False
        if math.isfinite(loss):
            self._add("loss_sum", loss)
            self._add("weight", weight)
        else:
            self._add("nonfinite_losses", 1.0)
        return True

    def _sliced(self, batch: Any, output: Mapping[str, Any]) -> bool:
        """Whether a microbatch's loss goes to groups or position buckets too (per-token losses or group ids)."""
        return output.get("token_losses") is not None or self.group_ids_of(batch, output) is not None

    def _pend_report(self, batch: Any, output: Mapping[str, Any], reduction: str) -> bool:
        """A microbatch's loss given as one device value, with its weight (a count, or 1 for a mean), and nothing
        to slice it by: copied (float64; the caller may change its loss in place later) and kept until the
        states are read, then checked and added with the others in a fixed number of ops
        (:meth:`_fold_reports`). One op per microbatch (two with a device count), where checking and adding
        each report costs about ten. False when the loss takes the other paths."""
        if self._sliced(batch, output):
            return False
        loss = output["loss"].detach()
        weight = 1.0 if reduction == "mean" else self._num_tokens(batch, output.get("num_tokens"))
        if isinstance(weight, torch.Tensor):
            if weight.numel() != 1:
                return False
            weight = to_device(weight.detach(), loss.device).to(torch.float64, copy=True).reshape(())
        elif not is_host_number(weight):
            return False
        self._reports.append((loss.to(torch.float64, copy=True).reshape(()), weight))
        if len(self._reports) >= PENDING_REPORTS:  # bounded memory between syncs
            self._fold_reports()
        return True

    def _fold_reports(self) -> None:
        """Add the pending reports to the states: Σ loss and Σ weight over the finite losses, and the count of
        the others (the rule of :meth:`_add_loss`), in one stack, one mask and one reduction, on an accelerator
        if any report is on one (a loss given on the CPU next to device ones is copied there: no host wait)."""
        if not self._reports:
            return
        losses, weights = zip(*self._reports)
        device = next((loss.device for loss in losses if loss.device.type != "cpu"), losses[0].device)
        losses = torch.stack([to_device(loss, device) for loss in losses])
        if all_host_numbers(weights):
            weights = host_float64(weights, device)
        else:
            weights = torch.stack([to_device(w, device) if isinstance(w, torch.Tensor) else
                                   torch.full((), float(w), dtype=torch.float64, device=device) for w in weights])
        self._reports = []
        valid = all_finite([losses])
        self._add_loss(losses, weights, valid, ~valid, None)

    def sync_states(self) -> dict[str, torch.Tensor]:
        self._fold_reports()  # read like the pending host values: whoever reads the states gets them
        return super().sync_states()

    def reset(self) -> None:
        super().reset()
        self._reports = []

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._reports = []

    def _add_loss(self, loss: torch.Tensor, weight: torch.Tensor, valid: torch.Tensor, nonfinite: torch.Tensor,
                  groups: Optional[TokenSlices]) -> None:
        """Add a microbatch's valid losses and weights (a value or per token) and its non-finite count, in one
        op (see :meth:`Metric._add_token_sums`)."""
        if weight.shape != loss.shape:  # a count given as [1] (or more) next to a microbatch's 0-d loss
            weight = weight.sum()
        self._add_token_sums({"loss_sum": loss, "weight": weight}, valid, groups,
                             {"nonfinite_losses": nonfinite.sum(dtype=torch.float64)})

    def _add_token_losses(self, per_token: list[tuple[Any, dict, bool]]) -> None:
        """Per-token losses, matched under CP by the microbatches' views: Σ over the counted finite tokens, and
        per slice; next to a microbatch's report (``True``), per slice only (the report has the total)."""
        spec = ViewSpec("LossMetric", "loss", rows=False, positions=self.position_buckets is not None,
                        ignore_index=self.ignore_index, cp_gathered=self.cp_gathered,
                        group_key=self.group_key if self.group_names else None)
        views = microbatch_views_of([(batch, output) for batch, output, _ in per_token], spec, self.context)
        for view, (_, _, slices_only) in zip(views, per_token):
            if not view.counts_here:
                continue
            loss = view.tensors["loss"]
            mask = to_device(view.mask, loss.device)
            valid = mask & all_finite([loss])
            groups = self._token_groups(view.group_ids, valid, mask, view.sequence_positions)
            if slices_only:
                self._add_to_groups({"loss_sum": loss, "weight": valid}, valid, groups)
            else:
                self._add_loss(loss, valid.to(torch.float64), valid, mask & ~valid, groups)

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
        if states["grad_norm"] != float("-inf"):
            results["grad_norm"] = states["grad_norm"]
        results.update(states.counts(("nonfinite_losses", "nonfinite_grad_norms")))
        return results


def _check_reduction(loss_reduction: str) -> str:
    if loss_reduction not in _REDUCTIONS:
        raise ValueError(f"loss_reduction must be one of {_REDUCTIONS}, got {loss_reduction!r}")
    return loss_reduction
