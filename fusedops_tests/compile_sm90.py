"""Compile every kernel launch of every op, as the H100 plan makes it, for sm_90 with the argument
types torch.compile's Inductor gives them (Python floats as fp64), without a GPU. Run as a script by
test_kernels_compile.py, in a process without TRITON_INTERPRET (the interpreter never compiles).

The op bodies run on CPU tensors with `launch` replaced by a recorder, so nothing executes: this
checks what only a GPU compile would otherwise find (an fp64 scalar changing a loop-carried type, a
layout-conversion crash at some tile shape) on a CPU-only CI machine. With --resources it also prints
each launch's registers per thread and spill (stack) bytes. With --eager it compiles each launch as an
eager launch specialises it instead (pointers and multiples of 16 marked divisible by 16, ints equal
to 1 made constants): the register counts of the launches the op makes outside torch.compile.

Every launch must also fit the device's shared memory a program (Target.smem_bytes). With --capability 86 the
ops plan for a GPU with 99 KB of it (sm_86/sm_89: RTX 30xx/40xx, A10, L4, L40S) and the kernels of the ops with
tensor-core dots (which stage their operands in shared memory) compile for sm_86.

    PYTHONPATH=. python fusedops_tests/compile_sm90.py --resources [--eager] [--capability 86]"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fusedops.attn_res import op as attn_res
from fusedops.block_attn_res import op as block_attn_res
from fusedops.embedding import op as embedding
from fusedops.launch import bind, split
from fusedops.neighborhood_attention import op as na
from fusedops.plans import plan_override
from fusedops.targets import CUDA_ONCHIP_BYTES, Target

H100 = Target(vendor="cuda", vector_cores=132, matrix_cores=132, onchip_bytes=CUDA_ONCHIP_BYTES,
              max_grid=2**31 - 1, row_align=16, resident=4, persistent=False)
# shared memory a program may use, by compute capability (CUDA's opt-in per-block limit)
SMEM_BYTES = {90: 227 * 1024, 86: 99 * 1024}
# the ops whose kernels stage tensor-core operands in shared memory
TENSOR_CORE_MODULES = ("block_attn_res.kernels", "neighborhood_attention.kernels")
POINTER = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.float64: "*fp64",
           torch.int64: "*i64", torch.int32: "*i32", torch.int16: "*i16"}

launches: list = []


def record(kernel, grid, args, meta):
    tensors, scalars = split(bind(kernel, args))  # by name, as fusedops.launch binds them
    launches.append((kernel, tuple(tensors), tuple(scalars), dict(meta)))


def inductor_signature(kernel, tensors, scalars, meta) -> tuple[dict, dict, dict]:
    values = list(tensors) + list(scalars)
    signature, constexprs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if i >= len(values):
            value = meta[name] if name in meta else kernel.params[i].default  # a constexpr left at its default
            signature[name], constexprs[name] = "constexpr", value
            continue
        x = values[i]
        if isinstance(x, torch.Tensor):
            signature[name] = POINTER[x.dtype]
        elif isinstance(x, bool):
            signature[name] = "i1"
        elif isinstance(x, int):
            signature[name] = "i32" if -2**31 <= x < 2**31 else "i64"
        else:
            signature[name] = "fp64"  # Inductor's type for a Python float argument
    return signature, constexprs, {}


def eager_signature(kernel, tensors, scalars, meta) -> tuple[dict, dict, dict]:
    """The signature of an eager launch: Triton's own specialisation of pointers and integers."""
    signature, constexprs, attrs = inductor_signature(kernel, tensors, scalars, meta)
    values = list(tensors) + list(scalars)
    for i, name in enumerate(kernel.arg_names[: len(values)]):
        x = values[i]
        if isinstance(x, bool) or not isinstance(x, (int, torch.Tensor)):
            continue
        if isinstance(x, int) and x == 1:
            signature[name], constexprs[name] = "constexpr", 1
        elif isinstance(x, torch.Tensor) or x % 16 == 0:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs


