"""The plugin's cost in a real megatron-core training step: the same steps with and without ``instrument()``.

One process, one device, megatron-core's ``parallel_state`` initialised (TP=PP=1):
a ``GPTModel`` (Transformer Engine layers when TE imports and ``te=True``, else
Megatron's local layers), Megatron-LM's ``forward_step`` / per-token ``loss_func``,
the schedule from ``get_forward_backward_func()`` and an AdamW step. Blocks of
``steps_per_block`` steps run in turns, in a rotating order, for each mode:

* ``plain``: the schedule with the plain ``forward_step``;
* ``instrumented (torch)`` / ``instrumented (triton)``: ``instrument(model,
  [Accuracy, TokenStatsMetric])``, ``metrics.wrap(forward_step)``, and one
  ``metrics.calculate()`` at the end of the block (what a tracker does once per
  log interval), with the token statistics' local pass forced to the torch loop
  or the Triton kernel through ``TWINKLE_MEGATRON_TOKEN_STATS_KERNEL``;
* ``instrumented (fused loss)``: the same with ``instrument(..., fused_loss=True)``: the model's loss and
  the statistics from one pass (``ops/fused_cross_entropy.py``).

A block's time is measured with CUDA events on a GPU (``time.perf_counter``
after the block on CPU) and divided by its steps; the first ``warmup`` rounds
are dropped; per mode the median over rounds is reported, with the peak memory
allocated during its blocks (``torch.cuda.max_memory_allocated``, reset before
each block). Overhead = (median instrumented − median plain) / median plain.

On CPU the same code runs under the test suite's CUDA-to-CPU shim (see
``tests/test_gpu_check.py``); the numbers only mean something on a GPU.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Callable, Iterator, Optional

import torch

from twinkle_megatron.ops.kernel_select import ENV_KERNEL

MODES = ("plain", "instrumented (torch)", "instrumented (triton)", "instrumented (fused loss)")
# Per instrumented mode: the statistics' local pass forced through the environment (None: as it is), fused_loss.
MODE_SETTINGS = {"instrumented (torch)": ("torch", False), "instrumented (triton)": ("triton", False),
                 "instrumented (fused loss)": (None, True)}


@dataclass(frozen=True)
class StepSpec:
    """The model and the step; the defaults are the GPU measurement (hidden >= 2048, as the goal asks)."""

    hidden_size: int = 2048
    layers: int = 4
    heads: int = 16
    seq_length: int = 2048
    micro_batch_size: int = 2
    microbatches: int = 4
    vocab_size: int = 32000
    steps_per_block: int = 4
    rounds: int = 6
    warmup: int = 1
    te: bool = True
    modes: tuple = MODES

    @property
    def padded_vocab_size(self) -> int:
        return -(-self.vocab_size // 128) * 128  # Megatron-LM pads to a multiple of 128 (x TP)


@dataclass
class ModeResult:
    mode: str
    step_seconds: list = field(default_factory=list)  # one per measured round (per step)
    peak_allocated: Optional[int] = None
    metrics: dict = field(default_factory=dict)  # the last calculate() of an instrumented mode

    @property
    def median(self) -> float:
        return statistics.median(self.step_seconds)


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Megatron-LM's per-token loss: ``(loss_sum, num_tokens, {'lm loss': [sum, count]})``."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])


def layer_spec(te: bool):
    """TE's layer spec when asked for and TE imports (a broken TE raises more than ImportError)."""
    if te:
        try:
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

            return get_gpt_layer_with_transformer_engine_spec(), True
        except (ImportError, RuntimeError, OSError, AssertionError):
            pass
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(), False


def build(spec: StepSpec, device: torch.device):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    cpu = device.type == "cpu"
    dtype = torch.float32 if cpu else torch.bfloat16
    config = TransformerConfig(num_layers=spec.layers, hidden_size=spec.hidden_size,
                               num_attention_heads=spec.heads, use_cpu_initialization=cpu, params_dtype=dtype,
                               pipeline_dtype=dtype, bf16=not cpu, hidden_dropout=0.0, attention_dropout=0.0,
                               calculate_per_token_loss=True)
    model_parallel_cuda_manual_seed(1234, **({"inference_rng_tracker": True} if cpu else {}))
    layers, used_te = layer_spec(spec.te and not cpu)
    model = GPTModel(config=config, transformer_layer_spec=layers, vocab_size=spec.padded_vocab_size,
                     max_sequence_length=spec.seq_length, position_embedding_type="learned_absolute",
                     share_embeddings_and_output_weights=False).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, optimizer, used_te


