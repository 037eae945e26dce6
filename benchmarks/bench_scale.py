"""Benchmark: the sync's cost as the number of ranks grows, against plain collectives of the same sizes.

Run: ``python benchmarks/bench_scale.py [--worlds 2,4,8,16] [--dim 1024] [--repeats 7]``.

For each world size, forked CPU ranks on gloo (one thread each, all data-parallel) build one metric of
every built-in class, feed the ones that take data (accuracy and token statistics from logits, the loss,
an ``EmbeddingMetric`` with ``--dim``-wide embeddings over two calls), and time:

* ``calculate()`` of the collection;
* ``MetricsTracker.end_step`` on a log step (``log_interval=1``, no backend), the same metrics inside;
* the baselines: the same all-reduces, replayed on fresh tensors of the sizes each of them used
  (recorded at the dispatcher in an untimed call) — what any implementation must pay to move those bytes.

Each call starts after a barrier; a call's time is the slowest rank's; the median over ``--repeats``
calls is reported, and the ratio to the baseline. The sync's collectives are counted too: two
all-reduces of fixed size at every world size means the cost stays flat per rank (the bytes grow with
``d`` and the number of calls, never with the number of ranks).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parent.parent
ROWS, SEQ, VOCAB = 8, 64, 1024


class RecordAllReduces(TorchDispatchMode):
    """Records (numel, dtype) of every all-reduce dispatched inside the block (replayed as SUMs: gloo's MAX
    and SUM move the same bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "c10d" and func._schema.name.endswith("allreduce_"):
            tensors = args[0]
            self.calls.append((sum(t.numel() for t in tensors), tensors[0].dtype))
        return func(*args, **kwargs)


def metrics(dim: int):
    import twinkle_megatron as tm

    return [tm.Accuracy(), tm.LossMetric(), tm.TrainMetric(), tm.TokenStatsMetric(), tm.GRPOMetric(),
            tm.GSPOMetric(), tm.CISPOMetric(), tm.PPOMetric(), tm.PPOValueMetric(), tm.DPOMetric(),
            tm.CompletionRewardMetric(), tm.EmbeddingMetric()]


def feed(collection: list, rank: int, dim: int) -> None:
    generator = torch.Generator().manual_seed(rank)
    accuracy, loss, _, stats, *_, embedding = collection
    logits = torch.randn(2, SEQ, VOCAB, generator=generator)
    labels = torch.randint(0, VOCAB, (2, SEQ), generator=generator)
    accuracy.accumulate({"labels": labels}, {"logits": logits})
    stats.accumulate({"labels": labels}, {"logits": logits})
    loss.accumulate({}, {"loss": 1.0 + rank})
    anchors = torch.zeros(ROWS, dtype=torch.long)
    anchors[0::2] = 1
    for _ in range(2):
        embedding.accumulate({"labels": anchors}, {"embeddings": torch.randn(ROWS, dim, generator=generator)})


def slowest(seconds: float) -> float:
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def timed(fn) -> float:
    dist.barrier()
    begin = time.perf_counter()
    fn()
    return slowest(time.perf_counter() - begin)


def worker(dim: int, repeats: int) -> dict:
    import twinkle_megatron as tm
    from twinkle_megatron.testing.guards import count_collectives

    rank = dist.get_rank()
    collection = tm.MetricCollection(metrics(dim))
    feed(collection.metrics, rank, dim)
    recorder = RecordAllReduces()
    with recorder, count_collectives() as counted:
        collection.calculate()
    tracker = tm.MetricsTracker(config=tm.TrackerConfig(log_interval=1, backends=()), metrics=collection.metrics)
    tracker_recorder = RecordAllReduces()
    tracker.start_step()
    feed(collection.metrics, rank, dim)
    with tracker_recorder:
        tracker.end_step(1, grad_norm=1.0, lr=1e-4, tokens=ROWS * SEQ)
    replays = {name: [torch.zeros(numel, dtype=dtype) for numel, dtype in calls]
               for name, calls in (("calculate", recorder.calls), ("end_step", tracker_recorder.calls))}

    def plain(name: str) -> None:
        for buffer in replays[name]:
            dist.all_reduce(buffer)

    times: dict[str, list] = {"calculate": [], "end_step": [], "plain calculate": [], "plain end_step": []}
    for step in range(2, repeats + 3):
        feed(collection.metrics, rank, dim)
        times["calculate"].append(timed(collection.calculate))
        times["plain calculate"].append(timed(lambda: plain("calculate")))
        tracker.start_step()
        feed(collection.metrics, rank, dim)
        times["end_step"].append(timed(lambda s=step: tracker.end_step(s, grad_norm=1.0, lr=1e-4, tokens=ROWS * SEQ)))
        times["plain end_step"].append(timed(lambda: plain("end_step")))
    tracker.close()
    result = {name: statistics.median(values[1:]) for name, values in times.items()}
    result["collectives"] = dict(counted)
    result["bytes"] = sum(n * torch.tensor([], dtype=d).element_size() for n, d in recorder.calls)
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="2,4,8,16")
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT / "tests"))
    os.environ.setdefault("TWINKLE_MEGATRON_STANDALONE", "1")
    from twinkle_megatron.testing.distributed import run_distributed

    print(f"sync at scale: one metric of every built-in class, embeddings d={args.dim} over 2 calls, forked CPU "
          f"ranks (gloo, DP); median of {args.repeats} calls, slowest rank; baseline: the same all-reduces alone")
    print(f"{'ranks':>5} {'collectives':>14} {'bytes/rank':>11} {'calculate':>10} {'plain':>9} {'ratio':>6} "
          f"{'end_step':>10} {'plain':>9} {'ratio':>6}")
    for world in (int(w) for w in args.worlds.split(",")):
        r = run_distributed(worker, world, args=(args.dim, args.repeats), timeout=1800)[0]
        counts = ", ".join(f"{n} {name}" for name, n in sorted(r["collectives"].items()))
        cells = [f"{r[name] * 1e3:>7.2f} ms {r['plain ' + name] * 1e3:>6.2f} ms {r[name] / r['plain ' + name]:>5.1f}x"
                 for name in ("calculate", "end_step")]
        print(f"{world:>5} {counts:>14} {r['bytes']:>11,} {cells[0]} {cells[1]}")


if __name__ == "__main__":
    main()
