"""Where the wall clock of a small eager embedding fwd+bwd step goes (host vs GPU), against torch's.
Beside each step's host, wall and GPU time, its do_bench median as the
acceptance grid times it. Last run: torch 2.11, Triton 3.6, H200. python -m bench.experiments.embedding_host"""

import cProfile
import io
import pstats

import torch
import torch.nn.functional as F
import triton.testing

import fusedops
from fusedops.bench.common import gpu_time_ms
from fusedops.bench.host import host_ms, wall_ms
from fusedops.embedding import op as emb
from fusedops.registry import call_direct
from fusedops.targets import target_for

for v, d, tokens in [(50257, 768, 2048), (256000, 768, 8192), (32000, 768, 16384)]:
    w = torch.randn(v, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    idx = torch.randint(0, v, (tokens,), device="cuda")
    go = torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16)
    target = target_for(w.device)
    steps = {
        "fusedops fwd+bwd": lambda: torch.autograd.grad(fusedops.embedding(idx, w), [w], go),
        "torch fwd+bwd": lambda: torch.autograd.grad(F.embedding(idx, w), [w], go),
        "fusedops fwd (grad on)": lambda: fusedops.embedding(idx, w),
        "fusedops fwd (no grad)": lambda: fusedops.embedding(idx, w.detach()),
        "torch fwd (no grad)": lambda: F.embedding(idx, w.detach()),
        "fusedops backward body": lambda: call_direct(emb._run_backward, go, idx, v, -1, False),
        "torch backward op": lambda: torch.ops.aten.embedding_backward(go, idx, v, -1, False, False),
        "run detection (_sorted_runs)": lambda: call_direct(emb._sorted_runs, idx, v, target),
        "torch.sort int16": lambda: torch.sort(idx.to(torch.int16), stable=True),
        "torch.empty x3": lambda: (torch.empty(v, d, device="cuda"), torch.empty(tokens, device="cuda"),
                                   torch.empty(v + 1, device="cuda")),
    }
    print(f"== V={v} D={d} tokens={tokens} (ms)")
    print(f"{'step':<32} {'host':>7} {'wall':>7} {'GPU':>7} {'do_bench':>8}")
    for name, fn in steps.items():
        bench = triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")  # as the grid times it
        print(f"{name:<32} {host_ms(fn):7.4f} {wall_ms(fn):7.4f} {gpu_time_ms(fn):7.4f} {bench:8.4f}")
    for name in ("fusedops fwd+bwd", "fusedops fwd (no grad)"):
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            steps[name]()
        prof.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(14)
        print(f"-- cProfile, 200 calls of {name}")
        print("\n".join(s.getvalue().splitlines()[:36]))
