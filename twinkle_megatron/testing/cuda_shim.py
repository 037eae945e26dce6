"""CUDA-to-CPU shim that lets megatron-core's schedules and GPTModel run on CPU (tests and CPU demos only).

megatron-core (checked: 0.16.1) calls CUDA directly in its pipeline schedules, its
p2p communication and ``GPTModel.forward``. Inside ``with cpu_cuda_shim():`` those
calls land on the CPU, so the real Megatron code runs on gloo ranks in a test:

- any torch call given ``device=<a CUDA device>`` (tensor factories, ``.to(device=…)``)
  gets ``device="cpu"`` instead, and ``Tensor.cuda()`` returns the tensor itself (a
  ``TorchFunctionMode``: it rewrites device arguments only, nothing else);
- a handful of ``torch.cuda`` functions are replaced by CPU stand-ins (``_cuda_patches``,
  each with the megatron-core call that needs it).

Not patched, because megatron-core 0.16.1 does not reach them on this path:
``torch.cuda.is_available`` (stays False on a CPU build, which is what Megatron's
CPU fallbacks want), ``get_device_properties`` (inference layers only),
``manual_seed`` (a lazy no-op without CUDA; seed Megatron's RNG tracker with
``model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)``).

Everything is undone on exit, also when the body raises. This shim is support for
the tests, the CPU demo (``examples/train_gpt.py``) and the documentation's examples;
the library never imports it (``tests/test_layering.py``), and on GPUs it is not needed.

Enter it inside a rank's process (a forked worker of ``twinkle_megatron.testing.distributed``),
around model building and the schedule call::

    with cpu_cuda_shim():
        model = build_gpt_model(spec)
        losses = run_forward_backward(model, batch, micro_batch_size=2)
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["PATCHED_CUDA_FUNCTIONS", "cpu_cuda_shim", "is_cuda_device"]


def is_cuda_device(device: Any) -> bool:
    """True for what torch would read as a CUDA device: "cuda", "cuda:1", torch.device("cuda"), 0."""
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":", 1)[0] == "cuda"
    # A bare int device is a CUDA ordinal (Megatron passes torch.cuda.current_device()).
    return isinstance(device, int) and not isinstance(device, bool)


def _to_cpu(device: Any) -> Any:
    return "cpu" if is_cuda_device(device) else device


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments of every torch call to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            # tensor_parallel.broadcast_data (Megatron-LM's get_batch under TP): data[key].cuda().
            return args[0]
        if "device" in kwargs:
            # schedules: total_num_tokens = torch.zeros([], device="cuda");
            # transformer.utils.get_default_causal_mask: torch.ones(sq, sq, device="cuda").
            kwargs = {**kwargs, "device": _to_cpu(kwargs["device"])}
        return func(*args, **kwargs)


class _NullStream:
    """A CUDA stream that does nothing; also its own context manager (``with torch.cuda.stream(s)``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> None:
        return None

    def __enter__(self) -> _NullStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


_NULL_STREAM = _NullStream()


def _cuda_patches() -> dict[str, Any]:
    """Replacement for each ``torch.cuda`` attribute, with the megatron-core call that needs it."""
    return {
        # p2p_communication._communicate (receive buffers) and DotProductAttention.forward (global memory
        # buffer): torch.empty(..., device=torch.cuda.current_device()); "cpu" is a valid device.
        "current_device": lambda: "cpu",
        # p2p_communication._communicate: torch.cuda.synchronize() after batch_isend_irecv (batch_p2p_comm).
        "synchronize": lambda device=None: None,
        # distributed DDP of megatron-core 0.19: torch.cuda.current_stream() (not reached by 0.16.1's DDP).
        "current_stream": lambda device=None: _NULL_STREAM,
        # DistributedDataParallel with num_distributed_optimizer_instances > 1: torch.cuda.Stream(device=...).
        "Stream": _NullStream,
        # param_and_grad_buffer.start_grad_sync (same setting): with torch.cuda.stream(communication_stream).
        "stream": lambda stream=None: contextlib.nullcontext(stream),
    }


PATCHED_CUDA_FUNCTIONS = tuple(_cuda_patches())


@contextlib.contextmanager
def cpu_cuda_shim() -> Iterator[None]:
    """Run megatron-core's CUDA calls on the CPU inside the block; restore torch on exit."""
    originals = {name: getattr(torch.cuda, name) for name in _cuda_patches()}
    mode = _CudaToCpuMode()
    try:
        for name, replacement in _cuda_patches().items():
            setattr(torch.cuda, name, replacement)
        with mode:
            yield
    finally:
        for name, original in originals.items():
            setattr(torch.cuda, name, original)
