"""Train a small megatron-core GPT with twinkle-megatron's metrics: the demo `make demo` runs.

Everything here is ordinary megatron-core: ``parallel_state``, a ``GPTModel``
per virtual pipeline stage, Megatron's DDP and optimizer, the pipeline schedule
from ``get_forward_backward_func()``, and a ``forward_step`` / ``loss_func``
pair written the way Megatron-LM's ``pretrain_gpt.py`` writes them. The plugin
adds three things, marked ``# <- plugin``:

- ``instrument(model)`` and ``metrics.wrap(forward_step)``: token accuracy,
  label log-probability and entropy from the vocab-parallel logits (never
  gathered), per microbatch on the last stage, no host sync;
- ``MetricsTracker``: loss (Megatron's ``[sum, count]`` reports), tokens/s,
  step time across ranks (slowest rank), FLOPs/MFU and memory on GPUs, EMAs
  and anomaly counts, all reduced with the metrics in one sync per log step,
  written to stdout, ``RUN_DIR/metrics.jsonl`` and TensorBoard when installed.

The task is synthetic and learnable (each sequence counts up from a random start
by a random stride, modulo the vocabulary): the loss falls and the accuracy rises
within a few dozen steps. Two corpora, an easy one (stride 1) and a hard one
(strides 1–5, a fifth of the targets random), are blended 50/50 by megatron-core's
own ``BlendedDataset``, whose samples carry a ``dataset_id``: the metrics are
logged per corpus too (``loss/easy``, ``loss/hard``, ``accuracy/hard``...), where
the harder corpus stays higher.

The data of a step is a pure function of ``(seed, step, microbatch, DP rank)``,
so a run resumed from a checkpoint sees exactly what an uninterrupted run saw.

CPU (gloo; megatron-core's CUDA calls are redirected by the CUDA-to-CPU shim
``twinkle_megatron.testing.cuda_shim``), either as ranks forked by this script or under torchrun::

    python examples/train_gpt.py                       # TP2 × PP2 × DP2 on 8 forked ranks
    python examples/train_gpt.py --vpp 2 --steps 60    # the interleaved schedule
    python examples/train_gpt.py --tp 1 --ep 2 --moe-experts 4 --moe-topk 2   # MoE layers, routing health
    torchrun --nproc-per-node 4 examples/train_gpt.py --device cpu --tp 2 --pp 2

GPUs (one process per GPU, NCCL, bf16; see examples/slurm/ for several nodes)::

    torchrun --nproc-per-node 8 examples/train_gpt.py --tp 2 --pp 2

MoE (``--moe-experts N --moe-topk K``, ``--ep`` for expert parallelism): every
layer's MLP becomes N experts behind megatron-core's ``TopKRouter`` (aux and z
losses on); ``instrument()`` then also logs routing health (``moe/...``: expert
utilisation, dead experts, imbalance across layers, routing entropy, Megatron's
router losses), with the per-layer keys the expert-load heat map of
``twinkle-megatron plot`` reads.

Preemption: SIGUSR1 or SIGTERM makes every rank finish its current step, save a
checkpoint of that step and exit with status 0; ``--resume`` continues from it
(``examples/slurm/train.sbatch`` does both). Flags are checked before any rank
starts: a layout or size that cannot work, or a logging backend that is unknown or
not installed, exits with status 2 and one message.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import math
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import warnings
from datetime import timedelta
from functools import partial
from typing import Any, Optional

# SIGUSR1 / SIGTERM (Slurm's time-limit warning, preemption) may come while torch imports, which takes
# seconds: record them from here on (when run as a script); StopRequest reads them at the end of each step.
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
_received_signals: list[int] = []


def _record_stop_signal(signum: int, frame) -> None:
    _received_signals.append(signum)


if __name__ == "__main__":
    for _stop_signal in STOP_SIGNALS:
        signal.signal(_stop_signal, _record_stop_signal)


def _missing(package: str, error: ImportError) -> None:
    """A missing environment in one line (the job runs with the submitting shell's), exit status 2."""
    print(f"train_gpt.py: error: {sys.executable} cannot import {package} ({error}); activate the environment "
          "that has twinkle-megatron and megatron-core installed (make setup, or pip install -e .)", file=sys.stderr)
    sys.exit(2)


try:  # after the signal handlers, on purpose
    import torch
    import torch.distributed as dist
except ImportError as _error:
    _missing("torch", _error)


# ------------------------------------------------------------------ Megatron-LM's forward_step


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Megatron-LM's per-token loss: ``(loss_sum, num_tokens, {'lm loss': [sum, count]})``."""
    losses = output_tensor.float().view(-1)
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    output_tensor = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output_tensor, partial(loss_func, batch["loss_mask"])


# ------------------------------------------------------------------ data and model


# The two corpora of the blend: one easy (stride 1), one hard (strides 1-5 and a fifth of the targets random,
# so its loss cannot fall as far). Per-dataset metrics show them apart where the blended loss averages them.
CORPORA = {"easy": (1, 0.0), "hard": (5, 0.2)}  # name: (largest stride, share of random targets)


def counting_sequence(args: argparse.Namespace, corpus: str, index: int) -> dict:
    """Sample ``index`` of ``corpus``: ``start + stride·i (mod vocab)``, some targets random; the first one masked.

    A pure function of ``(seed, corpus, index)``, so a resumed run sees what an uninterrupted one saw.
    """
    largest_stride, noise = CORPORA[corpus]
    key = f"{args.seed}/{corpus}/{index}".encode()
    generator = torch.Generator().manual_seed(int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little"))
    start = torch.randint(0, args.vocab_size, (1,), generator=generator)
    stride = torch.randint(1, largest_stride + 1, (1,), generator=generator)
    stream = (start + stride * torch.arange(args.seq_length + 1)) % args.vocab_size
    random_targets = torch.rand(args.seq_length + 1, generator=generator) < noise
    stream = torch.where(random_targets, torch.randint(0, args.vocab_size, stream.shape, generator=generator), stream)
    loss_mask = torch.ones(args.seq_length)
    loss_mask[:1] = 0  # the stride is unknowable from one token
    return {"tokens": stream[:-1], "labels": stream[1:], "loss_mask": loss_mask}


def blended_dataset(args: argparse.Namespace, samples: int):
    """The corpora blended 50/50 by megatron-core's own ``BlendedDataset``: each sample carries its ``dataset_id``."""
    import numpy
    from megatron.core.datasets.blended_dataset import BlendedDataset
    from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
    from megatron.core.datasets.megatron_dataset import MegatronDataset
    from megatron.core.datasets.utils import Split

    class Corpus(MegatronDataset):
        """One synthetic corpus as megatron-core's mid-level dataset (what a GPTDataset is for real data)."""

        @staticmethod
        def numel_low_level_dataset(low_level_dataset: Any) -> int:
            return samples

        @staticmethod
        def build_low_level_dataset(dataset_path: str, config: Any) -> Any:
            return dataset_path

        def __len__(self) -> int:
            return samples

        def __getitem__(self, index: int) -> dict:
            return counting_sequence(args, self.dataset, int(index))

    config = BlendedMegatronDatasetConfig(random_seed=args.seed, sequence_length=args.seq_length, split="1,0,0",
                                          tokenizer=None)
    corpora = [Corpus(name, name, numpy.arange(samples), samples, Split.train, config) for name in CORPORA]
    return BlendedDataset(corpora, [1.0 / len(corpora)] * len(corpora), samples, config)


def blended_batch(args: argparse.Namespace, blend, step: int, microbatch: int, dp_rank: int, dp_size: int) -> dict:
    """Microbatch ``microbatch`` of data-parallel rank ``dp_rank`` at ``step``: consecutive samples of the blend
    (Megatron-LM's pretraining sampler), stacked, with each sample's ``dataset_id``."""
    first = (((step - 1) * args.microbatches + microbatch) * dp_size + dp_rank) * args.micro_batch_size
    samples = [health_checked(args, first + i, blend[first + i]) for i in range(args.micro_batch_size)]
    batch = {key: torch.stack([sample[key] for sample in samples]) for key in ("tokens", "labels", "loss_mask")}
    batch["dataset_id"] = torch.tensor([int(sample["dataset_id"]) for sample in samples])
    batch["sample_index"] = torch.arange(first, first + args.micro_batch_size)  # for the incidents' top samples
    batch["position_ids"] = torch.arange(args.seq_length).expand(args.micro_batch_size, -1)
    return batch


def planted_sample(args: argparse.Namespace) -> Optional[int]:
    """The global index of the bad sample ``--plant-bad-sample STEP`` plants: the middle of that step's batch."""
    if not args.plant_bad_sample:
        return None
    global_batch_size = args.micro_batch_size * args.microbatches * args.dp
    return (args.plant_bad_sample - 1) * global_batch_size + global_batch_size // 2


def health_checked(args: argparse.Namespace, index: int, sample: dict) -> dict:
    """Sample ``index`` of the blend, made bad when it is the planted one (every label moved half the vocabulary
    away from the next count: confidently wrong, a loss spike), and left out of the loss (a zero loss mask) when
    ``--skip-samples`` lists it."""
    if getattr(args, "plant_bad_sample", 0) and index == planted_sample(args):
        sample = {**sample, "labels": (sample["labels"] + args.vocab_size // 2) % args.vocab_size}
    if index in getattr(args, "skipped_samples", ()):
        sample = {**sample, "loss_mask": torch.zeros_like(sample["loss_mask"])}
    return sample


def this_cp_rank(tensor: torch.Tensor) -> torch.Tensor:
    """This context-parallel rank's part of ``[b, s]``: chunks ``i`` and ``2·cp−1−i`` of ``2·cp``
    (Megatron-LM's ``get_batch_on_this_cp_rank``, balancing causal attention work)."""
    from megatron.core import parallel_state as ps

    cp, rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    if cp == 1 or tensor.dim() == 1:  # per-sample entries (dataset_id) have no sequence to split
        return tensor
    chunks = tensor.chunk(2 * cp, dim=1)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=1)


def transformer_layer_spec(use_te: bool, num_experts: Optional[int] = None):
    """Transformer Engine layers on GPUs when TE imports, Megatron's local layers otherwise (MoE MLPs with
    ``num_experts``)."""
    if use_te:
        try:
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

            return get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts)
        except (ImportError, RuntimeError, OSError, AssertionError):
            pass
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False)


def moe_config_kwargs(args: argparse.Namespace, cpu: bool) -> dict:
    """TransformerConfig fields of the MoE variant (``--moe-experts``): none for the dense model."""
    if not args.moe_experts:
        return {}
    from twinkle_megatron.testing.router_without_te import allow_router_without_te

    allow_router_without_te()  # megatron-core 0.16's router without Transformer Engine (see that module)
    return dict(
        num_moe_experts=args.moe_experts, moe_router_topk=args.moe_topk, expert_model_parallel_size=args.ep,
        # The all-to-all dispatcher needs CUDA (its split sizes become lists only from CUDA tensors).
        moe_token_dispatcher_type="allgather" if cpu else "alltoall",
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3,
        # Megatron trains MoE layers under TP only with sequence parallelism (TE's norms on GPUs).
        sequence_parallel=args.tp > 1,
        # megatron-core 0.16's local expert MLP adds its bias in place to a custom autograd function's view.
        add_bias_linear=False,
    )


def build_model(args: argparse.Namespace, device: torch.device):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    cpu = device.type == "cpu"
    dtype = torch.float32 if cpu else torch.bfloat16
    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden_size, num_attention_heads=args.heads,
        tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
        virtual_pipeline_model_parallel_size=args.vpp, context_parallel_size=args.cp, use_cpu_initialization=cpu,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=not cpu,
        hidden_dropout=0.0, attention_dropout=0.0, calculate_per_token_loss=True,
        batch_p2p_comm=args.vpp is None,  # the interleaved schedule with batched p2p is wrong on gloo
        **moe_config_kwargs(args, cpu),
    )
    # Megatron-LM's seeding: the CPU generator (which initialises the weights with use_cpu_initialization)
    # per pipeline stage, the same on the TP ranks that split one master weight; CUDA's per TP rank.
    torch.manual_seed(args.seed + 100 * ps.get_pipeline_model_parallel_rank())
    model_parallel_cuda_manual_seed(args.seed, **({"inference_rng_tracker": True} if cpu else {}))
    layer_spec = transformer_layer_spec(use_te=not cpu, num_experts=args.moe_experts or None)
    chunks = []
    for stage in range(args.vpp or 1):
        vp_stage = stage if args.vpp else None
        model = GPTModel(
            config=config, transformer_layer_spec=layer_spec, vocab_size=args.padded_vocab_size,
            max_sequence_length=args.seq_length, position_embedding_type="learned_absolute",
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            share_embeddings_and_output_weights=False, vp_stage=vp_stage,
        ).to(device)
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False)
        chunks.append(DistributedDataParallel(config, ddp_config, model))
    config.finalize_model_grads_func = finalize_model_grads
    return chunks, config


