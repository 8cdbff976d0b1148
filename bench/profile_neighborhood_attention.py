"""Kernel-time breakdown of one fusedops neighborhood_attention fwd+bwd step (CUDA), to tell GPU time
from host overhead: python -m bench.profile_neighborhood_attention"""

import time

import torch

import fusedops

for shape, kernel in (((2, 12, 4096, 64), [7]), ((1, 16, 64, 64, 64), [7, 7])):
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    go = torch.randn_like(q)

    def step():
        return torch.autograd.grad(fusedops.neighborhood_attention(q, k, v, kernel), (q, k, v), go)

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(50):
        step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t) / 50 * 1e3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            step()
        torch.cuda.synchronize()
    kern = {}
    for e in prof.key_averages():
        if e.device_type.name == "CUDA":
            kern[e.key] = getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0)) / 10 / 1e3
    print(f"{shape} k{kernel}: wall {wall:.3f} ms/step; GPU ms/step by kernel: "
          + ", ".join(f"{n[:28]}={t:.3f}" for n, t in sorted(kern.items(), key=lambda x: -x[1])[:6]))
