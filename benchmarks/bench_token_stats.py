"""Benchmark: vocab-parallel argmax + label log-prob + entropy under TP, three ways.

Run: ``python benchmarks/bench_token_stats.py [--tokens 4096] [--vocab 16384] [--tp 2]
[--repeats 5] [--dtype fp32,bf16]``. It forks ``--tp`` CPU ranks on gloo (one
thread each), initialises megatron-core's ``parallel_state`` with that TP size,
and times on every rank's ``[tokens, vocab]`` shard (``vocab`` = local columns):

(a) ours: ``twinkle_megatron.ops.vocab_parallel_token_stats`` (one chunked pass,
    two all-reduces);
(b) the anchors' way: a clone of the shard (fp32) into megatron-core's
    ``vocab_parallel_cross_entropy`` for the log-probs, a separate verl-style
    entropy with three all-reduces (MAX of the local max, SUM of sum-exp, SUM of
    sum x·e^x) and an argmax by two all-gathers (local max values and indices;
    ties go to the lowest rank), as Megatron's multi-token prediction does;
(c) all-gather the vocabulary, ``torch.cat`` and plain torch in fp32
    (``argmax``, ``log_softmax`` + ``gather``, ``-(p * log p).sum(-1)``).

Reported per method: the median (and minimum) wall time per call over
``--repeats`` calls after one warm-up (each call starts after a barrier; a call's
time is the slowest rank's; the methods take turns, a, b, c, a, b, c, ..., so
that load from elsewhere on the machine hits all of them alike), the median
time relative to (a), the collectives per call, and the peak extra memory as a
fraction of the shard's bytes.

How the last two are measured (in one extra, untimed call per method, under
``TorchDispatchMode``s, so nothing is counted by hand):

* collectives: every ``c10d`` dispatcher op (``allreduce_``, ``allgather_``...)
  is counted, however it was called.
* memory: every dispatched op's output tensors are inspected; a storage that is
  not one of the op's inputs and not already tracked is a new allocation. Its
  bytes are added to a live total and a ``weakref.finalize`` on the storage
  object subtracts them when the storage is freed (torch keeps one Python object
  per live storage, so the finalizer fires exactly at deallocation). The peak of
  the live total during the call, minus nothing (tracking starts inside the
  call), is the extra memory: views cost nothing, ``out=``/in-place ops cost
  nothing, temporaries count while they live. This sees CPU tensor allocations
  made through ATen, which is all that these methods allocate.

The agreement of (a) and (b) with (c) (max absolute difference of log-probs and
entropy, argmax equality) is checked on the same inputs and printed.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
import traceback
import weakref
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from twinkle_megatron.ops import vocab_parallel_token_stats  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# ----------------------------------------------------------------------------- measurement


class CountCollectives(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d" and "wait" not in func.name():
            self.ops.append(func.name().split("::")[-1])
        return func(*args, **(kwargs or {}))


class PeakMemory(TorchDispatchMode):
    """Peak bytes of live storages allocated by ops dispatched while the mode is on."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._tracked: dict[int, int] = {}

    def _free(self, key: int, nbytes: int) -> None:
        if self._tracked.pop(key, None) is not None:
            self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or key in inputs or key in self._tracked:
                continue
            self._tracked[key] = nbytes
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key, nbytes)
        return out


# ----------------------------------------------------------------------------- the three methods


def ours(logits: torch.Tensor, labels: torch.Tensor, group) -> tuple:
    st = vocab_parallel_token_stats(logits, labels, group=group)
    return st.argmax, st.logprobs, st.entropy


def anchors(logits: torch.Tensor, labels: torch.Tensor, group) -> tuple:
    from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

    with torch.no_grad():
        tp, v_local = dist.get_world_size(group), logits.shape[-1]
        # Megatron overwrites an fp32 input in place: give it a copy.
        work = logits.clone() if logits.dtype == torch.float32 else logits.float()
        logprobs = -vocab_parallel_cross_entropy(work, labels)
        del work
        # verl-style entropy: 3 all-reduces.
        x = logits.float()
        m = x.amax(dim=-1)
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        e = torch.exp(x - m.unsqueeze(-1))
        sum_exp = e.sum(-1)
        dist.all_reduce(sum_exp, op=dist.ReduceOp.SUM, group=group)
        sum_x_exp = (e * x).sum(-1)
        dist.all_reduce(sum_x_exp, op=dist.ReduceOp.SUM, group=group)
        del e, x
        entropy = m + torch.log(sum_exp) - sum_x_exp / sum_exp
        # argmax by two all-gathers; ties go to the lowest rank.
        values, index = logits.float().max(dim=-1)
        all_values = [torch.empty_like(values) for _ in range(tp)]
        all_index = [torch.empty_like(index) for _ in range(tp)]
        dist.all_gather(all_values, values, group=group)
        dist.all_gather(all_index, index, group=group)
        best = torch.stack(all_values).argmax(dim=0)
        argmax = torch.stack(all_index).gather(0, best.unsqueeze(0)).squeeze(0) + best * v_local
    return argmax, logprobs, entropy


