"""Compile every kernel launch of every op, as the Ascend plan makes it, through triton-ascend's own
compiler up to its Ascend-specific `ttadapter` stage (Triton IR -> HIVM / HFusion / Linalg by the
`triton-adapter-opt` the wheel ships), for an Atlas A2 target, without an NPU or CANN. Run as a script
by test_kernels_compile.py in the triton-ascend venv, in a process without TRITON_INTERPRET.

The launches are compile_sm90's (the same op bodies and shapes, every dtype) recorded under the Ascend
target, plus a sweep over what the Ascend plans choose by (feature or head dim, depth, vocabulary, spatial
rank, window mode, dtype: `ascend_sweep`); float64 ones are skipped (triton-ascend has no fp64; on an NPU float64 runs the reference). Only the last stage, `bishengir-compile`, needs CANN: it bufferizes the IR and allocates the
Unified Buffer, so the UB use of a kernel is not known here. What the lowered IR does state is each
tensor it computes on; a single tensor larger than the UB can never fit, so that is checked (the
largest one per launch is printed).

    PYTHONPATH=. python fusedops_tests/compile_ascend.py"""

from __future__ import annotations

import hashlib
import re
import sys

from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource, make_backend

import torch
from compile_sm90 import _na_launches, attn_res, block_attn_res, embedding, inductor_signature, launches, run_ops
from fusedops.targets import ascend_target

