"""What every ``accumulate`` call goes through before a metric's own code runs.

:class:`~.base.Metric` wraps each subclass's ``accumulate`` (in ``__init_subclass__``) with
:func:`at_the_call_boundary`: the ``group_names`` option checked against the declared states, NumPy arrays
turned into tensors (once per call: a collection's call crossed the boundary already), the keywords and
outputs checked (:mod:`..inputs.keywords`), and autograd off, so a metric never extends, nor keeps alive, the graph
of the tensors it reads.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from ..inputs.call_cache import call_values
from ..inputs.keywords import check_call
from ..inputs.microbatches import arrays_as_tensors
from .groups import GROUPED_SUFFIX


def at_the_call_boundary(accumulate: Callable) -> Callable:
    """``accumulate`` behind the checks above (a method already wrapped is returned as it is)."""
    if getattr(accumulate, "__at_the_call_boundary__", False):
        return accumulate

    @functools.wraps(accumulate)
    def checked_accumulate(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self.group_names and not any(name.endswith(GROUPED_SUFFIX) for name in self.state_specs):
            # Known only once the subclass declared its states: at the first call, before any state changes.
            raise ValueError(f"{type(self).__name__} has no per-group statistics; group_names={self.group_names} "
                             "would report nothing per group (use it on the token-level metrics)")
        if call_values() is None:  # numpy at the boundary (a collection's call crossed it already)
            args, kwargs = arrays_as_tensors(args), arrays_as_tensors(kwargs, depth=3)
        check_call(self, args[1] if len(args) > 1 else kwargs.get("outputs"), kwargs)
        if not torch.is_grad_enabled():  # a collection's call: no_grad already
            return accumulate(self, *args, **kwargs)
        with torch.no_grad():
            return accumulate(self, *args, **kwargs)

    checked_accumulate.__at_the_call_boundary__ = True
    return checked_accumulate