def microbatches(spec: StepSpec, device: torch.device, generator: torch.Generator) -> list:
    out = []
    for _ in range(spec.microbatches):
        tokens = torch.randint(0, spec.vocab_size, (spec.micro_batch_size, spec.seq_length + 1),
                               generator=generator)
        out.append({"tokens": tokens[:, :-1].to(device), "labels": tokens[:, 1:].to(device),
                    "loss_mask": torch.ones(spec.micro_batch_size, spec.seq_length, device=device),
                    "position_ids": torch.arange(spec.seq_length, device=device).expand(spec.micro_batch_size, -1)})
    return out


@contextlib.contextmanager
def kernel_choice(kernel: Optional[str]) -> Iterator[None]:
    """Force the token statistics' local pass for the block (None: leave the environment as it is)."""
    saved = os.environ.get(ENV_KERNEL)
    if kernel is not None:
        os.environ[ENV_KERNEL] = kernel
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(ENV_KERNEL, None)
        else:
            os.environ[ENV_KERNEL] = saved


class BlockTimer:
    """Seconds of a block: CUDA events on a GPU (read after the block), perf_counter on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    @contextlib.contextmanager
    def measure(self, out: list) -> Iterator[None]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / 1e3)
        else:
            begin = time.perf_counter()
            yield
            out.append(time.perf_counter() - begin)


def seconds_per_call(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Mean seconds per call of ``fn`` over ``repeats`` calls timed as one block (:class:`BlockTimer`)."""
    seconds: list = []
    with BlockTimer(device).measure(seconds):
        for _ in range(repeats):
            fn()
    return seconds[0] / repeats


def measure(spec: StepSpec, device: torch.device,
            on_round: Optional[Callable[[int], None]] = None) -> tuple[dict[str, ModeResult], dict]:
    """Run the interleaved blocks; returns per-mode results and facts about the setup."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from twinkle_megatron import Accuracy, TokenStatsMetric
    from twinkle_megatron.megatron import instrument

    model, optimizer, used_te = build(spec, device)
    schedule = get_forward_backward_func()
    generator = torch.Generator().manual_seed(0)
    timer = BlockTimer(device)
    results = {mode: ModeResult(mode) for mode in spec.modes}
    for round_index in range(spec.warmup + spec.rounds):
        # Rotate the order so that no mode always runs right after another.
        order = spec.modes[round_index % len(spec.modes):] + spec.modes[:round_index % len(spec.modes)]
        for mode in order:
            data = [microbatches(spec, device, generator) for _ in range(spec.steps_per_block)]
            instrumented = mode != "plain"
            kernel, fused = MODE_SETTINGS.get(mode, (None, False))
            metrics = instrument(model, [Accuracy(vocab_size=spec.vocab_size),
                                         TokenStatsMetric(vocab_size=spec.vocab_size)],
                                 fused_loss=fused) if instrumented else None
            step = metrics.wrap(forward_step) if instrumented else forward_step
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            seconds: list = []
            with kernel_choice(kernel), timer.measure(seconds):
                for batch in data:
                    optimizer.zero_grad(set_to_none=True)
                    schedule(forward_step_func=step, data_iterator=iter(batch), model=model,
                             num_microbatches=spec.microbatches, seq_length=spec.seq_length,
                             micro_batch_size=spec.micro_batch_size, forward_only=False)
                    optimizer.step()
                if instrumented:
                    values = metrics.calculate()
            if instrumented:
                metrics.detach()
                results[mode].metrics = values
            if round_index >= spec.warmup:
                results[mode].step_seconds.append(seconds[0] / spec.steps_per_block)
                if device.type == "cuda":
                    peak = torch.cuda.max_memory_allocated(device)
                    results[mode].peak_allocated = max(results[mode].peak_allocated or 0, peak)
        if on_round is not None:
            on_round(round_index)
    params = sum(p.numel() for p in model.parameters())
    setup = {"spec": asdict(spec), "transformer_engine": used_te, "parameters": params,
             "tokens_per_step": spec.micro_batch_size * spec.seq_length * spec.microbatches}
    return results, setup


def overhead(results: dict[str, ModeResult], mode: str) -> Optional[float]:
    """(median instrumented − median plain) / median plain, or None when a mode is missing."""
    if "plain" not in results or mode not in results or not results[mode].step_seconds:
        return None
    plain = results["plain"].median
    return (results[mode].median - plain) / plain
