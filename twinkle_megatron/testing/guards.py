"""The structural guard: counts c10d collectives and forbids (or counts) host syncs, at the dispatcher.

Everything a tensor does reaches the dispatcher, whichever Python spelling
called it. Collectives are counted by a kernel of this module's, registered
for the autograd keys of every ``c10d`` op while a count is open: it sees
every collective (``dist.all_reduce``, ``all_gather_object``'s internal
gathers, megatron's p2p) and costs the other ops nothing, so a whole training
loop can be counted. Host syncs are caught by a ``TorchDispatchMode``, which
sees every op that makes the host wait for the device on a GPU:

* reading a value: ``.item()``, ``bool(t)``, ``int(t)``, ``float(t)``
  (``aten::_local_scalar_dense``, ``aten::is_nonzero``, ``aten::equal``);
* ops whose output *size* depends on values: boolean-mask indexing and
  assignment (``t[mask]``, ``t[mask] = x``), ``nonzero`` / ``torch.where(cond)``,
  ``masked_select``, ``unique``, ``bincount`` (it sizes its output by the
  largest value, ``minlength`` or not), ``repeat_interleave`` without
  ``output_size``.

Copies to the host (``.tolist()``, ``.numpy()``, ``.cpu()``, ``.to('cpu')``)
and printing (which reads values with the modes switched off) do not reach
the dispatcher on a CPU-only machine (the tensor already is on the CPU), so a
``TorchFunctionMode`` flags those calls by name: on a GPU each one would be a
sync. (``.to(some_tensor.device)`` is not flagged: it moves data to where
other data lives, which on a GPU is no host copy.)

Public: ``with forbid_host_sync() as guard:`` (raises :class:`HostSyncError` at
the first sync; ``guard.collectives`` counts), ``with count_collectives() as
counts:`` (the count alone: no mode, so the ops in between run at full speed),
and :func:`host_sync_free` to guard a method in place. Counts nest: every open
count sees each collective, from whichever thread issued it. A collective issued
under ``torch.inference_mode()`` is not counted: inference mode skips the
autograd keys (megatron-core's training and evaluation loops use ``no_grad``,
which does not).
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from typing import Any, Callable, Iterator, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode


class HostSyncError(AssertionError):
    """Code inside a :func:`forbid_host_sync` block made (or, on a GPU, would make) the host wait."""


_VALUE_READS = {"aten::_local_scalar_dense", "aten::is_nonzero", "aten::equal"}
_VALUE_SIZED = {"aten::nonzero", "aten::nonzero_numpy", "aten::argwhere", "aten::masked_select", "aten::bincount",
                "aten::_unique", "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive",
                "aten::unique_dim_consecutive"}
_MASK_INDEXED = {"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"}
# The dispatcher's names of the collectives, under the names of the torch.distributed calls.
_COLLECTIVE_NAMES = {"allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce_coalesced",
                     "allgather_": "all_gather", "_allgather_base_": "all_gather_into_tensor",
                     "allgather_coalesced_": "all_gather_coalesced",
                     "allgather_into_tensor_coalesced_": "all_gather_into_tensor_coalesced",
                     "reduce_scatter_": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter_tensor",
                     "reduce_scatter_tensor_coalesced_": "reduce_scatter_tensor_coalesced",
                     "broadcast_": "broadcast", "reduce_": "reduce", "gather_": "gather", "scatter_": "scatter",
                     "alltoall_": "all_to_all", "alltoall_base_": "all_to_all_single", "barrier": "barrier",
                     "monitored_barrier_": "monitored_barrier", "send": "send", "recv_": "recv",
                     "recv_any_source_": "recv"}
# Printing reads values with the modes switched off, so it is caught by name too.
_HOST_COPIES = {torch.Tensor.tolist: "tolist", torch.Tensor.numpy: "numpy", torch.Tensor.cpu: "cpu",
                torch.Tensor.__repr__: "__repr__", torch.Tensor.__format__: "__format__"}


def _is_cpu(device: Any) -> bool:
    # Only the literal 'cpu': on a CPU-only machine ``.to(x.device)`` (to where the data already is) names the
    # CPU too, but on a GPU it is a device-to-device no-op, not a copy to the host.
    return isinstance(device, str) and device.split(":")[0] == "cpu"


def _has_mask_index(args: tuple) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


class _Dispatch(TorchDispatchMode):
    def __init__(self, guard: Guard) -> None:
        super().__init__()
        self.guard = guard

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name, _, overload = func.name().partition(".")  # "aten::repeat_interleave.Tensor": the op, its overload
        if name in _VALUE_READS or name in _VALUE_SIZED:
            self.guard.host_sync(name)
        elif name in _MASK_INDEXED and _has_mask_index(args):
            self.guard.host_sync(f"{name} with a boolean mask")
        elif name == "aten::repeat_interleave" and kwargs.get("output_size") is None and overload != "self_int":
            self.guard.host_sync(f"{name} without output_size")
        return func(*args, **kwargs)


class _Functions(TorchFunctionMode):
    def __init__(self, guard: Guard) -> None:
        super().__init__()
        self.guard = guard

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _HOST_COPIES:
            self.guard.host_sync(f"Tensor.{_HOST_COPIES[func]}()")
        elif func is torch.Tensor.to and (any(_is_cpu(a) for a in args[1:]) or _is_cpu(kwargs.get("device"))):
            self.guard.host_sync("Tensor.to('cpu')")
        return func(*args, **kwargs)


class Guard:
    """What a guarded block did: ``collectives`` (a Counter by torch.distributed name) and ``host_syncs``."""

    def __init__(self, forbid: bool) -> None:
        self.forbid = forbid
        self.collectives: Counter = Counter()
        self.host_syncs: list[str] = []

    def host_sync(self, what: str) -> None:
        self.host_syncs.append(what)
        if self.forbid:
            raise HostSyncError(f"host sync: {what}")

    @contextlib.contextmanager
    def active(self) -> Iterator[Guard]:
        with _counting(self.collectives), _Functions(self), _Dispatch(self):
            yield self


# The open counts, and the library that holds the counting kernels while any is open.
_open_counts: list[Counter] = []
_counting_library: Optional[torch.library.Library] = None


def _counting_kernel(op: Any, name: str) -> Callable:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        for counts in _open_counts:
            counts[name] += 1
        # Then the op itself: its kernels below autograd (a dispatch mode, the backend's).
        with torch._C._AutoDispatchBelowAutograd():
            return op(*args, **kwargs)
    return kernel


@contextlib.contextmanager
def _counting(counts: Counter) -> Iterator[Counter]:
    """Count into ``counts`` the collectives issued inside the block."""
    global _counting_library
    if not _open_counts:
        # c10d's ops have no autograd kernels of their own (autograd's fallback passes them on): ours go there.
        _counting_library = torch.library.Library("c10d", "IMPL")
        for op, name in _COLLECTIVE_NAMES.items():
            if hasattr(torch.ops.c10d, op):  # this torch's ops
                _counting_library.impl(op, _counting_kernel(getattr(torch.ops.c10d, op), name), "Autograd")
    _open_counts.append(counts)
    try:
        yield counts
    finally:
        _open_counts[:] = [open_count for open_count in _open_counts if open_count is not counts]  # by identity
        if not _open_counts:
            _counting_library._destroy()
            _counting_library = None


@contextlib.contextmanager
def forbid_host_sync() -> Iterator[Guard]:
    """Raise :class:`HostSyncError` at the first host sync inside the block; count its collectives too."""
    with Guard(forbid=True).active() as guard:
        yield guard


def host_sync_free(function: Callable) -> Callable:
    """``function`` with :func:`forbid_host_sync` around every call (for patching a hook method in place)."""
    @functools.wraps(function)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        with forbid_host_sync():
            return function(*args, **kwargs)
    return guarded


@contextlib.contextmanager
def count_collectives() -> Iterator[Counter]:
    """Count the collectives issued inside the block (host syncs allowed)."""
    with _counting(Counter()) as counts:
        yield counts
