"""What per-layer norms cost: a real megatron-core training step with and without ``tracker.record_grad_norms``.

One process (gloo, world 1, megatron-core's ``parallel_state`` initialised), a
GPTModel (the test kit's layout-independent model, local layer spec) in
Megatron's DDP with Megatron's Adam. Rounds alternate, in a rotating order, between

* ``step``: forward-backward through Megatron's schedule (gradients reduced by
  ``finalize_model_grads``), ``optimizer.step()``, ``tracker.end_step`` (a log
  step every ``--log-interval`` steps);
* ``step + layer norms``: the same with ``tracker.record_grad_norms(chunks,
  optimizer)`` before ``optimizer.step()`` (its states join the tracker's sync);

each round ``--repeats`` steps timed with ``time.perf_counter`` (CUDA events on
a GPU); per mode the median over rounds, and the ratio against ``step``. The
``record`` row times ``record_grad_norms`` alone. On CPU the test suite's
CUDA-to-CPU shim runs the model.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

import torch
import torch.distributed as dist
from step_overhead import seconds_per_call

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def measure(args: argparse.Namespace) -> dict[str, float]:
    from kit.megatron_gpt import GPTSpec, make_batch
    from kit.megatron_training import build_trained_gpt, train_forward_backward
    from megatron.core import parallel_state

    from twinkle_megatron import MetricsTracker, TrackerConfig

    parallel_state.initialize_model_parallel()
    spec = GPTSpec(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=8, vocab_size=1024,
                   max_sequence_length=args.seq)
    chunks, optimizer = build_trained_gpt(spec, lr=1e-4)
    batch = make_batch(spec, global_batch_size=args.batch, seq_length=args.seq)
    config = TrackerConfig(log_interval=args.log_interval, backends=())
    trackers = {mode: MetricsTracker(config=config) for mode in ("step", "norms")}

    def step(mode: str) -> None:
        tracker = trackers[mode]
        train_forward_backward(chunks, batch, micro_batch_size=args.batch // 2)
        if mode == "norms":
            tracker.record_grad_norms(chunks, optimizer)
        optimizer.step()
        tracker.end_step()

    def record() -> None:
        trackers["norms"].record_grad_norms(chunks, optimizer)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # timed with CUDA events on a GPU
    for mode in ("step", "norms"):
        step(mode)  # warm-up (and the first log step)
    rounds: dict[str, list[float]] = {"step": [], "norms": [], "record": []}
    for index in range(args.rounds):
        order = ["step", "norms"] if index % 2 == 0 else ["norms", "step"]
        for mode in order:
            rounds[mode].append(seconds_per_call(lambda m=mode: step(m), args.repeats, device))
        rounds["record"].append(seconds_per_call(record, args.repeats, device))
    return {mode: statistics.median(times) for mode, times in rounds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    torch.set_num_threads(1)
    from twinkle_megatron.testing.cuda_shim import cpu_cuda_shim

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
        with cpu_cuda_shim():
            medians = measure(args)
        dist.destroy_process_group()
    base = medians["step"]
    print(f"per-layer norms: GPTModel {args.layers} layers × hidden {args.hidden}, batch {args.batch} × seq "
          f"{args.seq}, log every {args.log_interval} steps; median of {args.rounds} rounds × {args.repeats} steps")
    print(f"{'mode':<22}{'ms/step':>10}{'vs step':>10}")
    for mode, label in (("step", "step"), ("norms", "step + layer norms"), ("record", "record_grad_norms")):
        print(f"{label:<22}{medians[mode] * 1e3:>10.2f}{medians[mode] / base:>10.3f}")


if __name__ == "__main__":
    main()
