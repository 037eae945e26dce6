"""A Megatron-LM-style training loop with twinkle-megatron's metrics attached.

Everything here is ordinary megatron-core: ``parallel_state``, a ``GPTModel``
per virtual pipeline stage, Megatron's DDP and optimizer, the pipeline
schedule from ``get_forward_backward_func()``, and a ``forward_step`` /
``loss_func`` pair written the way ``pretrain_gpt.py`` writes them. The plugin
adds two lines: ``instrument(model)`` and ``metrics.wrap(forward_step)``; then
``metrics.calculate()`` after each step gives token accuracy, label
log-probability, entropy and the loss on every rank, computed from the
vocab-parallel logits without gathering the vocabulary.

The task is synthetic and learnable (each sequence counts up from a random
start by a random stride of 1–3, modulo the vocabulary), so the loss falls and
the accuracy rises within a few dozen steps.

Run on CPU (8 forked gloo ranks; megatron-core's CUDA calls are redirected by
the CUDA-to-CPU shim of the test suite)::

    python examples/megatron_loop.py --tp 2 --pp 2 --dp 2 --steps 30

On GPUs, one process per GPU, NCCL, no shim::

    torchrun --nproc-per-node 8 examples/megatron_loop.py --tp 2 --pp 2 --dp 2
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import warnings
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")


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


def counting_batch(args: argparse.Namespace, generator: torch.Generator) -> dict:
    """``[micro_batch, seq]`` sequences ``start + stride·i (mod vocab)``; the first two tokens are context."""
    size = (args.micro_batch_size, 1)
    start = torch.randint(0, args.vocab_size, size, generator=generator)
    stride = torch.randint(1, 4, size, generator=generator)
    stream = (start + stride * torch.arange(args.seq_length + 1)) % args.vocab_size
    loss_mask = torch.ones(args.micro_batch_size, args.seq_length)
    loss_mask[:, :1] = 0  # the stride is unknowable from one token
    return {"tokens": stream[:, :-1], "labels": stream[:, 1:], "loss_mask": loss_mask,
            "position_ids": torch.arange(args.seq_length).expand(args.micro_batch_size, -1)}


def build_model(args: argparse.Namespace, device: torch.device):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    cpu = device.type == "cpu"
    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden_size, num_attention_heads=args.heads,
        tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
        virtual_pipeline_model_parallel_size=args.vpp, use_cpu_initialization=cpu,
        params_dtype=torch.float32 if cpu else torch.bfloat16, bf16=not cpu,
        pipeline_dtype=torch.float32 if cpu else torch.bfloat16,
        hidden_dropout=0.0, attention_dropout=0.0, calculate_per_token_loss=True,
        batch_p2p_comm=args.vpp is None,  # the interleaved schedule with batched p2p is wrong on gloo
    )
    model_parallel_cuda_manual_seed(1234, **({"inference_rng_tracker": True} if cpu else {}))
    chunks = []
    for stage in range(args.vpp or 1):
        vp_stage = stage if args.vpp else None
        model = GPTModel(
            config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=args.padded_vocab_size,
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

    from twinkle_megatron.megatron import instrument

    ps.initialize_model_parallel(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
                                 virtual_pipeline_model_parallel_size=args.vpp)
    chunks, config = build_model(args, device)
    optimizer = get_megatron_optimizer(
        # Megatron's gradient clipping asserts CUDA tensors: no clipping on CPU.
        OptimizerConfig(optimizer="adam", lr=args.lr, bf16=device.type != "cpu",
                        clip_grad=0.0 if device.type == "cpu" else 1.0), chunks)
    forward_backward = get_forward_backward_func()
    # Data-parallel ranks see different sequences; all ranks of one model replica see the same.
    generator = torch.Generator().manual_seed(ps.get_data_parallel_rank())

    with instrument(chunks, vocab_size=args.vocab_size) as metrics:           # <- the plugin
        for step in range(1, args.steps + 1):
            microbatches = [counting_batch(args, generator) for _ in range(args.microbatches)]
            microbatches = [{k: v.to(device) for k, v in mb.items()} for mb in microbatches]
            for chunk in chunks:
                chunk.zero_grad_buffer()
            optimizer.zero_grad()
            forward_backward(
                forward_step_func=metrics.wrap(forward_step),                  # <- the plugin
                data_iterator=[iter(microbatches) for _ in chunks] if args.vpp else iter(microbatches),
                model=chunks if args.vpp else chunks[0], num_microbatches=args.microbatches,
                seq_length=args.seq_length, micro_batch_size=args.micro_batch_size, forward_only=False)
            _, grad_norm, _ = optimizer.step()
            results = metrics.calculate()                                        # <- every rank
            if dist.get_rank() == 0 and (step == 1 or step % args.log_interval == 0):
                print(f"step {step:4d} | loss {results['loss']:.4f} | accuracy {results['accuracy']:.3f} | "
                      f"logprob {results['logprob']:.3f} | entropy {results['entropy']:.3f} | "
                      f"grad norm {grad_norm:.3f}", flush=True)


# ------------------------------------------------------------------ launching


def _cpu_worker(rank: int, world_size: int, store_path: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank,
                            world_size=world_size, timeout=timedelta(minutes=5))
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from cuda_shim import cpu_cuda_shim  # megatron-core calls CUDA directly; on CPU this redirects it

    with cpu_cuda_shim():
        train(args, torch.device("cpu"))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--dp", type=int, default=2, help="data-parallel size (CPU launch only)")
    parser.add_argument("--vpp", type=int, default=None, help="virtual pipeline stages per rank")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--log-interval", type=int, default=5)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=32)
    parser.add_argument("--vocab-size", type=int, default=61)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()
    # Megatron pads the vocabulary to a multiple of 128·TP on GPUs; a multiple of TP is enough here.
    args.padded_vocab_size = -(-args.vocab_size // args.tp) * args.tp + args.tp

    if "RANK" in os.environ:  # torchrun: one process per GPU
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() \
            else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        train(args, device)
        dist.destroy_process_group()
        return

    world_size = args.tp * args.pp * args.dp
    import megatron.core.parallel_state  # noqa: F401  (import once; forked ranks inherit it)

    import twinkle_megatron  # noqa: F401

    print(f"{world_size} CPU ranks: TP{args.tp} × PP{args.pp}{f' (×{args.vpp} virtual)' if args.vpp else ''} "
          f"× DP{args.dp}, {args.microbatches} microbatches of {args.micro_batch_size}×{args.seq_length} tokens",
          flush=True)
    context = mp.get_context("fork")
    with tempfile.TemporaryDirectory() as tmp:
        procs = [context.Process(target=_cpu_worker, args=(rank, world_size, os.path.join(tmp, "store"), args))
                 for rank in range(world_size)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join()
    if any(proc.exitcode for proc in procs):
        raise SystemExit(f"ranks {[r for r, p in enumerate(procs) if p.exitcode]} failed")


if __name__ == "__main__":
    main()
