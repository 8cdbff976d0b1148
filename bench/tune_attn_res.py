"""Sweep attn_res launch plans on a GPU (not part of `python -m bench`): times the forward and the
backward kernels for each (block_t, num_warps, grid) around the planner's choice, so a plan change
is backed by a measurement. Usage: python -m bench.tune_attn_res"""

from __future__ import annotations

import dataclasses

import torch
import triton.testing
from torch._library.triton import set_wrap_triton_enabled

from bench.common import measure_ceiling
from fusedops.attn_res.op import _backward, _forward
from fusedops.attn_res.plan import make_plan
from fusedops.targets import cuda_target

CASES = [(8, 8192, 4096), (16, 4096, 4096), (64, 2048, 4096), (8, 8192, 8192)]


def main() -> None:
    # Outside a triton_op body wrap_triton dispatches through a higher-order op (~1 ms of host time per
    # launch); the op itself launches directly, and so must the sweep.
    with set_wrap_triton_enabled(False):
        sweep()


def sweep() -> None:
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
        for backward in (False, True):
            base = make_plan(target, tokens, dim, 2, backward=backward)
            nbytes = bwd_bytes if backward else fwd_bytes
            for block_t, warps in ((1, 4), (1, 8), (2, 4), (2, 8)):
                for unroll in (1, 2):
                    for stages in (1,):
                        grid = -(-tokens // block_t)
                        grid = min(grid, 2 * target.vector_cores) if backward else grid
                        plan = dataclasses.replace(base, block_t=block_t, num_warps=warps, grid=grid,
                                                   unroll=unroll, num_stages=stages)
                        if backward:
                            fn = lambda: _backward(g, v, q, w, 1e-6, True, True, True, target, plan)  # noqa: E731
                        else:
                            fn = lambda: _forward(v, q, w, 1e-6, target, plan)  # noqa: E731
                        ms = triton.testing.do_bench(fn, return_mode="median")
                        same = (block_t, warps, unroll, stages) == (base.block_t, base.num_warps, base.unroll,
                                                                     base.num_stages)
                        print(f"{'bwd' if backward else 'fwd'} N{n} T{tokens} D{dim} bt{block_t} w{warps} "
                              f"u{unroll} s{stages}: {ms:.3f} ms {100 * nbytes / ms / 1e9 / ceiling:.0f}%"
                              f"{' (planner)' if same else ''}", flush=True)
        del v, g
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
