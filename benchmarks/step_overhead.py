"""The plugin's cost in a real megatron-core training step: the same steps with and without ``instrument()``.

The one step-overhead harness. ``make bench`` runs it on two forked CPU ranks (``bench_step_overhead.py``:
TP2 and DP2, hidden 256), ``make gpu-check`` on one GPU (``gpu_timings.py``: hidden 2048, the defaults of
:class:`StepSpec`). It runs on the megatron-core ``parallel_state`` its caller initialised.

Each rank: a ``GPTModel`` (Transformer Engine layers when ``te`` and TE imports, else Megatron's local
layers; bf16 on a GPU, fp32 on CPU) in Megatron's DDP, Megatron's Adam (``get_megatron_optimizer``),
Megatron-LM's ``forward_step`` / per-token ``loss_func`` and the schedule from
``get_forward_backward_func()``. Modes (:data:`MODES`), each a block of ``steps_per_block`` steps:

* ``plain``: the step as Megatron-LM writes it;
* ``plugin``: ``instrument(model, vocab_size=...)`` (accuracy, log-prob, entropy, loss),
  ``metrics.wrap(forward_step)``, one ``calculate()`` per block (what a tracker does once per log interval);
* ``plugin (torch)`` / ``plugin (triton)``: the same with the token statistics' local pass forced to the
  torch loop or the Triton kernel through ``TWINKLE_MEGATRON_TOKEN_STATS_KERNEL``;
* ``plugin + tracker``: the same inside ``MetricsTracker.step()`` (``log_interval`` = the block, no backend);
* ``fused loss``: ``instrument(..., fused_loss=True)``: the model's loss and the statistics from one pass;
* ``fused loss + tracker``.

The modes take turns in every round, in a rotating order (no mode always runs right after another); the
first ``warmup`` rounds are dropped. Each round gives every mode's block time divided by the ``plain``
block's time *of the same round*; a mode's overhead is the median of those ratios, minus 1
(:func:`overhead`). Two clocks, each the slowest rank's (a barrier before each block, a MAX all-reduce
after it): the main clock -- CUDA events on a GPU; on CPU the process's CPU time (``time.process_time``,
one torch thread per rank: the work done, which load from other processes on a shared machine barely
changes) -- and the wall clock (``time.perf_counter``; on a contended machine it mostly measures the other
processes). On a GPU the peak memory allocated during a mode's blocks is kept too
(``torch.cuda.max_memory_allocated``, reset before each block).

On CPU megatron-core needs the CUDA-to-CPU shim (``twinkle_megatron.testing.cuda_shim``); the CPU
numbers measure the CPU path (exp-bound), a GPU's are the ones the overhead goal speaks of.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

from twinkle_megatron.ops.kernel_select import ENV_KERNEL

PLAIN = "plain"


@dataclass(frozen=True)
class Mode:
    """How a mode runs the step: with ``instrument()`` or not, the statistics' local pass forced (None: as the
    environment says), the fused loss, the tracker around each step."""

    instrumented: bool = True
    kernel: Optional[str] = None
    fused_loss: bool = False
    tracker: bool = False


MODES = {
    PLAIN: Mode(instrumented=False),
    "plugin": Mode(),
    "plugin (torch)": Mode(kernel="torch"),
    "plugin (triton)": Mode(kernel="triton"),
    "plugin + tracker": Mode(tracker=True),
    "fused loss": Mode(fused_loss=True),
    "fused loss + tracker": Mode(fused_loss=True, tracker=True),
}
GPU_MODES = (PLAIN, "plugin (torch)", "plugin (triton)", "fused loss")  # the kernel against the torch loop
CPU_MODES = (PLAIN, "plugin", "plugin + tracker", "fused loss", "fused loss + tracker")  # make bench


@dataclass(frozen=True)
class StepSpec:
    """The model, the step and the rounds; the defaults are the GPU measurement (hidden >= 2048, as the goal
    asks). ``modes``: names of :data:`MODES`, ``plain`` among them."""

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
    modes: tuple = GPU_MODES

    def padded_vocab_size(self, tp: int) -> int:
        """Megatron-LM pads the vocabulary to a multiple of 128 × TP."""
        multiple = 128 * tp
        return -(-self.vocab_size // multiple) * multiple


@dataclass
class ModeResult:
    mode: str
    step_seconds: list = field(default_factory=list)  # per measured round: seconds per step, main clock
    ratios: list = field(default_factory=list)  # per measured round: block / plain block, main clock
    wall_ratios: list = field(default_factory=list)  # the same on the wall clock
    peak_allocated: Optional[int] = None  # bytes, on a GPU
    metrics: dict = field(default_factory=dict)  # the last calculate() of an instrumented mode

    @property
    def median(self) -> float:
        """Median seconds per step (main clock)."""
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
    """The model in Megatron's DDP, its config, Megatron's Adam, and whether TE layers are used."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    cpu = device.type == "cpu"
    dtype = torch.float32 if cpu else torch.bfloat16
    tp = parallel_state.get_tensor_model_parallel_world_size()
    config = TransformerConfig(num_layers=spec.layers, hidden_size=spec.hidden_size, num_attention_heads=spec.heads,
                               tensor_model_parallel_size=tp, use_cpu_initialization=cpu, params_dtype=dtype,
                               pipeline_dtype=dtype, bf16=not cpu, hidden_dropout=0.0, attention_dropout=0.0,
                               calculate_per_token_loss=True)
    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234, **({"inference_rng_tracker": True} if cpu else {}))
    layers, used_te = layer_spec(spec.te and not cpu)
    model = GPTModel(config=config, transformer_layer_spec=layers, vocab_size=spec.padded_vocab_size(tp),
                     max_sequence_length=spec.seq_length, position_embedding_type="learned_absolute",
                     share_embeddings_and_output_weights=False).to(device)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    config.finalize_model_grads_func = finalize_model_grads
    options = {}
    if "use_gloo_process_groups" in inspect.signature(get_megatron_optimizer).parameters:
        options["use_gloo_process_groups"] = False  # gloo groups serve only distributed-optimizer checkpoints
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-4, clip_grad=0.0, bf16=not cpu,
                                                       params_dtype=dtype), [ddp], **options)
    return ddp, config, optimizer, used_te


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


