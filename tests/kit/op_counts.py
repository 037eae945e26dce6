"""The device ops a block of code dispatches, counted at torch's dispatcher: on an accelerator each op that is not
a view is a kernel launch, and launches are what a small microbatch pays for (the budgets of
``tests/test_accumulate_ops.py``)."""

from __future__ import annotations

from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode

# Ops that only make views or aliases: no kernel on any device.
VIEWS = {"aten::view", "aten::slice", "aten::select", "aten::unsqueeze", "aten::squeeze", "aten::alias",
         "aten::detach", "aten::lift_fresh", "aten::t", "aten::transpose", "aten::permute", "aten::expand",
         "aten::as_strided", "aten::_reshape_alias", "aten::reshape", "aten::unflatten", "aten::split",
         "aten::unbind"}


class CountOps(TorchDispatchMode):
    """``with CountOps() as counted: ...``: ``counted.ops`` maps each dispatched op's name to its count,
    ``counted.launches`` is the number of ops that are not views."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func._schema.name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def launches(self) -> int:
        return sum(n for name, n in self.ops.items() if name not in VIEWS)
