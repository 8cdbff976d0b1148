"""Device time of each op's fwd+bwd step on the cases of the benchmark (no baselines): a quick check that a
change left the kernels' speed alone, against the GPU times in bench/NOTES.md. bf16, profiler time, ms.
Last run: torch 2.11, Triton 3.6, H100. python -m bench.experiments.step_times"""

import torch

import fusedops
from fusedops.bench.common import gpu_time_ms
from fusedops.bench.neighborhood_attention import CASES as NA_CASES


def step(fn, inputs, grad):
    leaves = [t.detach().requires_grad_() for t in inputs]
    return lambda: torch.autograd.grad(fn(*leaves), leaves, grad)


def main() -> None:
    rows = []
    dev, bf16 = "cuda", torch.bfloat16
    for b, h, spatial, d, ks in NA_CASES:
        q, k, v = (torch.randn(b, h, *spatial, d, device=dev, dtype=bf16) for _ in range(3))
        fwd = lambda q, k, v, ks=ks: fusedops.neighborhood_attention(q, k, v, list(ks))  # noqa: E731
        rows.append((f"NA {'x'.join(map(str, spatial))} k{ks[0]} D{d}", gpu_time_ms(step(fwd, (q, k, v), torch.randn_like(q)))))
    for n, tokens, dim in ((8, 8192, 4096), (4, 8192, 4096)):
        values = torch.randn(n, tokens, dim, device=dev, dtype=bf16)
        query, weight = torch.randn(dim, device=dev), torch.ones(dim, device=dev)
        rows.append((f"attn_res N{n} T{tokens} D{dim}", gpu_time_ms(step(
            fusedops.attn_res, (values, query, weight), torch.randn(tokens, dim, device=dev, dtype=bf16)))))
    for v, dim, tokens in ((151936, 4096, 16384), (32768, 768, 16384)):
        weight = torch.randn(v, dim, device=dev, dtype=bf16)
        idx = torch.randint(0, v, (tokens,), device=dev)
        leaf = weight.requires_grad_()
        grad = torch.randn(tokens, dim, device=dev, dtype=bf16)
        rows.append((f"embedding V{v} D{dim} T{tokens}",
                     gpu_time_ms(lambda: torch.autograd.grad(fusedops.embedding(idx, leaf), [leaf], grad))))
    print(f"\n{torch.cuda.get_device_name()}, bf16, fwd+bwd device time (ms)")
    for name, ms in rows:
        print(f"{name:<36} {ms:8.4f}")


if __name__ == "__main__":
    main()