class _Block:
    """One mode's block of steps: the schedule with the mode's ``forward_step``, its tracker, its metrics."""

    def __init__(self, mode: Mode, spec: StepSpec, ddp, config, optimizer) -> None:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from twinkle_megatron import MetricsTracker, TrackerConfig
        from twinkle_megatron.megatron import instrument

        self.spec, self.ddp, self.optimizer = spec, ddp, optimizer
        self.schedule = get_forward_backward_func()
        self.metrics = instrument(ddp, vocab_size=spec.vocab_size, fused_loss=mode.fused_loss) \
            if mode.instrumented else None
        self.tracker = MetricsTracker(config=TrackerConfig(log_interval=spec.steps_per_block, backends=()),
                                      metrics=self.metrics.metrics) if mode.tracker else None
        self.step_func = self.metrics.wrap(forward_step) if self.metrics is not None else forward_step

    def one_step(self, batches: list):
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        self.schedule(forward_step_func=self.step_func, data_iterator=iter(batches), model=self.ddp,
                      num_microbatches=len(batches), seq_length=self.spec.seq_length,
                      micro_batch_size=self.spec.micro_batch_size, forward_only=False)
        return self.optimizer.step()  # (update successful, grad norm, zeros in the grads)

    def run(self, data: list) -> dict:
        """Every step of the block, then the interval's ``calculate()`` (the tracker's own, with a tracker)."""
        values: dict = {}
        for index, batches in enumerate(data):
            if self.tracker is not None:
                with self.tracker.step(index + 1) as record:
                    _, grad_norm, _ = self.one_step(batches)
                    record.update(grad_norm=grad_norm, lr=1e-4, tokens=sum(b["loss_mask"].sum() for b in batches))
            else:
                self.one_step(batches)
        if self.metrics is not None and self.tracker is None:
            values = self.metrics.calculate()
        return values

    def close(self) -> None:
        if self.tracker is not None:
            self.tracker.close()
        if self.metrics is not None:
            self.metrics.detach()


def _slowest(seconds: list[float], device: torch.device) -> list[float]:
    """Each clock's time of the slowest rank (MAX over the world; as given in a single process)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return seconds
    times = torch.tensor(seconds, dtype=torch.float64, device=device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return times.tolist()


def measure(spec: StepSpec, device: torch.device,
            on_round: Optional[Callable[[int], None]] = None) -> tuple[dict[str, ModeResult], dict]:
    """Run the interleaved blocks; returns per-mode results and facts about the setup."""
    if PLAIN not in spec.modes:
        raise ValueError(f"modes {spec.modes} need {PLAIN!r}: every ratio is to the plain block of its round")
    ddp, config, optimizer, used_te = build(spec, device)
    generator = torch.Generator().manual_seed(0)
    timer = BlockTimer(device)
    cuda = device.type == "cuda"
    results = {mode: ModeResult(mode) for mode in spec.modes}
    for round_index in range(spec.warmup + spec.rounds):
        order = spec.modes[round_index % len(spec.modes):] + spec.modes[:round_index % len(spec.modes)]
        blocks: dict[str, list[float]] = {}
        for mode in order:
            data = [microbatches(spec, device, generator) for _ in range(spec.steps_per_block)]
            block = _Block(MODES[mode], spec, ddp, config, optimizer)
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            if dist.is_initialized():
                dist.barrier()
            main: list = []
            wall_begin, cpu_begin = time.perf_counter(), time.process_time()
            with kernel_choice(MODES[mode].kernel), timer.measure(main):
                values = block.run(data)
            wall, cpu = time.perf_counter() - wall_begin, time.process_time() - cpu_begin
            block.close()
            results[mode].metrics = values
            blocks[mode] = _slowest([main[0] if cuda else cpu, wall], device)
            if cuda and round_index >= spec.warmup:
                peak = torch.cuda.max_memory_allocated(device)
                results[mode].peak_allocated = max(results[mode].peak_allocated or 0, peak)
        if round_index >= spec.warmup:
            for mode, (seconds, wall) in blocks.items():
                results[mode].step_seconds.append(seconds / spec.steps_per_block)
                results[mode].ratios.append(seconds / blocks[PLAIN][0])
                results[mode].wall_ratios.append(wall / blocks[PLAIN][1])
        if on_round is not None:
            on_round(round_index)
    params = sum(p.numel() for p in ddp.module.parameters())
    setup = {"spec": asdict(spec), "transformer_engine": used_te, "parameters": params,
             "tokens_per_step": spec.micro_batch_size * spec.seq_length * spec.microbatches}
    return results, setup


def overhead(results: dict[str, ModeResult], mode: str) -> Optional[float]:
    """Median over rounds of (block / plain block of the same round) − 1 on the main clock, or None when a mode
    is missing."""
    if PLAIN not in results or mode not in results or not results[mode].ratios:
        return None
    return statistics.median(results[mode].ratios) - 1.0
