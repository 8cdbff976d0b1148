"""GPU check of the float scalar split (numerics.float_args): float64 kernels against the float64 reference, and the
float32/16-bit kernels eager against torch.compile (Inductor passes float64 scalars). python -m
bench.experiments.float_args_gpu_check"""

import torch

import fusedops

torch.manual_seed(0)
dev = "cuda"
F64 = torch.float64


def results(fn, leaves):
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    outs = fn(*leaves)
    loss = sum((o * torch.linspace(-1, 1, o.numel(), dtype=o.dtype, device=o.device).reshape(o.shape)).sum()
               for o in outs)
    return [o.detach() for o in outs] + list(torch.autograd.grad(loss, leaves))


cases = {
    "attn_res": (lambda v, q, w: fusedops.attn_res(v, q, w, eps=0.3, return_lse=True),
                 lambda d: (0.3 * torch.randn(3, 64, 96, dtype=d), torch.randn(96, dtype=d),
                            torch.rand(96, dtype=d) + .5)),
    "attn_res_multi": (lambda v, q: fusedops.attn_res_multi(v, q, eps=0.3),
                       lambda d: (0.3 * torch.randn(3, 64, 96, dtype=d), torch.randn(4, 96, dtype=d))),
    "attn_res_merge": (lambda o, lse, p, q, a, g: fusedops.attn_res_merge(o, lse, p, q, a, g, eps=0.3, norm_eps=0.7),
                       lambda d: (torch.randn(64, 96, dtype=d), torch.randn(64, dtype=d),
                                  0.3 * torch.randn(64, 96, dtype=d), torch.randn(96, dtype=d),
                                  0.1 * torch.randn(64, 96, dtype=d), torch.rand(96, dtype=d) + .5)),
    "na_1d": (lambda q, k, v: fusedops.neighborhood_attention(q, k, v, 5, scale=0.3, return_lse=True),
              lambda d: tuple(torch.randn(1, 2, 64, 32, dtype=d) for _ in range(3))),
    "na_2d": (lambda q, k, v: fusedops.neighborhood_attention(q, k, v, 3, scale=0.3, return_lse=True),
              lambda d: tuple(torch.randn(1, 2, 12, 13, 32, dtype=d) for _ in range(3))),
}
print(f"{'case':<16} {'f64 gpu vs cpu ref':>18} {'bf16 compiled vs eager':>22}")
for name, (fn, make) in cases.items():
    inputs = make(F64)
    want = results(fn, inputs)  # CPU: the float64 reference
    got = results(fn, [t.to(dev) for t in inputs])
    err64 = max((g.cpu() - w).abs().max().item() for g, w in zip(got, want))
    # 16-bit values; the merge's lse stays float32
    inputs16 = [t.to(dev, torch.float32 if name == "attn_res_merge" and i == 1 else torch.bfloat16)
                for i, t in enumerate(make(torch.float32))]
    eager = results(fn, inputs16)
    compiled = results(torch.compile(fn, fullgraph=True), inputs16)
    errc = max((a.float() - b.float()).abs().max().item() for a, b in zip(eager, compiled))
    print(f"{name:<16} {err64:18.2e} {errc:22.2e}", flush=True)
# 16-bit one-pass backward with a NaN value: every gradient of that token NaN (was uninitialised memory)
v = torch.randn(9, 4, 4096, dtype=torch.float16, device=dev)
v[2, 1, 5] = float("nan")
v.requires_grad_()
fusedops.attn_res(v, torch.randn(4096, dtype=torch.float16, device=dev)).float().sum().backward()
print("one-pass NaN token: NaN gradients", int(v.grad[:, 1].isnan().sum()), "of", 9 * 4096)
