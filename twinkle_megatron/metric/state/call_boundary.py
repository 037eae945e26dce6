"""What every call into a metric goes through before the metric's own code runs.

A metric takes a call in one of two forms, and :class:`~.base.Metric` wraps each subclass's method (in
``__init_subclass__``) with the checks below:

* ``accumulate_call(call)`` (:func:`checked_call`): a :class:`..inputs.shared_call.SharedCall`, whose views
  and token statistics the metrics of one call share (a collection hands its call to each metric;
  ``Metric.accumulate`` makes one for a metric used alone);
* Twinkle's ``accumulate(inputs, outputs, **kwargs)`` (:func:`checked_accumulate`), for metrics that share
  nothing with the others (and user metrics): NumPy arrays turned into tensors first.

The checks: the ``group_names`` option against the declared states, the keywords and outputs
(:mod:`..inputs.keywords`), and autograd off, so a metric never extends, nor keeps alive, the graph of the tensors it
reads.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, Optional

import torch

from ..inputs.keywords import check_call
from ..inputs.microbatches import arrays_as_tensors
from ..inputs.shared_call import SharedCall
from .groups import GROUPED_SUFFIX

_CHECKED = "__at_the_call_boundary__"


def checked_call(accumulate_call: Callable) -> Callable:
    """``accumulate_call(call)`` behind the checks above (a method already wrapped is returned as it is)."""
    if getattr(accumulate_call, _CHECKED, False):
        return accumulate_call

    @functools.wraps(accumulate_call)
    def checked(self: Any, call: SharedCall) -> Any:
        return _run_checked(self, call.outputs, call.kwargs, lambda: accumulate_call(self, call))

    setattr(checked, _CHECKED, True)
    return checked


def checked_accumulate(accumulate: Callable) -> Callable:
    """Twinkle's ``accumulate(inputs, outputs, **kwargs)`` behind the checks above, NumPy arrays as tensors."""
    if getattr(accumulate, _CHECKED, False):
        return accumulate

    @functools.wraps(accumulate)
    def checked(self: Any, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = arrays_as_tensors(args), arrays_as_tensors(kwargs, depth=3)
        outputs = args[1] if len(args) > 1 else kwargs.get("outputs")
        return _run_checked(self, outputs, kwargs, lambda: accumulate(self, *args, **kwargs))

    setattr(checked, _CHECKED, True)
    return checked


def _run_checked(metric: Any, outputs: Any, kwargs: Mapping[str, Any], run: Callable[[], Any]) -> Optional[Any]:
    if metric.group_names and not any(name.endswith(GROUPED_SUFFIX) for name in metric.state_specs):
        # Known only once the subclass declared its states: at the first call, before any state changes.
        raise ValueError(f"{type(metric).__name__} has no per-group statistics; group_names={metric.group_names} "
                         "would report nothing per group (use it on the token-level metrics)")
    check_call(metric, outputs, kwargs)
    if not torch.is_grad_enabled():  # a collection's call: no_grad already
        return run()
    with torch.no_grad():
        return run()