# The Atlas A2 (910B) the Ascend plans are sized for, and an Atlas A3 (910C) SoC that triton-ascend 3.2 lists
# (TRITON_ASCEND_ARCH's Ascend910_93xx): every launch lowers for the A2, the op bodies' own launches also for A3.
TARGET = GPUTarget("npu", "Ascend910B3", 0)
A3 = GPUTarget("npu", "Ascend910_9392", 0)
ELEMENT_BYTES = {"i1": 1, "i8": 1, "i16": 2, "i32": 4, "i64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8}
TENSOR = re.compile(r"tensor<((?:\d+x)+)(\w+)>")


def to_ttadapter(kernel, signature: dict, constexprs: dict, options: dict, target=TARGET) -> str:
    """The kernel's IR after triton-ascend's `ttir` and `ttadapter` stages (what compile() runs before
    handing the IR to bishengir-compile)."""
    from triton._C.libtriton import ir

    backend = make_backend(target)
    opts = backend.parse_options(dict(options, debug=bool(getattr(kernel, "debug", False))))
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    module = ASTSource(kernel, signature, constexprs).make_ir(opts, backend.get_codegen_implementation(),
                                                              backend.get_module_map(), context)
    stages: dict = {}
    backend.add_stages(stages, opts)
    key = hashlib.sha256(f"{kernel.fn.__name__}{signature}{constexprs}".encode()).hexdigest()
    metadata = dict(opts.__dict__, hash=key, target=target)
    return stages["ttadapter"](stages["ttir"](module, metadata), metadata)


def _lowered(kernel, signature: dict, constexprs: dict, options: dict, target=TARGET) -> str:
    """to_ttadapter, once more where the adapter died of a signal: triton-adapter-opt 3.2 has segfaulted
    once on a launch that lowers cleanly on every other run (a retry is logged, a second crash fails)."""
    import subprocess

    try:
        return to_ttadapter(kernel, signature, constexprs, options, target)
    except subprocess.CalledProcessError as e:
        if e.returncode >= 0:
            raise
        print("retrying after the adapter died of signal", -e.returncode, kernel.fn.__name__, constexprs)
        return to_ttadapter(kernel, signature, constexprs, options, target)


def largest_tensor_bytes(ir_text: str) -> int:
    best = 0
    for dims, dtype in TENSOR.findall(ir_text):
        size = ELEMENT_BYTES.get(dtype, 4)
        for d in dims.rstrip("x").split("x"):
            size *= int(d)
        best = max(best, size)
    return best


def _adapter_errors(e: Exception) -> str:
    """The adapter's own diagnostics (its error lines, or the crash's first lines) from a failed run."""
    text = (getattr(e, "stderr", b"") or b"").decode(errors="replace")
    errors = [line for line in text.splitlines() if "error" in line.lower() or "Assertion" in line]
    return "\n".join(errors[:8] or text.splitlines()[:8])


def ascend_sweep(target) -> None:
    """More launches of every op body under the Ascend plan: every tile regime of its planners."""
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for n, dim in ((2, 32), (9, 300), (9, 1024), (2, 4096), (9, 7168), (64, 4096), (3, 16384)):
            values = torch.randn(n, 3, dim, dtype=dtype)
            query, weight = torch.randn(dim), torch.rand(dim)
            out, lse = attn_res._forward(values, query, weight, 1e-6, target)
            grad_out = torch.randn(3, dim, dtype=dtype)
            attn_res._backward(grad_out, values, query, None, 1e-6, True, True, False, target)
            attn_res._backward(grad_out, values, query, weight, 1e-6, True, True, True, target, out, lse,
                               torch.randn(3))
            attn_res._backward(grad_out, values, query, weight, 1e-6, False, True, True, target, out, lse)
        for vocab, dim, tokens in ((1000, 8, 300), (40000, 100, 300), (1000, 768, 1), (40000, 4096, 300),
                                   (50, 8192, 300), (50, 8192, 1)):
            weight, indices = torch.randn(vocab, dim, dtype=dtype), torch.randint(0, vocab, (tokens,))
            embedding._forward(weight, indices, target)
            embedding._backward(torch.randn(tokens, dim, dtype=dtype), indices, vocab, 3, False, target)
        for n, m, dim, tokens in ((2, 1, 32, 3), (9, 24, 7168, 3), (4, 6, 4096, 1), (16, 3, 300, 5)):
            values, queries = torch.randn(n, tokens, dim, dtype=dtype), torch.randn(m, dim)
            out, lse = block_attn_res._multi_forward(values, queries, 1e-6, target)
            block_attn_res._multi_backward(torch.randn_like(out), torch.randn_like(lse), values, queries, 1e-6,
                                           True, True, target)
            rows = [torch.randn(tokens, dim, dtype=dtype) for _ in range(3)]
            for addend, gain in ((None, None), (rows[2], torch.rand(dim))):
                block_attn_res._merge_forward(out[0], lse[0], rows[0], queries[0], addend, None, gain, 1e-6, 1e-6,
                                              target)
                block_attn_res._merge_backward(rows[1], None, out[0], lse[0], rows[0], queries[0], gain, 1e-6, 1e-6,
                                               True, True, True, True, True, target)
        for head_dim in (8, 32, 128, 256):
            for shape, kernel, window, causal in (((1, 2, 70), [9], "shifted", [True]),
                                                   ((1, 2, 70), [9], "truncated", [False]),
                                                   ((1, 2, 12, 10), [3, 5], "shifted", [False, True]),
                                                   ((1, 2, 6, 5, 7), [3, 3, 5], "truncated", [False, False, True])):
                _na_launches((*shape, head_dim), kernel, dtype, window, causal, target)


def main() -> int:
    target = ascend_target()
    run_ops(target)
    own = len(launches)
    ascend_sweep(target)
    failures, seen = 0, set()
    for index, (kernel, tensors, scalars, meta) in enumerate(launches):
        signature, constexprs, _ = inductor_signature(kernel, tensors, scalars, meta)
        signature = {k: ("fp32" if v == "fp64" else v) for k, v in signature.items()}  # Python floats: fp32 here
        key = (kernel.fn.__name__, tuple(signature.items()), tuple(constexprs.items()))
        if key in seen:
            continue
        seen.add(key)
        if "*fp64" in signature.values():  # triton-ascend has no fp64: float64 runs the reference on an NPU
            print("skipped (float64)", kernel.fn.__name__, constexprs)
            continue
        options = {k: meta[k] for k in ("num_warps",) if k in meta}
        for soc in (TARGET, A3) if index < own else (TARGET,):
            try:
                largest = largest_tensor_bytes(_lowered(kernel, signature, constexprs, options, soc))
                if largest > target.onchip_bytes:
                    raise ValueError(f"a {largest}-byte tensor cannot fit the {target.onchip_bytes}-byte Unified "
                                     "Buffer")
                print("ok", soc.arch, kernel.fn.__name__, constexprs, f"largest tensor {largest} bytes")
            except Exception as e:  # noqa: BLE001 - report every kernel, then fail
                failures += 1
                print("FAILED", soc.arch, kernel.fn.__name__, constexprs, f"{type(e).__name__}: {e}"[:3000],
                      _adapter_errors(e))
    print(f"{len(seen)} launches lowered to triton-ascend's ttadapter IR (Atlas A2; the op bodies' own launches "
          f"also for A3), {failures} failed")
    return 1 if failures or not seen else 0


if __name__ == "__main__":
    sys.exit(main())