# ------------------------------------------------------------------ the loop


def train(args: argparse.Namespace, device: torch.device) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from twinkle_megatron import Accuracy, LossMetric, MetricsTracker, TokenStatsMetric, TrackerConfig
    from twinkle_megatron.logging import record_rank_hosts
    from twinkle_megatron.megatron import instrument
    from twinkle_megatron.metric import SampleLosses
    from twinkle_megatron.tracker.incidents import read_skip_list

    args.skipped_samples = read_skip_list(args.skip_samples) if args.skip_samples else set()

    stop = StopRequest()
    ps.initialize_model_parallel(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
                                 virtual_pipeline_model_parallel_size=args.vpp, context_parallel_size=args.cp,
                                 expert_model_parallel_size=args.ep)
    chunks, config = build_model(args, device)
    optimizer = get_megatron_optimizer(
        # Megatron's gradient clipping asserts CUDA tensors: no clipping on CPU.
        OptimizerConfig(optimizer="adam", lr=args.lr, bf16=device.type != "cpu",
                        clip_grad=0.0 if device.type == "cpu" else 1.0), chunks)
    forward_backward = get_forward_backward_func()
    dp_rank = ps.get_data_parallel_rank()
    global_batch_size = args.micro_batch_size * args.microbatches * ps.get_data_parallel_world_size()

    log_path = os.path.join(args.run_dir, "metrics.jsonl")
    if not args.resume and dist.get_rank() == 0 and os.path.exists(log_path):
        os.remove(log_path)  # a fresh run, not one appended to an older run's log
    dist.barrier()
    # Which host each rank runs on (LOG_DIR/hosts.json, once per start): `twinkle-megatron summary` then names
    # the node of the slowest rank, not only its number.
    record_rank_hosts(args.run_dir)                                                      # <- plugin
    # instrument() computes what needs the logits, and the loss, over the blend and per corpus (each sample's
    # dataset_id read as the schedule pulls its batch); with MoE layers routing health too (per layer here: a
    # small model, and the heat map of `plot` reads them); and by token position (four buckets over the sequence:
    # `plot` draws the loss by position, to see whether late positions learn).
    corpora = {"group_names": list(CORPORA), "position_buckets": min(4, args.seq_length), "seq_length": args.seq_length}
    metrics = instrument(chunks, [Accuracy(vocab_size=args.vocab_size, **corpora),      # <- plugin
                                  TokenStatsMetric(vocab_size=args.vocab_size, **corpora), LossMetric(**corpora),
                                  SampleLosses(dataset_names=list(CORPORA))],  # top samples for incidents
                         moe_per_layer=bool(args.moe_experts))
    tracker = MetricsTracker(config=TrackerConfig(                                       # <- plugin
        log_interval=args.log_interval, model_config=config, padded_vocab_size=args.padded_vocab_size,
        seq_length=args.seq_length, global_batch_size=global_batch_size, backends=console_backends(args),
        log_dir=args.run_dir, spike_threshold=args.spike_threshold), metrics=metrics.metrics)
    first_step = load_checkpoint(args, chunks, optimizer, tracker) + 1 if args.resume else 1
    blend = blended_dataset(args, args.steps * global_batch_size)

    step, stopped_by = first_step - 1, None
    for step in range(first_step, args.steps + 1):
        with tracker.step(step) as values:                                               # <- plugin
            microbatches = [blended_batch(args, blend, step, index, dp_rank, ps.get_data_parallel_world_size())
                            for index in range(args.microbatches)]
            microbatches = [{k: this_cp_rank(v).to(device) for k, v in mb.items()} for mb in microbatches]
            for chunk in chunks:
                chunk.zero_grad_buffer()
            optimizer.zero_grad()
            forward_backward(
                forward_step_func=metrics.wrap(forward_step),                            # <- plugin
                data_iterator=[iter(microbatches) for _ in chunks] if args.vpp else iter(microbatches),
                model=chunks if args.vpp else chunks[0], num_microbatches=args.microbatches,
                seq_length=args.seq_length, micro_batch_size=args.micro_batch_size, forward_only=False)
            if args.layer_norms:  # after the gradient reduction, before the step clips them
                tracker.record_grad_norms(chunks, optimizer)                             # <- plugin
            update_successful, grad_norm, _ = optimizer.step()
            # The loss comes from instrument()'s LossMetric (per corpus too, its non-finite losses counted in the
            # tracker's train/nonfinite_loss_steps); the tokens from the loss masks; a step the optimizer skipped
            # (fp16/bf16 loss scaling) in train/skipped_steps.
            values.update(grad_norm=grad_norm, lr=optimizer.param_groups[0]["lr"], update_successful=update_successful,
                          tokens=sum(mb["loss_mask"].sum() for mb in microbatches))
            if args.moe_experts:
                # Megatron-LM's training_log reduces and clears megatron-core's aux-loss tracker every iteration
                # (track_moe_metrics); a loop of its own clears it (the plugin only reads what each call adds).
                from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

                clear_aux_losses_tracker()
        stopped_by = stop.agreed()
        if stopped_by is None and args.save_interval and step % args.save_interval == 0:
            save_checkpoint(args, chunks, optimizer, tracker, step)
        if stopped_by is not None:
            break
    # close() first: it logs a partial last interval, whose counts the checkpoint must then hold.
    tracker.close()
    metrics.detach()
    if stopped_by is not None:
        save_checkpoint(args, chunks, optimizer, tracker, step)
        if dist.get_rank() == 0:
            print(f"[train] {stopped_by} received: stopped after step {step} of {args.steps} and saved a "
                  f"checkpoint; --resume continues from step {step + 1}", flush=True)
        return
    if dist.get_rank() == 0:
        from twinkle_megatron.cli import format_summary
        from twinkle_megatron.logging.runlog import load_run

        print("\n" + format_summary(load_run(log_path)), flush=True)


