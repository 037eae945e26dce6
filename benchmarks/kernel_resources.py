"""Compile the token-statistics Triton kernel for NVIDIA GPUs on any machine, and print what it uses.

Run: ``python benchmarks/kernel_resources.py [--arch 80 90] [--dtype bf16 fp32] [--json]``.
No GPU is needed: Triton's compiler and the ``ptxas`` shipped in its wheel build
the cubin for each target (``sm_80`` A100, ``sm_90`` H100/H200) exactly as the
JIT would for contiguous shards of a multiple of 16 columns (16-byte aligned
pointers and strides, unit column stride), and the wheel's ``cuobjdump`` reads
each cubin's registers per thread, shared memory and local memory (register
spills). For each configuration of :func:`launch_config` (the default one and a
few alternatives) it prints those, and whether the loads are 16-byte vector
loads (``ld.global.v4``) or pipelined ``cp.async`` copies.

It cannot say how fast the kernel is: ``benchmarks/gpu_timings.py`` measures that
on a GPU. It must not run with ``TRITON_INTERPRET=1`` (the interpreter replaces
the compiler), so it clears the variable before importing Triton.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # before triton is imported

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
ALTERNATIVES = [(2048, 8, 1), (4096, 8, 2), (4096, 16, 2), (8192, 16, 2)]


def compile_kernel(arch: int, dtype: str, need_sums: bool, block: int, num_warps: int, num_stages: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from twinkle_megatron.ops.triton_token_stats import _local_pass_kernel as kernel

    signature = {"x_ptr": f"*{dtype}", "labels_ptr": "*i64", "max_ptr": "*fp32", "col_ptr": "*i64",
                 "stats_ptr": "*fp32", "n_cols": "i32", "stride_row": "i32", "stride_col": "constexpr",
                 "stats_stride": "i32", "HAS_LABELS": "constexpr", "NEED_SUMS": "constexpr", "BLOCK": "constexpr",
                 "NUM_STAGES": "constexpr"}
    aligned = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in
               ("x_ptr", "labels_ptr", "max_ptr", "col_ptr", "stats_ptr", "n_cols", "stride_row", "stats_stride")}
    constants = {"stride_col": 1, "HAS_LABELS": need_sums, "NEED_SUMS": need_sums, "BLOCK": block,
                 "NUM_STAGES": num_stages}
    return triton.compile(ASTSource(kernel, signature, constexprs=constants, attrs=aligned),
                          target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def resource_usage(cubin: bytes) -> dict:
    """``{'registers', 'shared', 'local'}`` of the cubin's kernel, read by the wheel's cuobjdump."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        out = subprocess.run([str(tool), "--dump-resource-usage", str(path)], capture_output=True, text=True,
                             check=True).stdout
    line = next(line for line in out.splitlines() if "REG:" in line)
    fields = dict(re.findall(r"(\w+):(\d+)", line))
    return {"registers": int(fields["REG"]), "shared": int(fields["SHARED"]), "local": int(fields["LOCAL"])}


def describe(arch: int, dtype: str, need_sums: bool, block: int, num_warps: int, num_stages: int) -> dict:
    compiled = compile_kernel(arch, dtype, need_sums, block, num_warps, num_stages)
    ptx = compiled.asm["ptx"]
    return {"arch": arch, "dtype": dtype, "need_sums": need_sums, "block": block, "num_warps": num_warps,
            "num_stages": num_stages, **resource_usage(compiled.asm["cubin"]),
            "dynamic_shared": compiled.metadata.shared,
            "vector_loads": ptx.count("ld.global.v4"), "cp_async": ptx.count("cp.async."),
            "exp2": ptx.count("ex2.approx")}


def configurations(dtype: str, n_cols: int = 32768) -> list[tuple[int, int, int, str]]:
    from twinkle_megatron.ops.triton_token_stats import launch_config

    default = launch_config(n_cols, DTYPE_BYTES[dtype])
    rows = [(*default, "default")]
    rows += [(*c, "") for c in ALTERNATIVES if c != default]
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[80, 90], help="compute capabilities (80, 90...)")
    parser.add_argument("--dtype", nargs="+", default=["bf16", "fp32"], choices=sorted(DTYPE_BYTES))
    parser.add_argument("--defaults-only", action="store_true", help="only the default configuration")
    parser.add_argument("--json", action="store_true", help="print one JSON list instead of a table")
    args = parser.parse_args(argv)
    rows = []
    for arch in args.arch:
        for dtype in args.dtype:
            for block, warps, stages, note in configurations(dtype):
                if args.defaults_only and not note:
                    continue
                for need_sums in (True, False):
                    rows.append({**describe(arch, dtype, need_sums, block, warps, stages), "note": note})
    if args.json:
        print(json.dumps(rows))
        return 0
    header = (f"{'arch':>5} {'dtype':>5} {'sums':>5} {'block':>6} {'warps':>5} {'stages':>6} {'regs':>5} "
              f"{'shared':>7} {'dyn shared':>10} {'local':>5} {'v4 loads':>8} {'cp.async':>8} {'ex2':>4}  note")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"sm_{r['arch']:<2} {r['dtype']:>5} {str(r['need_sums']):>5} {r['block']:>6} {r['num_warps']:>5} "
              f"{r['num_stages']:>6} {r['registers']:>5} {r['shared']:>7} {r['dynamic_shared']:>10} "
              f"{r['local']:>5} {r['vector_loads']:>8} {r['cp_async']:>8} {r['exp2']:>4}  {r['note']}")
    print("local > 0 means register spills; regs x threads per block bounds the blocks per SM.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
