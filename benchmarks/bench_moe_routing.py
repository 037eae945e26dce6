"""What the MoE routing hooks cost: a real megatron-core router's forward with and without them.

One process (gloo, world 1, megatron-core's ``parallel_state`` initialised), one
``MoELayer`` from megatron-core's local layer spec (``TopKRouter``, all-gather
dispatcher, ``SequentialMLP`` experts), a ``[seq, batch, hidden]`` input with
padding. Rounds alternate, in a rotating order, between

* ``router``: the router's forward (training mode, autograd on);
* ``router + hooks``: the same with ``MoERoutingHooks`` on it (what ``instrument()``
  attaches: routing map and padding mask summed, the gating product recomputed,
  the routing entropy, Megatron's tracker read);

each round ``repeats`` calls timed with ``time.perf_counter`` (CUDA events on a
GPU); per mode the median over rounds. The hooks' cost per call is the difference,
reported against the router and against the whole MoE layer's forward (timed the
same way): the hooks run once per MoE layer and microbatch, so that ratio is
their share of the MoE layers' forward. On a shared CPU the layer's time varies
more than the hooks cost, which is why the difference is taken at the router.
On CPU the test suite's CUDA-to-CPU shim runs the layer.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile

import torch
import torch.distributed as dist
from step_overhead import seconds_per_call

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def measure(args: argparse.Namespace) -> dict:
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import build_module

    from twinkle_megatron.megatron.router_hooks import MoERoutingHooks
    from twinkle_megatron.metric.language.moe_routing import MoERoutingMetric

    cuda = torch.cuda.is_available()
    parallel_state.initialize_model_parallel()
    config = TransformerConfig(num_layers=1, hidden_size=args.hidden, ffn_hidden_size=args.ffn, num_attention_heads=4,
                               num_moe_experts=args.experts, moe_router_topk=args.topk, add_bias_linear=False,
                               moe_token_dispatcher_type="allgather", use_cpu_initialization=not cuda,
                               params_dtype=torch.float32 if not cuda else torch.bfloat16, bf16=cuda)
    layer = build_module(get_gpt_layer_local_spec(num_experts=args.experts, moe_grouped_gemm=False).submodules.mlp,
                         config=config)
    layer.set_layer_number(1)
    device = torch.device("cuda") if cuda else torch.device("cpu")
    layer = layer.to(device)
    hidden = torch.randn(args.seq, args.batch, args.hidden, device=device, dtype=config.params_dtype,
                         requires_grad=True)
    padding = torch.zeros(args.batch, args.seq, dtype=torch.bool, device=device)
    padding[:, -args.seq // 8:] = True

    def forward() -> None:
        layer(hidden, padding_mask=padding)

    def router() -> None:
        layer.router(hidden, padding.transpose(0, 1))

    errors: list = []
    metric = MoERoutingMetric(num_layers=1, num_experts=args.experts, topk=args.topk)
    times: dict = {"router": [], "router + hooks": [], "MoE layer": []}
    for round_ in range(args.rounds + 1):
        order = ["router", "router + hooks"] if round_ % 2 == 0 else ["router + hooks", "router"]
        for mode in order:
            hooks = MoERoutingHooks([layer.router], metric, on_error=lambda where, error: errors.append(error)) \
                if mode == "router + hooks" else None
            elapsed = seconds_per_call(router, args.repeats, device)
            if hooks is not None:
                hooks.detach()
            if round_:  # round 0 warms up
                times[mode].append(elapsed)
        if round_ and round_ % 4 == 1:
            times["MoE layer"].append(seconds_per_call(forward, 1, device))
    if errors:
        raise errors[0]
    medians = {mode: statistics.median(values) for mode, values in times.items()}
    hook = medians["router + hooks"] - medians["router"]
    return {"medians": medians, "hook": hook, "of_router": hook / medians["router"],
            "of_layer": hook / medians["MoE layer"], "tokens_recorded": float(metric._states["tokens"].sum()),
            "device": str(device)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from kit.megatron_moe import allow_router_without_te

        allow_router_without_te()
        shim = contextlib.nullcontext()
        if not torch.cuda.is_available():
            from twinkle_megatron.testing.cuda_shim import cpu_cuda_shim

            shim = cpu_cuda_shim()
        with shim:
            result = measure(args)
        dist.destroy_process_group()
    medians = result["medians"]
    print(f"MoE router ({result['device']}): {args.seq}x{args.batch} tokens, hidden {args.hidden}, ffn {args.ffn}, "
          f"{args.experts} experts, top-{args.topk}; median of {args.rounds} rounds x {args.repeats} calls")
    for mode, seconds in medians.items():
        print(f"  {mode:<15} {seconds * 1e3:8.3f} ms")
    print(f"  the hooks: {result['hook'] * 1e3:.3f} ms per call = {result['of_router'] * 100:.0f} % of the router's "
          f"forward, {result['of_layer'] * 100:.1f} % of the MoE layer's")


if __name__ == "__main__":
    main()