def console_backends(args: argparse.Namespace) -> list:
    """``--backends`` with ``stdout`` as ``--stdout`` asks: compact (plus each corpus's accuracy) or full."""
    from twinkle_megatron.logging import StdoutBackend

    per_corpus = [f"accuracy/{name}" for name in CORPORA]
    return [StdoutBackend(detail=args.stdout, extra_keys=per_corpus) if name == "stdout" else name
            for name in args.backends]


def quiet_megatron() -> None:
    """Keep megatron-core's warnings and log messages off the demo's console (this script only).

    On a CPU without Apex or Transformer Engine megatron-core warns once per rank and model chunk
    about what it falls back to (Apex norms, CUDA-graph scopes) and logs that the blend's indexes
    are not cached: two dozen lines before the first metric. Its errors still show; a library
    user's filters are untouched, since only this script calls this (``--megatron-warnings``
    shows everything).
    """
    import logging

    warnings.filterwarnings("ignore", module=r"megatron\.core(\.|$)")
    logging.getLogger("megatron.core").setLevel(logging.ERROR)


class StopRequest:
    """SIGUSR1 / SIGTERM ask the loop to stop after the current step (Slurm's time-limit warning, preemption).

    The signal handler only records the signal. At the end of every step the ranks agree on
    whether any of them received one (a MAX all-reduce of one integer over a gloo group: no
    device sync), so that all stop after the same step even when the signal reached them at
    different moments (like Megatron-LM's ``--exit-signal-handler``, which gathers the flags every step).
    """

    def __init__(self) -> None:
        if __name__ != "__main__":  # imported (tests): handle the signals only while training
            for signum in STOP_SIGNALS:
                signal.signal(signum, _record_stop_signal)
        self._group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")

    def agreed(self) -> Optional[str]:
        """The name of a signal some rank received (the same on every rank), or None. Collective."""
        flag = torch.tensor([_received_signals[0] if _received_signals else 0], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        signum = int(flag[0])
        return signal.Signals(signum).name if signum else None


# ------------------------------------------------------------------ checkpoints (resume after a requeue)


def _checkpoint_path(args: argparse.Namespace) -> str:
    return os.path.join(args.run_dir, "checkpoint", f"rank{dist.get_rank():05d}.pt")


def save_checkpoint(args: argparse.Namespace, chunks, optimizer, tracker, step: int) -> None:
    """Every rank saves its own shard (model chunks, optimizer, tracker) for a requeued job.

    Only tensors, numbers, strings and containers of them, so that :func:`load_checkpoint`
    can read it with ``weights_only=True``. Written to a temporary file and renamed: a job
    killed while saving leaves the previous checkpoint intact.
    """
    path = _checkpoint_path(args)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save({"step": step, "model": [c.state_dict() for c in chunks], "optimizer": optimizer.state_dict(),
                "tracker": tracker.state_dict()}, path + ".tmp")
    os.replace(path + ".tmp", path)
    dist.barrier()


def load_checkpoint(args: argparse.Namespace, chunks, optimizer, tracker) -> int:
    """The step to continue after (0 when there is no checkpoint yet).

    ``weights_only=True``: unpickling runs no code, so a file planted in the run directory
    cannot execute anything on resume (it fails to load instead).
    """
    path = _checkpoint_path(args)
    if not os.path.exists(path):
        return 0
    state = torch.load(path, map_location="cpu", weights_only=True)
    for chunk, chunk_state in zip(chunks, state["model"]):
        chunk.load_state_dict(chunk_state)
    optimizer.load_state_dict(state["optimizer"])
    tracker.load_state_dict(state["tracker"])  # step numbering, totals, EMAs; logs drop later steps
    if dist.get_rank() == 0:
        print(f"resumed from step {state['step']} ({path})", flush=True)
    return int(state["step"])


# ------------------------------------------------------------------ flags


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every flag's default in its help; the description as written."""


def build_parser() -> argparse.ArgumentParser:
    """Every flag with its help and default (``--help``)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=_HelpFormatter)
    layout = parser.add_argument_group("parallel layout")
    layout.add_argument("--tp", type=int, default=2, help="tensor-parallel size")
    layout.add_argument("--pp", type=int, default=2, help="pipeline-parallel size")
    layout.add_argument("--dp", type=int, default=None,
                        help="data-parallel size (forked CPU ranks: None means 2; torchrun: world / TP·PP·CP)")
    layout.add_argument("--vpp", type=int, default=None,
                        help="virtual pipeline stages per rank (the interleaved schedule; None: not interleaved)")
    layout.add_argument("--cp", type=int, default=1, help="context-parallel size (needs Transformer Engine attention)")
    layout.add_argument("--ep", type=int, default=1, help="expert-parallel size (with --moe-experts)")
    layout.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: CUDA when available; cpu: gloo and the CPU shim, also under torchrun")
    training = parser.add_argument_group("training")
    training.add_argument("--steps", type=int, default=40, help="training steps")
    training.add_argument("--microbatches", type=int, default=4, help="microbatches per step and data-parallel rank")
    training.add_argument("--micro-batch-size", type=int, default=4, help="sequences per microbatch")
    training.add_argument("--lr", type=float, default=3e-3, help="Adam's learning rate (constant)")
    training.add_argument("--seed", type=int, default=1234, help="model initialisation and data")
    model = parser.add_argument_group("model")
    model.add_argument("--seq-length", type=int, default=32, help="tokens per sequence")
    model.add_argument("--vocab-size", type=int, default=61,
                       help="true vocabulary size (the model's is padded to a multiple of TP, plus TP)")
    model.add_argument("--layers", type=int, default=4, help="transformer layers (divisible by PP × VPP)")
    model.add_argument("--hidden-size", type=int, default=64, help="hidden size (divisible by --heads)")
    model.add_argument("--heads", type=int, default=4, help="attention heads (divisible by TP)")
    model.add_argument("--moe-experts", type=int, default=0,
                       help="experts per layer (0: dense MLPs); logs the moe/ routing-health keys")
    model.add_argument("--moe-topk", type=int, default=2, help="experts per token (with --moe-experts)")
    logging_ = parser.add_argument_group("logging and checkpoints")
    logging_.add_argument("--log-interval", type=int, default=5, help="a metrics record every N steps")
    logging_.add_argument("--run-name", default=os.environ.get("SLURM_JOB_NAME", "demo"),
                          help="the run's name and directory under --log-dir (default from $SLURM_JOB_NAME)")
    logging_.add_argument("--log-dir", default="runs", help="RUN_DIR is LOG_DIR/RUN_NAME")
    logging_.add_argument("--backends", nargs="+", default=None,
                          help="any of stdout jsonl tensorboard wandb swanlab mlflow (None: stdout jsonl, and "
                               "tensorboard when installed); an unknown one, or one whose package is not "
                               "installed, is refused before any rank starts")
    logging_.add_argument("--stdout", choices=("compact", "full"), default="compact",
                          help="the console's step line: compact (loss, accuracy per dataset, throughput, step "
                               "time) or full (every key but the per-layer ones); RUN_DIR/metrics.jsonl always has "
                               "every key")
    logging_.add_argument("--megatron-warnings", action="store_true",
                          help="show megatron-core's own warnings and log messages on the console (hidden by "
                               "default: on a CPU they are about Apex, TE and CUDA graphs the demo does not use)")
    logging_.add_argument("--save-interval", type=int, default=0,
                          help="checkpoint every N steps, a multiple of --log-interval (0: never; a stop signal "
                               "always saves)")
    logging_.add_argument("--resume", action="store_true", help="continue from RUN_DIR/checkpoint if present")
    health = parser.add_argument_group("step health (docs/step-health.md)")
    health.add_argument("--layer-norms", action="store_true", help="log per-layer gradient and parameter norms")
    health.add_argument("--plant-bad-sample", type=int, default=0, metavar="STEP",
                        help="corrupt one sample of STEP's batch: a loss spike, named in RUN_DIR/incidents.jsonl "
                             "(visible with a small batch and --log-interval 1; 0: none)")
    health.add_argument("--spike-threshold", type=float, default=0.5,
                        help="a loss spike (and an incident) is a loss above (1 + this) × its EMA")
    health.add_argument("--skip-samples", default=None, metavar="FILE",
                        help="leave these samples out of the loss: an incidents.jsonl (each incident's top sample) "
                             "or a text file of sample indices")
    parser.add_argument("--check-flags", action="store_true",
                        help="check the flags against the layout and the world (torchrun's WORLD_SIZE when set), "
                             "import the package of every --backends entry, and exit: 0 when they work, 2 with the "
                             "problems; --device auto counts as cuda (the GPU nodes', not this machine's). What "
                             "DRY_RUN=1 of examples/slurm/train.sbatch runs")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    """The flags, checked (:func:`flag_problems`): a usage error exits with status 2 before any rank starts."""
    parser = build_parser()
    args = parser.parse_args(argv)
    under_torchrun = "RANK" in os.environ
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if under_torchrun else None
    args.device = "cuda" if args.check_flags and args.device == "auto" else _device(args.device)
    if args.dp is None and not under_torchrun:
        args.dp = 2
    if args.backends is None:
        args.backends = ["stdout", "jsonl"]
        try:
            import tensorboard  # noqa: F401

            args.backends.append("tensorboard")
        except ImportError:
            pass
    problems = flag_problems(args, world_size)
    if problems:
        if int(os.environ.get("RANK", 0)) != 0:  # under torchrun rank 0 alone says it
            sys.exit(2)
        parser.error("; ".join(problems))
    if under_torchrun:
        args.dp = world_size // (args.tp * args.pp * args.cp)
    # Megatron-LM pads the vocabulary to a multiple of 128·TP; a multiple of TP is enough to show padding.
    args.padded_vocab_size = -(-args.vocab_size // args.tp) * args.tp + args.tp
    args.run_dir = os.path.join(args.log_dir, args.run_name)
    return args


def _device(choice: str) -> str:
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return choice


def flag_problems(args: argparse.Namespace, world_size: Optional[int] = None) -> list[str]:
    """What makes these flags impossible, each as a sentence naming the flags (empty when they work).

    ``world_size``: the ranks torchrun started (None when this script forks the ranks, from ``--dp``).
    The checks are Megatron's own (heads and layers divisible by TP, PP and VPP; microbatches by PP
    with VPP; the sequence by 2·CP) and this script's; the vocabulary needs none: it is padded to a
    multiple of TP. ``--backends`` must name backends whose packages are installed (:func:`backend_problems`).
    """
    problems = []
    at_least = {"steps": 1, "tp": 1, "pp": 1, "cp": 1, "log_interval": 1, "microbatches": 1,
                "micro_batch_size": 1, "seq_length": 2, "vocab_size": 2, "layers": 1, "hidden_size": 1, "heads": 1,
                "save_interval": 0, "moe_experts": 0, "moe_topk": 1, "ep": 1}
    if args.dp is not None:
        at_least["dp"] = 1
    if args.vpp is not None:
        at_least["vpp"] = 1
    for name, low in at_least.items():
        if getattr(args, name) < low:
            problems.append(f"--{name.replace('_', '-')} must be at least {low}, got {getattr(args, name)}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        problems.append(f"--lr must be a positive number, got {args.lr}")
    if not args.run_name or os.sep in args.run_name:
        problems.append(f"--run-name must be a non-empty name without {os.sep!r}, got {args.run_name!r}")
    if args.device == "cuda" and not torch.cuda.is_available() and not getattr(args, "check_flags", False):
        problems.append("--device cuda, but CUDA is not available")
    if problems:
        return problems  # the divisibility checks below need positive sizes
    if args.heads % args.tp:
        problems.append(f"--heads {args.heads} is not divisible by --tp {args.tp}")
    if args.hidden_size % args.heads:
        problems.append(f"--hidden-size {args.hidden_size} is not divisible by --heads {args.heads}")
    stages = args.pp * (args.vpp or 1)
    if args.layers % stages:
        what = f"--pp {args.pp} × --vpp {args.vpp}" if args.vpp else f"--pp {args.pp}"
        problems.append(f"--layers {args.layers} is not divisible by {what} = {stages} pipeline stages")
    if args.vpp is not None and args.pp < 2:
        problems.append(f"--vpp needs --pp of at least 2, got --pp {args.pp}")
    if args.vpp is not None and args.microbatches % args.pp:
        problems.append(f"the interleaved schedule (--vpp) needs --microbatches divisible by --pp {args.pp}, "
                        f"got {args.microbatches}")
    if args.cp > 1:
        if args.seq_length % (2 * args.cp):
            problems.append(f"--seq-length {args.seq_length} is not divisible by 2 × --cp {args.cp}")
        if args.device == "cpu":
            problems.append("--cp > 1 needs Transformer Engine's attention (megatron-core's local attention has "
                            "no context parallelism): run on GPUs under torchrun")
    if args.moe_experts:
        if args.moe_topk > args.moe_experts:
            problems.append(f"--moe-topk {args.moe_topk} is more than --moe-experts {args.moe_experts}")
        if args.moe_experts % args.ep:
            problems.append(f"--moe-experts {args.moe_experts} is not divisible by --ep {args.ep}")
        if args.dp is not None and (args.dp * args.cp) % args.ep:
            problems.append(f"--ep {args.ep} does not divide --dp {args.dp} × --cp {args.cp} (expert-parallel "
                            "ranks are data-parallel ranks)")
        if args.tp > 1 and args.device == "cpu":
            problems.append("MoE layers with --tp > 1 train only with sequence parallelism, which megatron-core's "
                            "local layer norm does not support: use --tp 1 on CPU (or Transformer Engine on GPUs)")
    elif args.ep > 1:
        problems.append(f"--ep {args.ep} needs MoE layers (--moe-experts)")
    if args.backends is not None:
        problems += backend_problems(args.backends, import_packages=getattr(args, "check_flags", False))
    if args.save_interval % args.log_interval:
        problems.append(f"--save-interval {args.save_interval} is not a multiple of --log-interval "
                        f"{args.log_interval}: a checkpoint between log steps would lose the counts of the "
                        "steps since the last record")
    model_parallel = args.tp * args.pp * args.cp
    if world_size is not None:
        if world_size % model_parallel:
            problems.append(f"torchrun started {world_size} ranks, not divisible by --tp {args.tp} × --pp "
                            f"{args.pp} × --cp {args.cp} = {model_parallel}")
        elif args.dp is not None and args.dp != world_size // model_parallel:
            problems.append(f"--dp {args.dp} does not match torchrun's {world_size} ranks / {model_parallel} "
                            f"= {world_size // model_parallel}; leave --dp out under torchrun")
    return problems


def backend_problems(backends: list[str], import_packages: bool = False) -> list[str]:
    """What keeps ``--backends`` from logging, as sentences (empty when every backend can open): unknown
    names, packages that are not installed (with ``import_packages``, as ``--check-flags`` asks: that do not
    import). Checked before any rank starts: a backend that fails at the first log step is disabled with a
    warning, and a job on a cluster would run to its end without it."""
    try:
        from twinkle_megatron.logging import BACKENDS, check_backends
    except ImportError as error:
        _missing("twinkle_megatron", error)
    problems = []
    unknown = [name for name in backends if name not in BACKENDS]
    if unknown:
        problems.append(f"--backends {' '.join(unknown)}: unknown (choose from {' '.join(BACKENDS)})")
    try:
        check_backends([name for name in backends if name in BACKENDS], import_packages=import_packages)
    except ImportError as error:
        problems.append(f"--backends: {error}")
    return problems


# ------------------------------------------------------------------ launching


@contextlib.contextmanager
def _megatron_on(device: str):
    """megatron-core calls CUDA directly; on CPU the package's CPU shim (tests and demos only) redirects them."""
    if device != "cpu":
        yield
        return
    from twinkle_megatron.testing.cuda_shim import cpu_cuda_shim

    with cpu_cuda_shim():
        yield


