"""LossMetric: the token-weighted training loss, pooled over microbatches and ranks."""

from __future__ import annotations

from typing import Any, Optional

import torch

from .base import Metric, Number, StateValues
from .inputs import check_same_shape, count_tokens, microbatches, to_device, token_mask

_REDUCTIONS = ("mean", "sum")


class LossMetric(Metric):
    """Loss and gradient norm, Twinkle's ``LossMetric`` with Megatron's pooling.

    ``loss_reduction='sum'`` (Megatron-LM's per-token loss): each microbatch
    passes the *sum* of its token losses and its token count ``num_tokens``
    (from outputs, the ``num_tokens`` keyword, or ``labels != ignore_index``):

        loss = Σ loss_sum / Σ num_tokens     (sum over microbatches and DP×CP ranks)

    ``loss_reduction='mean'``: each microbatch passes a mean; they are averaged
    with equal weight (no counts exist to weight them), so a loss already
    averaged over DP stays the same:

        loss = Σ loss_mean / number of values passed

    Only the last pipeline stage and TP rank 0 count (TP ranks repeat the loss).
    A non-finite loss value is left out of the mean and counted in
    ``nonfinite_losses``. ``grad_norm`` is the latest value passed, max over ranks.

    Results: ``loss``, ``grad_norm`` (when given), ``nonfinite_losses`` (when > 0).
    """

    def __init__(self, device_mesh: Any = None, process_group: Any = None, loss_reduction: str = "mean",
                 ignore_index: int = -100, **kwargs: Any) -> None:
        super().__init__(device_mesh, process_group, **kwargs)
        if loss_reduction not in _REDUCTIONS:
            raise ValueError(f"loss_reduction must be one of {_REDUCTIONS}, got {loss_reduction!r}")
        self.loss_reduction = loss_reduction
        self.ignore_index = ignore_index
        self.add_state("loss_sum", "sum")
        self.add_state("weight", "sum")  # tokens ('sum') or values ('mean') behind loss_sum
        self.add_state("values", "sum")  # loss values passed, finite or not
        self.add_state("nonfinite_losses", "sum")
        self.add_state("grad_norm", "max")

    def accumulate(self, inputs: Any, outputs: Any, num_tokens: Optional[Any] = None, **kwargs: Any) -> None:
        """Add the loss of each microbatch.

        ``outputs['loss']`` is one value per microbatch (a tensor, a number, or a
        list of them), or per-token losses shaped like ``labels``, which are
        pooled over the unmasked tokens whatever ``loss_reduction`` says.
        """
        if outputs is None or outputs.get("loss") is None:
            return
        for batch, output in microbatches(inputs, outputs, ("loss", "num_tokens")):
            loss = self._as_state("loss_sum", output["loss"])
            if loss.numel() == 1:
                loss = loss.reshape(())
                valid = torch.isfinite(loss)
                if self.loss_reduction == "sum":
                    weight = self._as_state("weight", self._num_tokens(batch, output.get("num_tokens", num_tokens)))
                else:
                    weight = torch.ones_like(loss)
                nonfinite = ~valid
            else:
                labels = batch.get("labels")
                if labels is None:
                    raise ValueError("per-token losses need inputs['labels'] to mask them")
                check_same_shape("loss", loss, "labels", labels)
                mask = to_device(token_mask(labels, batch.get("completion_mask"), self.ignore_index), loss.device)
                valid = mask & torch.isfinite(loss)
                weight = valid.to(torch.float64)
                nonfinite = (mask & ~valid).sum()
            self._add("loss_sum", torch.where(valid, loss, torch.zeros_like(loss)).sum())
            self._add("weight", torch.where(valid, weight, torch.zeros_like(weight)).sum())
            self._add("values", 1.0)
            self._add("nonfinite_losses", nonfinite.to(torch.float64))
        grad_norm = outputs.get("grad_norm")
        if grad_norm is not None:
            self._assign("grad_norm", grad_norm)

    def _num_tokens(self, batch: Any, num_tokens: Optional[Any]) -> Any:
        if num_tokens is not None:
            return num_tokens
        if "labels" not in batch:
            raise ValueError("loss_reduction='sum' without num_tokens (in outputs or as a keyword) needs "
                             "inputs['labels'] to count the tokens")
        return count_tokens(batch, self.ignore_index)

    def compute(self, states: StateValues) -> dict[str, Number]:
        if states["values"] == 0:
            return {}
        results: dict[str, Number] = {
            "loss": states["loss_sum"] / states["weight"] if states["weight"] > 0 else float("nan"),
        }
        if states["grad_norm"] != float("-inf"):
            results["grad_norm"] = states["grad_norm"]
        if states["nonfinite_losses"] > 0:
            results["nonfinite_losses"] = int(states["nonfinite_losses"])
        return results

