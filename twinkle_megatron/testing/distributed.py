"""Multi-rank harness: run a function on N CPU ranks with gloo (:func:`run_distributed`).

Workers are forked from the calling process (megatron-core, when a layout needs
it, is imported once, in the parent), so eight ranks start in about a second. Each worker optionally
initialises megatron-core's ``parallel_state`` for a TP×PP×CP×DP layout (gloo connects
each group when it is first used: ``TORCH_GLOO_LAZY_INIT``, unless set), runs
the function, and sends back its return value or its traceback. A worker that
raises fails the test with that traceback; ranks that do not finish within the
timeout are killed and the test fails, so a hang never blocks CI.
"""

from __future__ import annotations

import inspect
import multiprocessing as mp
import os
import pickle
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ..parallel import Layout

__all__ = ["Layout", "WorkerError", "run_distributed"]  # Layout: callers name their layouts from here too


class WorkerError(AssertionError):
    """A worker raised; the message carries the worker's traceback."""


def _worker(rank: int, world_size: int, store_path: str, layout: Optional[Layout], timeout_s: float,
            fn: Callable[..., Any], args: tuple, kwargs: dict, conn) -> None:
    status, payload = "ok", None
    try:
        torch.set_num_threads(1)
        # Gloo connects a group's members when the group is first used, not when it is created: megatron-core
        # creates every group of a layout (65 on 8 ranks for TP2 x PP2), a test uses a few, and connecting all of
        # them took most of a rank's start.
        os.environ.setdefault("TORCH_GLOO_LAZY_INIT", "1")
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        if layout is not None:
            from megatron.core import parallel_state

            options = {}
            if "create_gloo_process_groups" in inspect.signature(parallel_state.initialize_model_parallel).parameters:
                options["create_gloo_process_groups"] = False  # the default backend is gloo already
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=layout.tp,
                pipeline_model_parallel_size=layout.pp,
                virtual_pipeline_model_parallel_size=layout.vpp,
                context_parallel_size=layout.cp,
                **options,
            )
        payload = fn(*args, **kwargs)
        # A rank that exits early breaks the gloo mesh of ranks still working.
        dist.barrier()
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        status, payload = "error", traceback.format_exc()
    # Plain pickle, not multiprocessing's: that one passes tensors as shared file
    # descriptors, which die with this process before the parent reads them.
    try:
        message = pickle.dumps((status, payload))
    except Exception:  # noqa: BLE001 - an unpicklable result is a test error too
        message = pickle.dumps(("error", traceback.format_exc()))
    conn.send_bytes(message)
    conn.close()
    # Skip atexit handlers and pytest's teardown inherited through fork.
    os._exit(0)


def run_distributed(fn: Callable[..., Any], world_size: Optional[int] = None, *, layout: Optional[Layout] = None,
                    args: tuple = (), kwargs: Optional[dict] = None, timeout: float = 60.0) -> list:
    """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results in rank order.

    ``layout`` initialises megatron-core's parallel_state (its world size wins);
    without it only ``torch.distributed`` is initialised over ``world_size`` ranks.
    """
    if layout is not None:
        world_size = layout.world_size
        # Import megatron once here, not once per forked worker (seconds each).
        import megatron.core.parallel_state  # noqa: F401
    if world_size is None:
        raise ValueError("give world_size or layout")
    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        pipes, procs = [], []
        for rank in range(world_size):
            parent_conn, child_conn = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_worker, daemon=True,
                               args=(rank, world_size, store_path, layout, timeout, fn, args, kwargs or {},
                                     child_conn))
            proc.start()
            child_conn.close()
            pipes.append(parent_conn)
            procs.append(proc)
        results: list = [None] * world_size
        errors: dict[int, str] = {}
        pending = dict(enumerate(pipes))
        deadline = time.monotonic() + timeout
        while pending and time.monotonic() < deadline and not errors:
            ready = mp.connection.wait(list(pending.values()), timeout=max(0.0, deadline - time.monotonic()))
            for rank, conn in list(pending.items()):
                if conn not in ready:
                    continue
                try:
                    status, payload = pickle.loads(conn.recv_bytes())
                except EOFError:
                    status, payload = "error", f"rank {rank} died without a result (exit code " \
                                               f"{procs[rank].exitcode})"
                del pending[rank]
                if status == "ok":
                    results[rank] = payload
                else:
                    errors[rank] = payload
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=5)
    name = f"{getattr(fn, '__name__', fn)}" + (f" [{layout}]" if layout else f" [world {world_size}]")
    if errors:
        rank = min(errors)
        raise WorkerError(f"{name}: rank {rank} raised:\n{errors[rank]}")
    if pending:
        raise WorkerError(f"{name}: ranks {sorted(pending)} did not finish within {timeout:.0f} s (hang?)")
    return results
