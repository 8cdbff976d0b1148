"""What the forward's device assert costs: the embedding forward kernel as shipped (debug mode for its
tl.device_assert, overflow sanitizer off) against the same source compiled without debug mode (the assert
compiled out), kernel-only do_bench medians, bf16, uniform indices. Last run: torch 2.11, Triton 3.6, H100.
python -m bench.experiments.embedding_assert_cost"""

import torch
import triton
import triton.testing

from fusedops.embedding.kernels import embedding_fwd_kernel
from fusedops.embedding.plan import make_plan
from fusedops.targets import target_for

plain = triton.jit(embedding_fwd_kernel.fn)  # same source, debug off: the assert is compiled out
for v, d, tokens in [(151936, 4096, 16384), (32000, 768, 65536), (256000, 8192, 2048)]:
    w = torch.randn(v, d, device="cuda", dtype=torch.bfloat16)
    idx = torch.randint(0, v, (tokens,), device="cuda")
    out = torch.empty(tokens, d, device="cuda", dtype=torch.bfloat16)
    p = make_plan(target_for(w.device), tokens, d, 2, backward=False)
    args = (idx, w, out, tokens, v, d, 1, w.stride(0), 1)
    meta = dict(BLOCK_T=p.block_rows, BLOCK_D=p.block_d, num_warps=p.num_warps)
    times = {}
    for name, k, extra in [("assert", embedding_fwd_kernel, dict(sanitize_overflow=False)), ("plain", plain, {})]:
        times[name] = triton.testing.do_bench(lambda: k[(p.grid,)](*args, **meta, **extra), return_mode="median")
    print(f"{v},{d},{tokens}: with assert {times['assert'] * 1e3:.1f} us, without {times['plain'] * 1e3:.1f} us "
          f"({times['assert'] / times['plain']:.3f}x)")
