"""Benchmark: CPU time of one ``accumulate`` call, ours against Twinkle's own metrics on the same data.

Run: ``python benchmarks/bench_accumulate.py [--sizes 2x128x2048,8x512x16384] [--rounds 5]``.

Twinkle's metric modules come from the real twinkle-kit 0.5.1 wheel (``pip download --no-deps`` into a
cache directory on first use), imported unmodified behind the smallest stubs for the parts of the
``twinkle`` package they import and this benchmark does not exercise (``twinkle.data_format``'s type
names, ``torch_util``, ``get_logger``, and ``transformers_utils`` -- the real file -- for GRPO's
alignment). Twinkle's models call ``metric.accumulate(inputs, outputs, **kwargs)`` for each of their
metrics in turn; ours get the same call through one ``MetricCollection`` (what ``instrument()`` does).

Sets of metrics (the same classes on both sides): 1 = Accuracy; 4 = + LossMetric, TrainMetric,
GRPOMetric; 8 = + GSPOMetric, CISPOMetric, PPOMetric, CompletionRewardMetric. Data: one microbatch of
``batch x sequence`` labels (the first quarter of each sequence a prompt, ``-100``), full-vocabulary
logits (one process: no TP), log-probs, Twinkle's per-sequence lists of old log-probs and advantages, a
loss, rewards. Two sizes: 2x128 tokens over 2,048 columns, where the per-call overhead (Python, op
dispatch) is all there is; 8x512 tokens over 16,384 columns (eight completions of a GRPO group, a TP
shard of a 128k vocabulary), where the logits are read. With the per-token ``entropies`` Twinkle's model
forward puts in its outputs (both sides' GRPO metrics read them), and at the small size also without
(then our GRPO metrics compute ``train/entropy`` from the logits -- the full statistics pass, an exp per
logit -- and Twinkle's report none). Accuracy alone makes our argmax-only pass either way.

Time: ``time.process_time`` around each call, after a few untimed ones (``calculate()`` every 50 calls,
untimed, so that states stay small), one torch thread. Each round times Twinkle's set and ours one
after the other, ``--rounds`` rounds (interleaved, so that a slower spell of the machine hits both);
the table gives the median CPU time per call over the rounds and ours / Twinkle's. Twinkle's ``.item()``
calls cost no device wait on a CPU; on a GPU each would wait for the device.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import torch

TWINKLE = "twinkle-kit==0.5.1"
CACHE = Path(os.environ.get("TWINKLE_MEGATRON_CACHE", Path(tempfile.gettempdir()) / "twinkle-megatron-cache"))
SETS = {1: ["Accuracy"], 4: ["Accuracy", "LossMetric", "TrainMetric", "GRPOMetric"],
        8: ["Accuracy", "LossMetric", "TrainMetric", "GRPOMetric", "GSPOMetric", "CISPOMetric", "PPOMetric",
            "CompletionRewardMetric"]}

STUBS = {
    "twinkle/__init__.py": "from .utils import torch_util  # noqa: F401\n",
    "twinkle/data_format.py": "InputFeature = dict\nModelOutput = dict\n",
    "twinkle/utils/__init__.py": (
        "import logging\n\n\nclass torch_util:  # noqa: N801\n    @staticmethod\n"
        "    def gather_object(results, device_mesh, process_group):\n        return results\n\n\n"
        "def get_logger():\n    return logging.getLogger('twinkle')\n\n\n"
        "def pad_and_stack_tensors(*args, **kwargs):\n    raise NotImplementedError('not in this benchmark')\n"),
    "twinkle/utils/utils.py": "def deep_getattr(obj, attr, default=None):\n    raise NotImplementedError\n",
}


def twinkle_metrics():
    """``twinkle.metric`` from the real wheel, behind the stubs above."""
    root = CACHE / "twinkle-stubbed"
    if not (root / "twinkle/metric/__init__.py").exists():
        wheels = CACHE / "wheels"
        wheels.mkdir(parents=True, exist_ok=True)
        if not list(wheels.glob("twinkle_kit-0.5.1-*.whl")):
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", TWINKLE, "-d", str(wheels)],
                           check=True)
        wheel = next(wheels.glob("twinkle_kit-0.5.1-*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            for name in archive.namelist():
                if name.startswith("twinkle/metric/") or name == "twinkle/utils/transformers_utils.py":
                    archive.extract(name, root)
        for name, text in STUBS.items():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_text(text)
    sys.path.insert(0, str(root))
    try:
        return importlib.import_module("twinkle.metric")
    finally:
        sys.path.remove(str(root))


def make_data(batch: int, seq: int, vocab: int) -> tuple[dict, dict, dict]:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, seq, vocab, generator=generator)
    labels = torch.randint(0, vocab, (batch, seq), generator=generator)
    labels[:, :seq // 4] = -100  # the prompt
    logps = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    inputs = {"labels": labels}
    entropies = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    outputs = {"logits": logits, "logps": logps, "entropies": entropies, "loss": torch.tensor(2.5),
               "num_tokens": (labels >= 0).sum()}
    # Twinkle's call form: per-sequence lists (old log-probs of the completion tokens, one advantage each).
    old_logps = [(row[keep] + 0.1).tolist() for row, keep in zip(logps, labels >= 0)]
    kwargs = {"old_logps": old_logps, "advantages": torch.randn(batch, generator=generator).tolist(),
              "lr": 1e-4, "step": 1, "gradient_accumulation_steps": 1, "grad_norm": 1.0,
              "rewards": {"score": [1.0] * batch}, "completion_lengths": [seq] * batch, "generate_time": 1.0}
    return inputs, outputs, kwargs


def per_call(accumulate, calculate, repeats: int) -> float:
    """Mean CPU seconds per ``accumulate()`` over ``repeats`` timed calls."""
    for _ in range(min(20, repeats)):
        accumulate()
    calculate()
    total = 0.0
    for index in range(repeats):
        begin = time.process_time()
        accumulate()
        total += time.process_time() - begin
        if index % 50 == 49:
            calculate()
    return total / repeats


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="2x128x2048,8x512x16384", help="batch x sequence x vocabulary, ...")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=200, help="timed calls per round at the first size "
                        "(fewer at larger ones: the same number of logits read)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    os.environ["TWINKLE_MEGATRON_STANDALONE"] = "1"  # our classes without Twinkle's base
    import twinkle_megatron as ours
    import twinkle_megatron.metric as our_metrics

    theirs = twinkle_metrics()
    sizes = [tuple(int(v) for v in size.split("x")) for size in args.sizes.split(",")]
    first_logits = sizes[0][0] * sizes[0][1] * sizes[0][2]
    print(f"accumulate: one microbatch, one process, one thread; CPU time per call, median of {args.rounds} "
          "interleaved rounds")
    for index, (batch, seq, vocab) in enumerate(sizes):
        repeats = max(5, args.repeats * first_logits // (batch * seq * vocab))
        inputs, outputs, kwargs = make_data(batch, seq, vocab)
        forms = [("with entropies (Twinkle's model forward)", outputs)]
        if index == 0:
            forms.append(("without entropies (ours: train/entropy from the logits; Twinkle: none)",
                          {k: v for k, v in outputs.items() if k != "entropies"}))
        for title, given in forms:
            print(f"{batch}x{seq} tokens, vocabulary {vocab}, {repeats} calls per round; outputs {title}")
            table(theirs, ours, our_metrics, inputs, given, kwargs, repeats, args.rounds)


def table(theirs, ours, our_metrics, inputs: dict, outputs: dict, kwargs: dict, repeats: int, rounds: int) -> None:
    print(f"{'metrics':>7} {'Twinkle 0.5.1':>14} {'ours':>9} {'ours / Twinkle':>15}")
    for count, names in SETS.items():
        twinkle_set = [getattr(theirs, name)(None, None) for name in names]
        collection = ours.MetricCollection([getattr(our_metrics, name)() for name in names])
        twinkle_times, our_times = [], []
        for _ in range(rounds):
            twinkle_times.append(per_call(lambda s=twinkle_set: [m.accumulate(inputs, outputs, **kwargs) for m in s],
                                          lambda s=twinkle_set: [m.calculate() for m in s], repeats))
            our_times.append(per_call(lambda c=collection: c.accumulate(inputs, outputs, **kwargs),
                                      collection.calculate, repeats))
        twinkle_time, our_time = statistics.median(twinkle_times), statistics.median(our_times)
        print(f"{count:>7} {twinkle_time * 1e3:>11.2f} ms {our_time * 1e3:>6.2f} ms {our_time / twinkle_time:>15.2f}",
              flush=True)


if __name__ == "__main__":
    main()