def all_gather_vocab(logits: torch.Tensor, labels: torch.Tensor, group) -> tuple:
    with torch.no_grad():
        parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, logits, group=group)
        full = torch.cat(parts, dim=-1).float()
        del parts
        argmax = full.argmax(dim=-1)
        lsm = torch.log_softmax(full, dim=-1)
        del full
        logprobs = lsm.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        entropy = -(lsm.exp() * lsm).sum(-1)
    return argmax, logprobs, entropy


F64_TOKENS = 256


def float64_reference(logits: torch.Tensor, labels: torch.Tensor, group) -> tuple:
    """The exact answer (float64, full vocabulary) for a few tokens, to measure each method's error."""
    parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, logits.contiguous(), group=group)
    full = torch.cat(parts, dim=-1).double()
    lsm = torch.log_softmax(full, dim=-1)
    return full.argmax(-1), lsm.gather(-1, labels.unsqueeze(-1)).squeeze(-1), -(lsm.exp() * lsm).sum(-1)


METHODS: list[tuple[str, Callable]] = [
    ("(a) ours: vocab_parallel_token_stats", ours),
    ("(b) anchors: Megatron CE + 3-AR entropy + 2-AG argmax", anchors),
    ("(c) all-gather vocab + plain torch", all_gather_vocab),
]


# ----------------------------------------------------------------------------- per rank


def bench_rank(tokens: int, vocab: int, dtypes: list[str], repeats: int) -> dict:
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    rank, tp = dist.get_rank(group), dist.get_world_size(group)
    report: dict = {}
    for dtype_name in dtypes:
        gen = torch.Generator().manual_seed(1000 + rank)
        logits = (torch.randn(tokens, vocab, generator=gen) * 4).to(DTYPES[dtype_name])
        labels = torch.randint(0, vocab * tp, (tokens,), generator=torch.Generator().manual_seed(7))
        shard_bytes = logits.numel() * logits.element_size()
        before = logits.clone()
        # Round-robin (a, b, c, a, b, c, ...) so that load from elsewhere on the
        # machine hits every method alike.
        times: list[list[float]] = [[] for _ in METHODS]
        for _, fn in METHODS:
            fn(logits, labels, group)  # warm-up
        for _ in range(repeats):
            for i, (_, fn) in enumerate(METHODS):
                dist.barrier(group=group)
                start = time.perf_counter()
                fn(logits, labels, group)
                times[i].append(time.perf_counter() - start)
        slowest = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
        rows, outputs = [], []
        for (name, fn), method_times in zip(METHODS, slowest.tolist()):
            with CountCollectives() as counter, PeakMemory() as memory:
                result = fn(logits, labels, group)
            outputs.append(result)
            rows.append({"name": name, "median_s": statistics.median(method_times), "min_s": min(method_times),
                         "collectives": counter.ops, "peak_extra": memory.peak / shard_bytes})
            if name.startswith("(a)"):
                assert torch.equal(logits, before), "ours modified the logits"
        ref = outputs[2]
        agreement = []
        for name, result in zip(("(a)", "(b)"), outputs[:2]):
            agreement.append({
                "name": name,
                "argmax_equal": bool(torch.equal(result[0], ref[0])),
                "logprob_max_abs": (result[1].double() - ref[1].double()).abs().max().item(),
                "entropy_max_abs": (result[2].double() - ref[2].double()).abs().max().item(),
            })
        exact = float64_reference(logits[:F64_TOKENS], labels[:F64_TOKENS], group)
        errors = []
        for (name, _), result in zip(METHODS, outputs):
            errors.append({
                "name": name[:3],
                "argmax_equal": bool(torch.equal(result[0][:F64_TOKENS], exact[0])),
                "logprob_max_abs": (result[1][:F64_TOKENS].double() - exact[1]).abs().max().item(),
                "entropy_max_abs": (result[2][:F64_TOKENS].double() - exact[2]).abs().max().item(),
            })
        # every rank holds the same results (ours)
        mine = torch.cat([outputs[0][0].double(), outputs[0][1].double(), outputs[0][2].double()])
        first = mine.clone()
        dist.broadcast(first, src=dist.get_global_rank(group, 0), group=group)
        report[dtype_name] = {"rows": rows, "agreement": agreement, "errors": errors,
                              "shard_mib": shard_bytes / 2**20,
                              "ranks_identical": bool(torch.equal(torch.nan_to_num(mine), torch.nan_to_num(first)))}
    return report


