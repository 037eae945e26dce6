"""Per-layer gradient and parameter norms, reduced in the tracker's one sync.

:class:`LayerNorms` is a metric whose states are, per part of the model (one
slot per transformer layer, then embedding, output layer, final norm, other;
see :mod:`twinkle_megatron.tracker.layer_parameters`), the sum of squares of the
gradient elements and of the parameter elements this rank counts. Every element
is counted on exactly one rank, so a SUM over all ranks gives each part's
squared norm, and the parts' squares add up to the square of the global
gradient norm Megatron's optimizer computes.

``record()`` (after the gradient reduction, before ``optimizer.step()``) only
launches device work: one norm per counted tensor, an ``index_add`` into the
slot vectors; the vectors then travel in the tracker's SUM all-reduce (no
collective of their own). The latest recorded step of a log interval is
reported:

* ``grad_norm/layer_07``, ``param_norm/layer_07``: ‖g‖₂, ‖θ‖₂ of global layer 7
  (0-based: the single-process model's ``decoder.layers.7``; the width is two
  digits, more for models of over 100 layers);
* ``grad_norm/embedding``, ``grad_norm/output_layer``, ``grad_norm/final_norm``
  (and ``param_norm/...``); ``grad_norm/other`` only when the model has other
  parameters (multi-token prediction...);
* ``grad_norm/total``: √(Σ of every part's square), Megatron's gradient norm;
* the compact view: ``grad_norm/max_layer_norm`` (the largest layer norm; a
  non-finite one wins), ``grad_norm/max_layer`` (its layer, the lowest on
  ties), ``grad_norm/max_layer_over_median`` (it over the median layer norm).

fp16 loss scaling: the squares are divided by the optimizer's loss scale squared.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Optional

import torch

from .. import keys
from ..metric import Metric, Number, SyncedStates
from .layer_parameters import LayerParameters, loss_scale


class LayerNorms(Metric):
    """Per-layer gradient and parameter norms of the latest recorded step (see the module docstring).

    States (``sum``, one slot per part): ``grad_squares``, ``param_squares``;
    ``recorded`` (``max``): 1 when a step was recorded in the interval.
    """

    every_rank_counts = True  # every rank holds different parameters (or different shards of them)

    def __init__(self, parameters: LayerParameters, optimizer: Any = None, device_mesh: Any = None,
                 process_group: Any = None) -> None:
        super().__init__(device_mesh, process_group)
        self.parameters = parameters
        self.optimizer = optimizer
        slots = len(parameters.slot_names)
        self.add_state("grad_squares", "sum", shape=(slots,))
        self.add_state("param_squares", "sum", shape=(slots,))
        self.add_state("recorded", "max")

    def accumulate(self, inputs: Any, outputs: Any, **kwargs: Any) -> None:
        """Not fed by batches: :meth:`record` reads the model."""

    @torch.no_grad()
    def record(self) -> None:
        """This rank's squares of the current gradients and parameters (device work only: no host sync)."""
        grads = self.parameters.gradients()
        values = self.parameters.values()
        self._assign("grad_squares", self._squares(grads, scale=loss_scale(self.optimizer)))
        self._assign("param_squares", self._squares(values))
        self._assign("recorded", 1.0)

    def _squares(self, tensors: list[Optional[torch.Tensor]], scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Σ x² per slot, in float64 (each tensor's norm in fp32, as Megatron's ``get_grad_norm_fp32``)."""
        present = [(i, t) for i, t in enumerate(tensors) if t is not None and t.numel()]
        device = present[0][1].device if present else torch.device("cpu")
        slots = torch.zeros(len(self.parameters.slot_names), dtype=torch.float64, device=device)
        if not present:
            return slots
        norms = torch.stack([torch.linalg.vector_norm(t, dtype=torch.float32) for _, t in present])
        squares = norms.to(torch.float64).square()
        if scale is not None:
            squares = squares / scale.to(device=device, dtype=torch.float64).square()
        index = self.parameters.slots(device)
        if len(present) != len(tensors):
            index = index[torch.tensor([i for i, _ in present], dtype=torch.long, device=device)]
        return slots.index_add_(0, index, squares)

    def compute(self, states: SyncedStates) -> dict[str, Number]:
        if not states["recorded"] > 0:
            return {}
        results: dict[str, Number] = {}
        grads = [math.sqrt(v) if v >= 0 else math.nan for v in states["grad_squares"].tolist()]
        params = [math.sqrt(v) if v >= 0 else math.nan for v in states["param_squares"].tolist()]
        names = self.parameters.slot_names
        layers = self.parameters.num_layers
        for index, name in enumerate(names):
            if name == "other" and grads[index] == 0.0 and params[index] == 0.0:
                continue  # the model has no other parameters
            results[keys.layer_grad_norm_key(name)] = grads[index]
            results[keys.layer_param_norm_key(name)] = params[index]
        results[keys.GRAD_NORM_TOTAL] = math.sqrt(float(states["grad_squares"].sum()))
        if layers:
            results.update(compact_view(grads[:layers]))
        return results


def compact_view(layer_norms: list[float]) -> dict[str, Number]:
    """The largest layer norm (a non-finite one first), its layer (lowest on ties), its ratio to the median."""
    nonfinite = [i for i, v in enumerate(layer_norms) if not math.isfinite(v)]
    largest = nonfinite[0] if nonfinite else max(range(len(layer_norms)), key=lambda i: (layer_norms[i], -i))
    finite = [v for v in layer_norms if math.isfinite(v)]
    median = statistics.median(finite) if finite else math.nan
    value = layer_norms[largest]
    ratio = value / median if median > 0 else (math.inf if value > 0 else math.nan)
    return {keys.GRAD_NORM_LAYER_MAX: value, keys.GRAD_NORM_LAYER_MAX_INDEX: largest,
            keys.GRAD_NORM_LAYER_MAX_OVER_MEDIAN: ratio}
