"""Benchmark: what the plugin, the tracker and the fused loss add to a real megatron-core training step.

Run: ``python benchmarks/bench_step_overhead.py [--layouts tp2,dp2] [--hidden 256] [--layers 4]
[--vocab 32000] [--seq 256] [--micro-batch 2] [--microbatches 2] [--steps 2] [--rounds 5]``.

The step-overhead harness (``step_overhead.py``: the model, the modes, the rounds and the clocks) on two
forked CPU ranks on gloo (one thread each), megatron-core's ``parallel_state`` for each layout, Megatron's
local layers. The table reports per layout and mode the median CPU time per step (the slowest rank's), the
median ratio to the plain block of the same round (with its range over the rounds) and the same ratio on
the wall clock.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

from step_overhead import CPU_MODES, PLAIN, StepSpec, measure, overhead

ROOT = Path(__file__).resolve().parent.parent


def worker(spec: StepSpec, tp: int) -> dict:
    import torch
    from megatron.core import parallel_state

    from twinkle_megatron.testing.cuda_shim import cpu_cuda_shim

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    with cpu_cuda_shim():
        results, _ = measure(spec, torch.device("cpu"))
    return {mode: (overhead(results, mode), r.median, min(r.ratios), max(r.ratios),
                   statistics.median(r.wall_ratios)) for mode, r in results.items()}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", default="tp2,dp2")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--modes", default=",".join(CPU_MODES), help=f"comma-separated, {PLAIN!r} among them")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    sys.path.insert(0, str(ROOT / "tests"))
    os.environ.setdefault("TWINKLE_MEGATRON_STANDALONE", "1")
    import warnings

    warnings.filterwarnings("ignore")
    import megatron.core.parallel_state  # noqa: F401 - imported once, before the ranks fork

    from twinkle_megatron.testing.distributed import run_distributed

    spec = StepSpec(hidden_size=args.hidden, layers=args.layers, heads=args.heads, seq_length=args.seq,
                    micro_batch_size=args.micro_batch, microbatches=args.microbatches, vocab_size=args.vocab,
                    steps_per_block=args.steps, rounds=args.rounds, warmup=1, te=False,
                    modes=tuple(args.modes.split(",")))
    print(f"step overhead: GPTModel hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, seq {args.seq}, "
          f"{args.microbatches} x {args.micro_batch} sequences per rank and step, Megatron DDP + Adam, 2 CPU ranks; "
          f"{args.rounds} rounds of {args.steps}-step blocks per mode (ratio: block / plain block of the same round)")
    print(f"{'layout':<8} {'mode':<22} {'CPU ms/step':>11} {'vs plain':>9} {'(min..max)':>16} {'wall vs plain':>14}")
    for name in args.layouts.split(","):
        tp = {"tp2": 2, "dp2": 1}[name]
        result = run_distributed(worker, 2, args=(spec, tp), timeout=3600)[0]
        for mode, (extra, seconds, low, high, wall) in result.items():
            spread = f"{low - 1:+.1%}..{high - 1:+.1%}"
            print(f"{name:<8} {mode:<22} {seconds * 1e3:11.1f} {extra:+9.1%} {spread:>16} {wall - 1:+14.1%}")


if __name__ == "__main__":
    main()