# ----------------------------------------------------------------------------- launcher


def _worker(rank: int, tp: int, store_path: str, conn, kwargs: dict) -> None:
    try:
        torch.set_num_threads(1)
        store = dist.FileStore(store_path, tp)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=tp, timeout=timedelta(minutes=10))
        from megatron.core import parallel_state

        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        result = ("ok", bench_rank(**kwargs))
        dist.barrier()
    except BaseException:  # noqa: BLE001 - report everything to the parent
        result = ("error", traceback.format_exc())
    conn.send(result)
    conn.close()
    os._exit(0)


def launch(tp: int, kwargs: dict) -> dict:
    import megatron.core.parallel_state  # noqa: F401 - import once, before forking

    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory() as tmp:
        pipes, procs = [], []
        for rank in range(tp):
            parent, child = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_worker, args=(rank, tp, os.path.join(tmp, "store"), child, kwargs))
            proc.start()
            child.close()
            pipes.append(parent)
            procs.append(proc)
        results = [pipe.recv() for pipe in pipes]
        for proc in procs:
            proc.join(timeout=30)
    for status, payload in results:
        if status != "ok":
            raise RuntimeError(f"a rank failed:\n{payload}")
    return results[0][1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=16384, help="local (per-rank) vocabulary columns")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="fp32,bf16", help="comma-separated: fp32, bf16, fp16")
    args = parser.parse_args()
    dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
    for d in dtypes:
        if d not in DTYPES:
            parser.error(f"unknown dtype {d!r}; choose from {sorted(DTYPES)}")
    import warnings

    warnings.filterwarnings("ignore")
    start, load_before = time.perf_counter(), os.getloadavg()[0]
    report = launch(args.tp, {"tokens": args.tokens, "vocab": args.vocab, "dtypes": dtypes,
                              "repeats": args.repeats})
    for dtype_name in dtypes:
        r = report[dtype_name]
        rows = r["rows"]
        base = rows[0]["median_s"]
        print(f"\nTP={args.tp}, {args.tokens} tokens x {args.vocab} local vocab ({args.vocab * args.tp} global), "
              f"{dtype_name} logits (shard {r['shard_mib']:.0f} MiB/rank), gloo on CPU, 1 thread/rank, "
              f"median of {args.repeats}")
        header = (f"{'method':<55} {'median s':>8} {'min s':>7} {'x (a)':>7} {'collectives/call':<34} "
                  f"{'peak extra mem':>14}")
        print(header)
        print("-" * len(header))
        for row in rows:
            ops = row["collectives"]
            summary = ", ".join(f"{ops.count(o)} {o}" for o in dict.fromkeys(ops)) or "none"
            print(f"{row['name']:<55} {row['median_s']:>8.3f} {row['min_s']:>7.3f} {row['median_s'] / base:>6.2f}x "
                  f"{f'{len(ops)} ({summary})':<34} {row['peak_extra']:>11.3f} x shard")
        for a in r["agreement"]:
            print(f"{a['name']} vs (c): argmax equal: {a['argmax_equal']}, max |d logprob| = "
                  f"{a['logprob_max_abs']:.2e}, max |d entropy| = {a['entropy_max_abs']:.2e}")
        for e in r["errors"]:
            print(f"{e['name']} vs float64 (first {F64_TOKENS} tokens): argmax equal: {e['argmax_equal']}, "
                  f"max |d logprob| = {e['logprob_max_abs']:.2e}, max |d entropy| = {e['entropy_max_abs']:.2e}")
        print(f"(a) identical on every rank: {r['ranks_identical']}")
        b, c = rows[1]["median_s"] / base, rows[2]["median_s"] / base
        print(f"speed-up of (a): {b:.1f}x over (b) (target >= 3x), {c:.1f}x over (c) (target >= 8x); "
              f"extra memory {rows[0]['peak_extra']:.3f} x shard (target < 0.25)")
    print(f"\ntotal benchmark time {time.perf_counter() - start:.0f} s; 1-minute load average "
          f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after on {os.cpu_count()} CPUs "
          f"(other work on the machine slows every method)")


if __name__ == "__main__":
    main()
