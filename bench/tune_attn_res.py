"""Sweep attn_res launch plans on a GPU (not part of `python -m bench`): times the forward and the
backward kernels for each (block_t, num_warps, grid) around the planner's choice, so a plan change
is backed by a measurement. Usage: python -m bench.tune_attn_res"""

from __future__ import annotations

import dataclasses

import torch
import triton.testing

from bench.common import measure_ceiling
from fusedops.attn_res.op import _backward, _forward
from fusedops.attn_res.plan import make_plan
from fusedops.targets import cuda_target

CASES = [(8, 8192, 4096), (16, 4096, 4096), (64, 2048, 4096), (8, 8192, 8192)]


def main() -> None:
    dev = torch.device("cuda")
    target = cuda_target(dev)
    ceiling = measure_ceiling(dev)
    print(f"copy ceiling {ceiling:.2f} TB/s")
    for n, tokens, dim in CASES:
        v = torch.randn(n, tokens, dim, device=dev, dtype=torch.bfloat16)
        q = torch.randn(dim, device=dev) * 0.05
        w = torch.rand(dim, device=dev) + 0.5
        g = torch.randn(tokens, dim, device=dev, dtype=torch.bfloat16)
        fwd_bytes, bwd_bytes = (n + 1) * tokens * dim * 2, (2 * n + 1) * tokens * dim * 2
        base = make_plan(target, tokens, dim, 2, backward=False)
        for block_t in (1, 2, 4):
            for warps in (4, 8, 16):
                plan = dataclasses.replace(base, block_t=block_t, num_warps=warps, grid=-(-tokens // block_t))
                ms = triton.testing.do_bench(lambda: _forward(v, q, w, 1e-6, target, plan), return_mode="median")
                tag = " (planner)" if (block_t, warps) == (base.block_t, base.num_warps) else ""
                print(f"fwd N{n} T{tokens} D{dim} bt{block_t} w{warps}: {ms:.3f} ms "
                      f"{100 * fwd_bytes / ms / 1e9 / ceiling:.0f}%{tag}")
        base = make_plan(target, tokens, dim, 2, backward=True)
        for block_t in (1, 2):
            for warps in (4, 8, 16):
                for resident in (2, 4, 8):
                    plan = dataclasses.replace(base, block_t=block_t, num_warps=warps,
                                               grid=min(-(-tokens // block_t), target.vector_cores * resident))
                    ms = triton.testing.do_bench(
                        lambda: _backward(g, v, q, w, 1e-6, True, True, True, target, plan), return_mode="median")
                    tag = " (planner)" if plan == base else ""
                    print(f"bwd N{n} T{tokens} D{dim} bt{block_t} w{warps} grid{plan.grid}: {ms:.3f} ms "
                          f"{100 * bwd_bytes / ms / 1e9 / ceiling:.0f}%{tag}")
        del v, g
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
