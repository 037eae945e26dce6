"""Benchmark: what the plugin, the tracker and the fused loss add to a real megatron-core training step.

Run: ``python benchmarks/bench_step_overhead.py [--layouts tp2,dp2] [--hidden 256] [--layers 4]
[--vocab 32000] [--seq 256] [--micro-batch 2] [--microbatches 2] [--steps 2] [--rounds 5]``.

Two forked CPU ranks on gloo (one thread each), megatron-core's ``parallel_state`` for each layout, a
``GPTModel`` (Megatron's local layers) wrapped in Megatron's DDP, Megatron's Adam
(``get_megatron_optimizer``), Megatron-LM's ``forward_step`` / per-token ``loss_func`` and the schedule
from ``get_forward_backward_func()``. Modes, each a block of ``--steps`` steps:

* ``plain``: the step as Megatron-LM writes it;
* ``plugin``: ``instrument(model)`` (accuracy, log-prob, entropy, loss), ``metrics.wrap(forward_step)``,
  one ``calculate()`` per block (a log interval);
* ``plugin + tracker``: the same inside ``MetricsTracker.step()`` (``log_interval`` = the block, no backend);
* ``fused loss``: ``instrument(model, fused_loss=True)``: the loss and the statistics from one pass;
* ``fused loss + tracker``.

The modes take turns in every round, in a rotating order; after a warm-up round, each round gives every
mode's block time divided by the plain block's time *of the same round*, and the table reports the median
ratio over rounds (with its range), with the median per-step time. Two clocks: the CPU time of the
process (``time.process_time``, one torch thread per rank: the work done, which load from other processes
on a shared machine barely changes) — the main column — and the wall time (``perf_counter``; on a
contended machine it mostly measures the other processes). A block's time is the slowest rank's (a
barrier before each block).
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
from step_overhead import forward_step  # Megatron-LM's forward_step and per-token loss_func, shared with gpu_timings.py

ROOT = Path(__file__).resolve().parent.parent
MODES = ("plain", "plugin", "plugin + tracker", "fused loss", "fused loss + tracker")


def build(args: argparse.Namespace):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                               tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
                               use_cpu_initialization=True, params_dtype=torch.float32,
                               pipeline_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
                               calculate_per_token_loss=True)
    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234, inference_rng_tracker=True)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=args.vocab,
                     max_sequence_length=args.seq, position_embedding_type="learned_absolute",
                     share_embeddings_and_output_weights=False)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-4, clip_grad=0.0), [ddp])
    return ddp, config, optimizer


def microbatches(args: argparse.Namespace, generator: torch.Generator) -> list[dict]:
    out = []
    for _ in range(args.microbatches):
        tokens = torch.randint(0, args.vocab, (args.micro_batch, args.seq + 1), generator=generator)
        out.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
                    "loss_mask": torch.ones(args.micro_batch, args.seq),
                    "position_ids": torch.arange(args.seq).expand(args.micro_batch, -1)})
    return out


def run_block(mode: str, args: argparse.Namespace, ddp, config, optimizer, data: list) -> tuple[float, float]:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from twinkle_megatron import MetricsTracker, TrackerConfig
    from twinkle_megatron.megatron import instrument

    schedule = get_forward_backward_func()
    metrics = instrument(ddp, fused_loss=mode.startswith("fused")) if mode != "plain" else None
    tracker = MetricsTracker(config=TrackerConfig(log_interval=len(data), backends=()), metrics=metrics.metrics) \
        if mode.endswith("tracker") else None
    step_func = metrics.wrap(forward_step) if metrics else forward_step

    def one_step(batches):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        schedule(forward_step_func=step_func, data_iterator=iter(batches), model=ddp,
                 num_microbatches=len(batches), seq_length=args.seq, micro_batch_size=args.micro_batch,
                 forward_only=False)
        return optimizer.step()

    dist.barrier()
    begin, cpu_begin = time.perf_counter(), time.process_time()
    for index, batches in enumerate(data):
        if tracker is not None:
            with tracker.step(index + 1) as values:
                _, grad_norm, _ = one_step(batches)
                values.update(grad_norm=grad_norm, lr=1e-4, tokens=sum(b["loss_mask"].sum() for b in batches))
        else:
            one_step(batches)
    if metrics is not None and tracker is None:
        metrics.calculate()
    seconds, cpu_seconds = time.perf_counter() - begin, time.process_time() - cpu_begin
    if tracker is not None:
        tracker.close()
    if metrics is not None:
        metrics.detach()
    slowest = torch.tensor([seconds, cpu_seconds], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest[0]), float(slowest[1])


def worker(args: argparse.Namespace, tp: int) -> dict:
    from megatron.core import parallel_state

    from twinkle_megatron.testing.cuda_shim import cpu_cuda_shim

    # Megatron's optimizer wants parallel_state's gloo groups too (the kit's layout skips them).
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    with cpu_cuda_shim():
        ddp, config, optimizer = build(args)
        generator = torch.Generator().manual_seed(0)
        modes = tuple(m for m in MODES if m in args.modes.split(","))
        ratios: dict[str, list] = {mode: [] for mode in modes}
        cpu_ratios: dict[str, list] = {mode: [] for mode in modes}
        times: dict[str, list] = {mode: [] for mode in modes}
        for round_index in range(1 + args.rounds):
            order = modes[round_index % len(modes):] + modes[:round_index % len(modes)]
            block = {}
            for mode in order:
                data = [microbatches(args, generator) for _ in range(args.steps)]
                block[mode] = run_block(mode, args, ddp, config, optimizer, data)
            if round_index == 0:
                continue  # warm-up
            for mode in modes:
                ratios[mode].append(block[mode][0] / block["plain"][0])
                cpu_ratios[mode].append(block[mode][1] / block["plain"][1])
                times[mode].append(block[mode][1] / args.steps)
    return {mode: (statistics.median(cpu_ratios[mode]), statistics.median(times[mode]), min(cpu_ratios[mode]),
                   max(cpu_ratios[mode]), statistics.median(ratios[mode])) for mode in modes}


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
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated, 'plain' among them")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    sys.path.insert(0, str(ROOT / "tests"))
    os.environ.setdefault("TWINKLE_MEGATRON_STANDALONE", "1")
    import warnings

    warnings.filterwarnings("ignore")
    import megatron.core.parallel_state  # noqa: F401 - imported once, before the ranks fork

    from twinkle_megatron.testing.distributed import run_distributed

    print(f"step overhead: GPTModel hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, seq {args.seq}, "
          f"{args.microbatches} x {args.micro_batch} sequences per rank and step, Megatron DDP + Adam, 2 CPU ranks; "
          f"{args.rounds} rounds of {args.steps}-step blocks per mode (ratio: block / plain block of the same round)")
    print(f"{'layout':<8} {'mode':<22} {'CPU ms/step':>11} {'vs plain':>9} {'(min..max)':>16} {'wall vs plain':>14}")
    for name in args.layouts.split(","):
        tp = {"tp2": 2, "dp2": 1}[name]
        result = run_distributed(worker, 2, args=(args, tp), timeout=3600)[0]
        for mode, (ratio, seconds, low, high, wall) in result.items():
            spread = f"{low - 1:+.1%}..{high - 1:+.1%}"
            print(f"{name:<8} {mode:<22} {seconds * 1e3:11.1f} {ratio - 1:+9.1%} {spread:>16} {wall - 1:+14.1%}")


if __name__ == "__main__":
    main()