def run_ops(target: Target = H100) -> None:
    """Record the launches of every op body under `target`'s plan (the kernels never run)."""
    for mod in (attn_res, block_attn_res, embedding, na):
        mod.launch = record
    bf16, f32, f64 = torch.bfloat16, torch.float32, torch.float64
    # attn_res: one tile with two rows in flight, the tiled-D path (D = 16384), fp32; every backward
    # (two-phase without the forward's statistics, one pass with them, a gradient of lse or not; the
    # depth tile where a token's N rows fit, which takes both calls); float64 through each kind of kernel; the
    # forward split over programs and merged (64 sources, 16 tokens)
    for n, dim, dtype in ((8, 4096, bf16), (8, 8192, bf16), (3, 16384, bf16), (64, 300, f32), (4, 4096, bf16),
                          (4, 7168, bf16), (2, 16384, bf16), (5, 300, f32), (64, 300, f64), (5, 300, f64),
                          (3, 16384, f64), (64, 7168, bf16)):
        values = torch.randn(n, 2, 8, dim, dtype=dtype)
        query, weight = torch.randn(dim), torch.rand(dim)
        out, lse = attn_res._forward(values, query, weight, 1e-6, target)
        grad_out = torch.randn(2, 8, dim, dtype=dtype)
        attn_res._backward(grad_out, values, query, weight, 1e-6, True, True, True, target)
        attn_res._backward(grad_out, values, query, weight, 1e-6, True, True, True, target, out, lse)
        attn_res._backward(grad_out, values, query, weight, 1e-6, True, False, True, target, out, lse, torch.randn(2, 8))
    # block attn_res: phase 1 at Kimi K3's shape (and decode, D split), the merge with two addends and the norm
    # and without either, both backwards; float64
    # (and the tensor-core forward's tiles at a deep block, many queries and a narrow D; the two-pass forward and
    # the merge's whole rows from 1024 tokens)
    for n, m, tokens, dim, dtype in ((8, 24, 64, 7168, bf16), (9, 24, 1, 7168, bf16), (3, 2, 8, 300, f64),
                                     (100, 64, 40, 4096, bf16), (5, 3, 40, 8, torch.float16),
                                     (9, 6, 1024, 4096, bf16), (4, 16, 1024, 12000, f32)):
        values, queries = torch.randn(n, tokens, dim, dtype=dtype), torch.randn(m, dim)
        block_attn_res._multi_forward(values, queries, 1e-6, target)
        block_attn_res._multi_backward(torch.randn(m, tokens, dim, dtype=dtype), torch.randn(m, tokens), values,
                                       queries, 1e-6, True, True, target)
        x, gain = torch.randn(tokens, dim, dtype=dtype), torch.rand(dim)
        lse = torch.randn(tokens, dtype=f64 if dtype == f64 else f32)
        block_attn_res._merge_forward(x, lse, x, queries[0], x, x, gain, 1e-6, 1e-6, target)
        block_attn_res._merge_forward(x, lse, x, queries[0], None, None, None, 1e-6, 1e-6, target)
        block_attn_res._merge_backward(x, x, x, lse, x, queries[0], gain, 1e-6, 1e-6, True, True, True, True, True,
                                       target)
    # embedding; the backward's sort path and its scan kernel, whatever the target's scan threshold
    for dim, dtype in ((4096, bf16), (768, f32), (768, f64)):
        weight, indices = torch.randn(1000, dim, dtype=dtype), torch.randint(0, 1000, (64,))
        embedding._forward(weight, indices, target)
        for scan_tokens in (0, 64):
            with plan_override("embedding", "bwd", scan_tokens=scan_tokens):
                embedding._backward(torch.randn(64, dim, dtype=dtype), indices, 1000, -1, True, target)
    # neighborhood attention: 1D narrow and wide windows, 2D, 3D, fp32 (ieee dots), truncated + causal,
    # head dim 256; then fp32 with TF32 dots
    for shape, kernel, dtype, window, causal in (
        ((2, 4, 64, 64), [7], bf16, "shifted", [False]),
        ((2, 4, 256, 128), [33], bf16, "shifted", [False]),
        ((1, 2, 16, 16, 64), [7, 7], bf16, "shifted", [False, True]),
        ((1, 2, 8, 8, 8, 64), [3, 3, 3], bf16, "shifted", [False, False, False]),
        ((1, 2, 40, 48), [5], f32, "truncated", [True]),
        ((1, 2, 256, 256), [129], bf16, "shifted", [False]),  # the largest head dim, a wide window
        ((1, 2, 16, 16, 256), [5, 5], bf16, "shifted", [False, False]),
        ((1, 2, 40, 48), [5], f64, "truncated", [True]),  # float64: fp64 dots, accumulators and statistics
        ((1, 2, 256, 64), [33], f64, "shifted", [False]),
        ((1, 2, 16, 16, 64), [7, 7], f64, "shifted", [False, True]),
        ((1, 2, 8, 8, 8, 128), [3, 3, 3], f64, "shifted", [False, False, False]),
    ):
        _na_launches(shape, kernel, dtype, window, causal, target)
    # the dK/dV kernel with scores as [keys, queries] (Plan.keys_major), as a forced plan launches it (its 161 KB of
    # shared memory fit Hopper only: forced boxes are not shrunk)
    if target.smem_bytes >= SMEM_BYTES[90]:
        with plan_override("neighborhood_attention", "dkdv", bm=(1, 1, 64), bn=(1, 1, 128), num_warps=8, num_stages=3,
                           walk_tests=False, unmasked_inside=True, keys_major=True):
            _na_launches((1, 2, 512, 128), [129], bf16, "shifted", [False], target)
    # fp32 with TF32 dots (torch.set_float32_matmul_precision("high"))
    torch.set_float32_matmul_precision("high")
    try:
        for shape, kernel in (((1, 2, 256, 128), [33]), ((1, 2, 16, 16, 64), [7, 7])):
            _na_launches(shape, kernel, f32, "shifted", [False] * len(kernel), target)
    finally:
        torch.set_float32_matmul_precision("highest")