def _cpu_worker(rank: int, world_size: int, store_path: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank,
                            world_size=world_size, timeout=timedelta(minutes=5))
    with _megatron_on("cpu"):
        train(args, torch.device("cpu"))
    dist.barrier()
    dist.destroy_process_group()


def _torchrun_rank(args: argparse.Namespace) -> None:
    """One rank started by torchrun: NCCL on its GPU, or gloo on the CPU."""
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
        dist.init_process_group("gloo", timeout=timedelta(minutes=5))
    with _megatron_on(device.type):
        train(args, device)
    dist.barrier()
    dist.destroy_process_group()


def _fork_cpu_ranks(args: argparse.Namespace) -> None:
    """TP×PP×DP gloo ranks forked from this process (megatron is imported once, here)."""
    world_size = args.tp * args.pp * args.dp
    import megatron.core.parallel_state  # noqa: F401  (import once; forked ranks inherit it)

    import twinkle_megatron  # noqa: F401

    moe = f", {args.moe_experts} experts top-{args.moe_topk} per layer, EP{args.ep}" if args.moe_experts else ""
    print(f"{world_size} CPU ranks: TP{args.tp} × PP{args.pp}{f' (×{args.vpp} virtual)' if args.vpp else ''} "
          f"× DP{args.dp}{moe}, {args.microbatches} microbatches of {args.micro_batch_size}×{args.seq_length} tokens "
          f"per DP rank, logging to {args.run_dir}", flush=True)
    context = mp.get_context("fork")
    with tempfile.TemporaryDirectory() as tmp:
        procs = [context.Process(target=_cpu_worker, args=(rank, world_size, os.path.join(tmp, "store"), args))
                 for rank in range(world_size)]
        for proc in procs:
            proc.start()

        def forward(signum: int, frame) -> None:  # a stop signal sent to this process reaches every rank
            for proc in procs:
                if proc.is_alive():
                    os.kill(proc.pid, signum)

        for signum in STOP_SIGNALS:
            signal.signal(signum, forward)
        for proc in procs:
            proc.join()
    if any(proc.exitcode for proc in procs):
        raise SystemExit(f"ranks {[r for r, p in enumerate(procs) if p.exitcode]} failed")


def main(argv=None) -> None:
    # Megatron's TP/SP communication overlap needs kernels issued in order (Megatron-LM warns without it);
    # CUDA reads it when it starts, so before anything touches CUDA.
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    args = parse_args(argv)
    if not args.megatron_warnings:
        quiet_megatron()
    for package in ("megatron.core", "twinkle_megatron"):
        try:
            __import__(package)
        except ImportError as error:
            _missing(package, error)
    if args.check_flags:
        print(f"flags OK: TP{args.tp} × PP{args.pp}{f' × VPP{args.vpp}' if args.vpp else ''} × CP{args.cp} × "
              f"DP{args.dp}, {args.layers} layers, {args.heads} heads on {args.device}")
        return
    if "RANK" in os.environ:  # torchrun: one process per GPU (or CPU rank)
        _torchrun_rank(args)
    else:
        _fork_cpu_ranks(args)


if __name__ == "__main__":
    main()
