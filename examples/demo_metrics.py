"""CPU demo: the metrics on 8 ranks with megatron-core's TP2 × PP2 × DP2 layout, over gloo.

Each "training step" the last pipeline stage produces vocab-parallel logits
(every TP rank holds half of the vocabulary) for a few microbatches, as
Megatron's schedules do; the logits sharpen towards the labels as steps go by,
so accuracy rises and loss falls. The metrics see only the vocab shards and
still report the numbers of the full vocabulary, the same on every rank, with
two collectives per ``calculate()`` for the whole collection.

    python examples/demo_metrics.py [--steps 8] [--tp 2 --pp 2 --dp 2]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import tempfile
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")

VOCAB, PADDED_VOCAB, SEQ, MICRO_BATCH, MICROBATCHES = 1000, 1024, 64, 4, 4


def fake_vocab_parallel_logits(step: int, labels: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """This TP rank's shard ``[s, b, V/tp]`` (Megatron's layout) of logits that learn with ``step``."""
    from megatron.core import parallel_state as ps

    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    full = torch.randn(*labels.shape, PADDED_VOCAB, generator=generator)
    full.scatter_add_(-1, labels.clamp(min=0).unsqueeze(-1), torch.full((*labels.shape, 1), 0.6 * step))
    full[..., VOCAB:] = -1e4  # Megatron's padded vocabulary columns
    width = PADDED_VOCAB // tp
    return full[..., rank * width:(rank + 1) * width].transpose(0, 1).contiguous()


def train(steps: int) -> None:
    from megatron.core import parallel_state as ps

    from twinkle_megatron import Accuracy, LossMetric, MetricCollection, TrainMetric
    from twinkle_megatron.ops import vocab_parallel_logprobs

    metrics = MetricCollection([Accuracy(vocab_size=VOCAB), LossMetric(loss_reduction="sum"), TrainMetric()])
    generator = torch.Generator().manual_seed(1234 + ps.get_data_parallel_rank())
    for step in range(1, steps + 1):
        started = time.perf_counter()
        if ps.is_pipeline_last_stage(ignore_virtual=True):
            inputs, logits, losses = [], [], []
            for _ in range(MICROBATCHES):
                labels = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=generator)
                labels[:, :8] = -100  # a prompt that is not trained on
                shard = fake_vocab_parallel_logits(step, labels, generator)
                logprobs = vocab_parallel_logprobs(shard, labels.t(), group=ps.get_tensor_model_parallel_group(),
                                                   vocab_size=VOCAB)
                inputs.append({"labels": labels})
                logits.append(shard)
                losses.append(-logprobs.sum())  # Megatron-LM's per-token loss: a sum, counted below
            metrics.accumulate(inputs, {"logits": logits, "loss": losses, "lr": 1e-4, "step": step})
        results = metrics.calculate()
        if dist.get_rank() == 0:
            print(f"step {step:3d} | loss {results['loss']:.4f} | accuracy {results['accuracy']:.3f} "
                  f"({results['correct_tokens']}/{results['total_tokens']} tokens) | "
                  f"{time.perf_counter() - started:.3f} s", flush=True)


def worker(rank: int, world_size: int, store_path: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(minutes=2))
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp)
    train(args.steps)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--dp", type=int, default=2)
    args = parser.parse_args()
    world_size = args.tp * args.pp * args.dp
    import megatron.core.parallel_state  # noqa: F401  (imported once, before forking the ranks)

    import twinkle_megatron  # noqa: F401

    print(f"twinkle-megatron demo: {world_size} CPU ranks, TP{args.tp} × PP{args.pp} × DP{args.dp}, "
          f"{MICROBATCHES} microbatches of {MICRO_BATCH}×{SEQ} tokens, vocab {VOCAB} (padded to {PADDED_VOCAB})")
    context = mp.get_context("fork")
    with tempfile.TemporaryDirectory() as tmp:
        procs = [context.Process(target=worker, args=(rank, world_size, os.path.join(tmp, "store"), args))
                 for rank in range(world_size)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join()
    failed = [rank for rank, proc in enumerate(procs) if proc.exitcode != 0]
    if failed:
        raise SystemExit(f"ranks {failed} failed")


if __name__ == "__main__":
    main()
