"""Sweep attn_res launch plans on a GPU (not part of `python -m bench`): times the forward and the
one-pass backward kernels for each (block_t, num_warps, programs, unroll) around the planner's choice,
plus the planner's two-phase backward for reference, so a plan change is backed by a measurement.
Usage: python -m bench.tune_attn_res"""

from __future__ import annotations

import dataclasses

import torch
import triton.testing
from torch._library.triton import set_wrap_triton_enabled

from bench.common import measure_ceiling
from fusedops.attn_res.op import _backward, _forward, backward_plan
from fusedops.attn_res.plan import make_plan
from fusedops.targets import cuda_target

CASES = [(8, 8192, 4096), (16, 4096, 4096), (64, 2048, 4096), (4, 8192, 4096), (8, 8192, 8192)]


def main() -> None:
    # Outside a triton_op body wrap_triton dispatches through a higher-order op (~1 ms of host time per
    # launch); the op itself launches directly, and so must the sweep.
    with set_wrap_triton_enabled(False):
        sweep()


def _time(label, fn, nbytes, ceiling, planner):
    ms = triton.testing.do_bench(fn, return_mode="median")
    print(f"{label}: {ms:.3f} ms {100 * nbytes / ms / 1e9 / ceiling:.0f}%{' (planner)' if planner else ''}", flush=True)


def sweep() -> None:
    dev = torch.device("cuda")
    target = cuda_target(dev)
    ceiling = measure_ceiling(dev)
    print(f"copy ceiling {ceiling:.2f} TB/s")
    sms = target.vector_cores
    for n, tokens, dim in CASES:
        v = torch.randn(n, tokens, dim, device=dev, dtype=torch.bfloat16)
        q = torch.randn(dim, device=dev) * 0.05
        w = torch.rand(dim, device=dev) + 0.5
        g = torch.randn(tokens, dim, device=dev, dtype=torch.bfloat16)
        fwd_bytes, bwd_bytes = (n + 1) * tokens * dim * 2, (2 * n + 1) * tokens * dim * 2
        case = f"N{n} T{tokens} D{dim}"
        base = make_plan(target, tokens, dim, 2, backward=False)
        for block_t, warps, per_sm in ((2, 4, 0), (1, 4, 4), (2, 4, 2), (2, 4, 4)):
            if block_t * dim > 8192 and (block_t, warps) != (base.block_t, base.num_warps):
                continue
            blocks = -(-tokens // block_t)
            plan = dataclasses.replace(base, block_t=block_t, num_warps=warps,
                                       grid=min(blocks, per_sm * sms) if per_sm else blocks)
            same = (block_t, warps, plan.grid) == (base.block_t, base.num_warps, base.grid)
            _time(f"fwd {case} bt{block_t} w{warps} grid {plan.grid}", lambda: _forward(v, q, w, 1e-6, target, plan),
                  fwd_bytes, ceiling, same)
        out, lse = _forward(v, q, w, 1e-6, target)
        two_phase = backward_plan(target, tokens, dim, 2, one_pass=False)
        _time(f"bwd two-phase {case}", lambda: _backward(g, v, q, w, 1e-6, True, True, True, target), bwd_bytes,
              ceiling, True)
        base = backward_plan(target, tokens, dim, 2, one_pass=True)
        if not base.one_pass:
            print(f"bwd one-pass {case}: no one-pass plan (two-phase {two_phase})")
            continue
        for block_t, warps in ((1, 4), (1, 8), (2, 4)):
            if block_t * dim > 16384:
                continue
            for per_sm in (2, 4, 8):
                for unroll in (2,):
                    grid = min(-(-tokens // block_t), per_sm * sms)
                    plan = dataclasses.replace(base, block_t=block_t, num_warps=warps, grid=grid, unroll=unroll)
                    same = (block_t, warps, grid, unroll) == (base.block_t, base.num_warps, base.grid, base.unroll)
                    _time(f"bwd one-pass {case} bt{block_t} w{warps} {per_sm}/SM u{unroll}",
                          lambda: _backward(g, v, q, w, 1e-6, True, True, True, target, out, lse, None, plan),
                          bwd_bytes, ceiling, same)
        del v, g, out
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