def _na_launches(shape, kernel, dtype, window, causal, target: Target) -> None:
    q = torch.randn(shape, dtype=dtype)
    ndim = len(kernel)
    args = (kernel, [1] * ndim, [1] * ndim, causal, q.shape[-1] ** -0.5, window, [0] * ndim, target)
    out, lse = na._forward(q, q, q, *args)
    na._backward(out, lse, q, q, q, out, lse, *args)


def resources(compiled) -> str:
    """Registers per thread and stack bytes (spills) of a compiled kernel, read from its cubin by the
    cuobjdump that ships with Triton. Inductor's signatures carry no divisibility or equal-to-1
    specialisation, so a launch from eager code (which has them) can need fewer registers."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+).*?STACK:(\d+)", usage)
    return f"registers {found[1]}, stack {found[2]} bytes" if found else "resources unknown"


# Grid-stride loops whose counter passes 2**31 at sizes a user can pass (past 2**30 tokens or vocabulary rows: the
# first start plus the stride), so it must count in int64.
WIDE_LOOPS = ("embedding_run_keys_kernel", "embedding_run_offsets_kernel")


def main() -> int:
    capability = int(sys.argv[sys.argv.index("--capability") + 1]) if "--capability" in sys.argv else 90
    target = dataclasses.replace(H100, smem_bytes=SMEM_BYTES[capability])
    run_ops(target)
    failures = 0
    seen = set()
    for kernel, tensors, scalars, meta in launches:
        if capability != 90 and not kernel.fn.__module__.endswith(TENSOR_CORE_MODULES):
            continue
        signature, constexprs, attrs = (eager_signature if "--eager" in sys.argv else inductor_signature)(
            kernel, tensors, scalars, meta)
        key = (kernel.fn.__name__, tuple(signature.items()), tuple(constexprs.items()))
        if key in seen:
            continue
        seen.add(key)
        options = {k: meta[k] for k in ("num_warps", "num_stages", "maxnreg") if k in meta}
        try:
            compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs),
                                      target=GPUTarget("cuda", capability, 32), options=options)
            usage = resources(compiled) if "--resources" in sys.argv else ""
            shared = compiled.metadata.shared
            loops = [line.strip() for line in compiled.asm["ttir"].splitlines() if "scf.for" in line]
            if kernel.fn.__name__ in WIDE_LOOPS and any(not line.endswith(": i64 {") for line in loops):
                failures += 1
                print("FAILED", kernel.fn.__name__, "a grid-stride loop counts in int32:", loops)
                continue
            if shared > target.smem_bytes:
                failures += 1
                print("FAILED", kernel.fn.__name__, constexprs, options,
                      f"needs {shared} bytes of shared memory, past the {target.smem_bytes} a program may use")
                continue
            print("ok", kernel.fn.__name__, constexprs, options, f"shared {shared}", usage)
        except Exception as e:  # noqa: BLE001 - report every kernel, then fail
            failures += 1
            print("FAILED", kernel.fn.__name__, constexprs, f"{type(e).__name__}: {e}")
    print(f"{len(seen)} launches compiled for sm_{capability}, {failures} failed")
    return 1 if failures or not seen else 0


if __name__ == "__main__":
    sys.exit(main())
