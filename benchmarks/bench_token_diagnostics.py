"""What the token diagnostics cost per microbatch: position buckets, the rollout mismatch, packed rows.

One process, one microbatch of ``rows × length`` tokens, the vocab-parallel
statistics precomputed (``token_stats``, what ``instrument()``'s hook hands the
metrics), so only the metrics' own per-token work is timed. Each variant against
its named baseline, the same metric without the option:

* ``Accuracy + TokenStatsMetric + LossMetric`` (per-token losses) with
  ``position_buckets`` (B equal buckets) vs without;
* ``GRPOMetric`` with ``rollout_logps`` vs with ``old_logps`` only;
* the collection on one packed THD row (``cu_seqlens``, sequences of 512) vs the
  same tokens as padded rows.

Rounds alternate between the modes in a rotating order; per mode the median of
the rounds' mean time per ``accumulate`` (``time.perf_counter``; CUDA events on a
GPU). Prints one table: time per call and the ratio to the baseline. ``--threads``
(default 1) sets torch's intra-op threads on CPU: on a shared CPU the OpenMP
threads of small kernels contend, and timings then measure the machine's load.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from twinkle_megatron import Accuracy, GRPOMetric, LossMetric, MetricCollection, TokenStatsMetric
from twinkle_megatron.ops import TokenStats


def _timed(fn: Callable[[], None], repeats: int, cuda: bool) -> float:
    if cuda:
        torch.cuda.synchronize()
    begin = time.perf_counter()
    for _ in range(repeats):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - begin) / repeats


def measure(args: argparse.Namespace) -> list[tuple[str, str, float, float]]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows, length = args.rows, args.length
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 1000, (rows, length), generator=g).to(device)
    stats = TokenStats(labels.clone(), -torch.rand(rows, length, generator=g).to(device),
                       torch.rand(rows, length, generator=g).to(device))
    losses = torch.rand(rows, length, generator=g).to(device)
    logps = -torch.rand(rows, length, generator=g, dtype=torch.float64).to(device)
    tokens = rows * length
    cu = torch.arange(0, tokens + 1, 512, device=device)

    def collection(**options) -> MetricCollection:
        return MetricCollection([Accuracy(**options), TokenStatsMetric(**options), LossMetric(**options)])

    padded, bucketed = collection(), collection(position_buckets=args.buckets, seq_length=length)
    packed = collection()
    grpo, mismatch = GRPOMetric(), GRPOMetric()
    cases = {
        "buckets": (lambda: padded.accumulate({"labels": labels}, {"token_stats": stats, "loss": losses}),
                    lambda: bucketed.accumulate({"labels": labels}, {"token_stats": stats, "loss": losses})),
        "rollout": (lambda: grpo.accumulate({"labels": labels}, {"logps": logps}, old_logps=logps + 0.1),
                    lambda: mismatch.accumulate({"labels": labels}, {"logps": logps}, old_logps=logps + 0.1,
                                                rollout_logps=logps - 0.1)),
        "packed": (lambda: padded.accumulate({"labels": labels}, {"token_stats": stats, "loss": losses}),
                   lambda: packed.accumulate({"labels": labels.reshape(1, -1), "cu_seqlens": cu},
                                             {"token_stats": TokenStats(*(s.reshape(1, -1) for s in stats)),
                                              "loss": losses.reshape(1, -1)})),
    }
    names = {"buckets": ("Accuracy+TokenStats+Loss", f"+ position_buckets={args.buckets}"),
             "rollout": ("GRPOMetric (old_logps)", "+ rollout_logps"),
             "packed": ("collection, padded rows", "collection, one packed row")}
    results = []
    for case, (baseline, variant) in cases.items():
        timings: dict[int, list[float]] = {0: [], 1: []}
        for fn in (baseline, variant):
            fn()  # warm-up
        for round_index in range(args.rounds):
            order = (0, 1) if round_index % 2 == 0 else (1, 0)
            for mode in order:
                timings[mode].append(_timed((baseline, variant)[mode], args.repeats, device.type == "cuda"))
        base, other = (statistics.median(timings[mode]) for mode in (0, 1))
        results.append((*names[case], base, other))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--buckets", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"{args.rows} × {args.length} tokens per microbatch, {device}, {args.threads} thread(s), "
          f"torch {torch.__version__}")
    print("| baseline | variant | baseline ms | variant ms | ratio |\n|---|---|---|---|---|")
    for baseline, variant, base, other in measure(args):
        print(f"| {baseline} | {variant} | {base * 1e3:.2f} | {other * 1e3:.2f} | {other / base:.2f} |")


if __name__ == "__main__":
    main()
