"""One ``accumulate`` call as its metrics share it: the inputs, and what is computed from them once.

A :class:`SharedCall` is made per call: by :class:`~twinkle_megatron.metric.MetricCollection` (one for all its
metrics), by ``instrument()`` (one per microbatch, holding the token statistics and classes its hooks made), or
by a metric used alone (``Metric.accumulate`` makes its own). The metrics read it in ``accumulate_call(call)``:

* :meth:`SharedCall.views`: the normalised views of the call for a :class:`~.view.ViewSpec` -- built once per
  spec (less the metric's name) and CP rank, whatever the number of metrics declaring it;
* :meth:`SharedCall.shared`: any other value the metrics share (each microbatch's token statistics and classes,
  the per-sequence values on the device, GRPO's per-token terms), computed at its first request and kept under a
  key made of *values*: what the value is made from (a view's :attr:`~.view.MicrobatchView.key`, names, shapes,
  options), never an object's identity.

The call ends when the object is dropped: nothing outlives it, so no key can name another call's data.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

from ...parallel import ParallelContext
from .microbatches import arrays_as_tensors
from .view import MicrobatchView, ViewSpec, microbatch_views


class SharedCall:
    """One ``accumulate(inputs, outputs, **kwargs)`` call (NumPy arrays as tensors) and its shared values.

    ``statistics``: the per-token statistics of the logits the call's metrics read together (see
    :mod:`~twinkle_megatron.metric.tokens.logits_pass`); None: all of them.
    """

    def __init__(self, inputs: Any, outputs: Any = None, kwargs: Optional[Mapping[str, Any]] = None,
                 statistics: Optional[frozenset] = None) -> None:
        self.inputs = arrays_as_tensors(inputs)
        self.outputs = arrays_as_tensors(outputs)
        self.kwargs: dict[str, Any] = arrays_as_tensors(dict(kwargs or {}), 3)
        self.statistics = statistics
        self._views: dict[tuple, list] = {}
        self._values: dict[tuple, Any] = {}

    def views(self, spec: ViewSpec, context: ParallelContext) -> list[MicrobatchView]:
        """The call's views for ``spec`` (see :func:`.view.microbatch_views`), built once per spec and CP rank:
        metrics declaring the same spec (GRPO, GSPO, CISPO, PPO's policy side; Accuracy and TokenStatsMetric)
        read the same list. A view depends on the context through its CP rank only."""
        key = (spec[1:], context.cp_size, context.cp_rank)  # any metric's name: the spec's other fields decide
        views = self._views.get(key)
        if views is None:
            views = self._views[key] = microbatch_views(self.inputs, self.outputs, self.kwargs, spec, context,
                                                        share=self.shared, key=key)
        return views

    def shared(self, key: tuple, compute: Callable[[], Any]) -> Any:
        """``compute()`` at the first request for ``key`` in this call, the same object for every later one.
        ``key``: values naming what the result is made from (its kind first)."""
        if key not in self._values:
            self._values[key] = compute()
        return self._values[key]

    def get(self, key: tuple) -> Any:
        """What the call holds under ``key`` (None when nothing yet)."""
        return self._values.get(key)

    def give(self, key: tuple, value: Any) -> None:
        """Hold ``value`` under ``key`` as if computed here (``instrument()``: what its hooks computed already)."""
        self._values[key] = value
