"""Where the device time of one fwd+bwd step goes, kernel by kernel (CUDA): python -m fusedops.bench.breakdown [op ...]

For the issue cases of each op it prints every kernel, copy and memset the profiler records in one
fusedops fwd+bwd step (averaged over 10 steps), in microseconds, and their sum: which launch to work on.
"""

from __future__ import annotations

import sys

import torch

import fusedops
from fusedops.bench import attn_res as bench_attn_res
from fusedops.bench import embedding as bench_embedding
from fusedops.bench import neighborhood_attention as bench_na
from fusedops.bench.common import gpu_kernel_times_us

REPS = 10


def steps(ops):
    dev, bf16 = "cuda", torch.bfloat16
    if "attn_res" in ops:
        for n, b, t, d in bench_attn_res.CASES:
            values = torch.randn(n, b, t, d, device=dev, dtype=bf16, requires_grad=True)
            query = (0.1 * torch.randn(d, device=dev)).requires_grad_()
            weight = torch.ones(d, device=dev, requires_grad=True)
            yield f"attn_res {n},{b},{t},{d}", (values, query, weight), lambda v, q, w: fusedops.attn_res(v, q, w)
    if "embedding" in ops:
        for v, d, tokens in bench_embedding.CASES:
            weight = torch.randn(v, d, device=dev, dtype=bf16, requires_grad=True)
            idx = torch.randint(0, v, (tokens,), device=dev)
            yield (f"embedding {v},{d},{tokens}", (weight, idx),
                   lambda w, i: fusedops.embedding(i, w))
    if "neighborhood_attention" in ops:
        for case in bench_na.CASES:
            b, h, spatial, d, kernel = case[:5]
            q, k, v = (torch.randn(b, h, *spatial, d, device=dev, dtype=bf16, requires_grad=True) for _ in range(3))
            yield (f"neighborhood_attention {bench_na.case_label(case)}", (q, k, v),
                   lambda q, k, v, kernel=kernel: fusedops.neighborhood_attention(q, k, v, kernel))


def main(ops) -> None:
    for name, inputs, fn in steps(ops):
        req = [t for t in inputs if t.is_floating_point()]
        go = torch.randn_like(fn(*inputs))
        times = gpu_kernel_times_us(lambda: torch.autograd.grad(fn(*inputs), req, go), REPS)
        print(f"{name}: {sum(times.values()):.1f} us per fwd+bwd step")
        for kernel, us in sorted(times.items(), key=lambda kv: -kv[1]):
            print(f"  {us:8.1f} us  {kernel[:70]}")
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:] or ["attn_res", "embedding", "neighborhood_attention"])
