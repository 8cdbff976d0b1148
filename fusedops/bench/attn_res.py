"""attn_res benchmark: fusedops vs the eager reference, torch.compile of the
reference, Liger-Kernel and fla-core when importable. Cases (N, B, T, D) from issue #2."""

from __future__ import annotations

import sys

import torch

from fusedops.bench.common import Context, cuda_graph_step, fwd_bwd_fns, measure, optional_import

OP = "attn_res"
CASES = [(8, 1, 8192, 4096), (16, 1, 4096, 4096), (32, 1, 4096, 4096), (4, 2, 4096, 4096), (8, 2, 4096, 8192),
         (64, 1, 2048, 4096)]
CPU_CASES = [(8, 1, 512, 1024), (16, 1, 256, 1024)]
QUICK = {"cpu": [(4, 1, 128, 256)], "gpu": [(8, 1, 4096, 4096)]}
GPU_TIMED = ("fusedops", "liger", "fla")


def eager(values, query, norm_weight, eps=1e-6):
    keys = values.float() * torch.rsqrt(values.float().pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
    alpha = torch.softmax((keys * query.float()).sum(-1), dim=0)
    return (alpha.unsqueeze(-1) * values.float()).sum(0).to(values.dtype)


def liger(v, q, w):
    """Liger-Kernel's LigerAttnResFunction; MissingBaseline when it does not import."""
    mod = optional_import("liger_kernel.ops.attn_res")
    return mod.LigerAttnResFunction.apply(v, q, w, 1e-6)


def fla(v, q, w):
    """fla-core's fused_attnres over the N sources as a list; MissingBaseline when it does not import."""
    mod = optional_import("fla.ops.attnres")
    return mod.fused_attnres(q, list(v.unbind(0)), w, rms_eps=1e-6)


def providers():
    import fusedops

    yield "fusedops", lambda v, q, w: fusedops.attn_res(v, q, w)
    yield "eager", eager
    compiled = torch.compile(eager, dynamic=False)
    yield "torch.compile", compiled
    yield "liger", liger
    yield "fla", fla


def run(ctx: Context) -> list[dict]:
    cases = ctx.cases_of(sys.modules[__name__])
    rows = []
    for case in cases:
        torch._dynamo.reset()  # one compiled graph per case, never the recompile limit
        n, b, t, d = case
        tokens = b * t
        esize = torch.tensor([], dtype=ctx.dtype).element_size()
        nbytes = {"fwd": (n + 1) * tokens * d * esize, "bwd": (2 * n + 1) * tokens * d * esize}
        nbytes["fwd+bwd"] = nbytes["fwd"] + nbytes["bwd"]
        values = torch.randn(n, b, t, d, device=ctx.device, dtype=ctx.dtype, requires_grad=True)
        query = (0.1 * torch.randn(d, device=ctx.device)).requires_grad_()
        norm_weight = torch.ones(d, device=ctx.device, requires_grad=True)
        for name, fn in providers():
            try:
                fns = fwd_bwd_fns(lambda fn=fn: fn(values, query, norm_weight), [values, query, norm_weight])
            except Exception as e:  # noqa: BLE001
                rows += ctx.failed(OP, case, name, ("fwd", "bwd", "fwd+bwd"), e)
                continue
            for mode, f in fns.items():
                rows.append(measure(ctx, OP, case, name, mode, f, nbytes=nbytes[mode]))
            if ctx.device.type == "cuda" and name in GPU_TIMED:
                # small cases are host-bound in eager mode: the device's own time, beside the wall clock
                rows.append(measure(ctx, OP, case, name, "fwd+bwd", fns["fwd+bwd"], nbytes=nbytes["fwd+bwd"],
                                    gpu_time=True))
            if ctx.device.type == "cuda" and name == "fusedops":
                # and the wall clock of the step replayed from a CUDA graph (fusedops never syncs the host)
                replay = cuda_graph_step(fn, [values, query, norm_weight])
                rows.append(measure(ctx, OP, case, f"{name} (CUDA graph)", "fwd+bwd", replay,
                                    nbytes=nbytes["fwd+bwd"], memory=False))
                del replay
            del fns
        del values, query, norm_weight
        ctx.empty_cache()
    return rows
