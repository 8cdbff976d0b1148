"""neighborhood_attention benchmark: fusedops vs FlexAttention (compiled, neighbourhood mask_mod), SDPA full
attention and Liger-Kernel 0.8.5's fused neighborhood attention (1-D, S <= 4096). Cases from issue #3.

Every provider runs the same shifted (NATTEN) window except Liger, whose window is the truncated one
(same work per query away from the borders). TFLOP/s counts the useful work only:
forward 4 * B * H * tokens * window * D, forward+backward 3.5x that.

    python -m fusedops.bench.neighborhood_attention [--quick] [--sweep]
    (also: python -m fusedops.bench neighborhood_attention)
--sweep adds fusedops rows for alternative tile boxes (fusedops.plan_override) to tune the CUDA plan.
"""

from __future__ import annotations

import math
import os
import sys

import torch
import torch.nn.functional as F

from fusedops.bench.common import Context, alternated_rows, measure, optional_import
from fusedops.neighborhood_attention.reference import axis_window

OP = "neighborhood_attention"
# (B, H, spatial, D, kernel)
CASES = [
    (2, 12, (4096,), 64, (7,)),
    (2, 16, (8192,), 128, (33,)),
    (1, 8, (16384,), 64, (129,)),
    (1, 16, (64, 64), 64, (7, 7)),
    (1, 24, (128, 128), 128, (13, 13)),
    (1, 16, (16, 32, 32), 64, (7, 7, 7)),
]
CPU_CASES = [(1, 2, (256,), 32, (7,)), (1, 2, (16, 16), 32, (5, 5))]
QUICK = {"cpu": [CPU_CASES[0]], "gpu": [CASES[0], CASES[3]]}
# Providers whose device time per call is also reported ("<name> (GPU time)": the eager steps of the
# small cases are host-bound, so wall time alone hides what the kernels take).
GPU_TIMED = ("fusedops", "flex", "sdpa(full)")
# Providers whose fwd and fwd+bwd calls are also timed in alternation (see alternated_rows).
ALTERNATED = ("fusedops", "flex")
SWEEP = {
    1: ["1,1,64/1,1,32", "1,1,128/1,1,64", "1,1,128/1,1,32/8", "1,1,128/1,1,128/8", "1,1,64/1,1,64/8"],
    2: ["1,8,8/1,8,8", "1,8,16/1,8,16/8", "1,8,8/1,16,16/8", "1,16,8/1,16,16/8"],
    3: ["4,4,4/4,4,8", "2,8,8/2,8,8/8", "4,4,8/4,4,8/4", "2,4,8/4,4,8"],
}


def case_label(case) -> str:
    b, h, spatial, d, kernel = case
    return f"B{b} H{h} {'x'.join(map(str, spatial))} D{d} k{'x'.join(map(str, kernel))}"


def neighborhood_mask_mod(spatial, kernel, dilation=None, causal=None):
    """FlexAttention mask_mod of fusedops' shifted (NATTEN) window, stride 1, over flattened row-major positions,
    built from the reference's per-axis window (fusedops.neighborhood_attention.reference.axis_window);
    dilation 1 and no causal axis unless given."""
    dilation = dilation or (1,) * len(spatial)
    causal = causal or (False,) * len(spatial)

    def mask_mod(b, h, q_idx, kv_idx):
        ok = None
        qr, kr = q_idx, kv_idx
        for length, k, d, c in reversed(list(zip(spatial, kernel, dilation, causal))):
            qi, ki = qr % length, kr % length
            qr, kr = qr // length, kr // length
            g = qi % d
            lg = length // d + (g < length % d).to(qi.dtype)
            lo, hi = axis_window(qi // d, lg, k, 1, c, "shifted")
            kw = ki // d
            inside = (ki % d == g) & (kw >= lo) & (kw <= hi)
            ok = inside if ok is None else ok & inside
        return ok

    return mask_mod


def make_inputs(ctx: Context, case):
    b, h, spatial, d, _ = case
    gen = torch.Generator(device=ctx.device).manual_seed(0)
    shape = (b, h, *spatial, d)
    q, k, v = (torch.randn(shape, device=ctx.device, dtype=ctx.dtype, generator=gen).requires_grad_() for _ in range(3))
    return q, k, v


class Lazy:
    """A provider built just before its case runs (compilation happens outside the timed region)."""

    def __init__(self, build):
        self.build = build


def providers(ctx: Context, case, sweep: bool):
    import fusedops

    b, h, spatial, d, kernel = case
    ndim = len(spatial)

    def fused(q, k, v):
        return fusedops.neighborhood_attention(q, k, v, list(kernel))

    yield "fusedops", fused, lambda t: t
    if ctx.device.type == "cuda" and not sweep:
        def compiled_factory():
            torch._dynamo.reset()
            return torch.compile(fused, fullgraph=True)

        # the same harness as flex: a compiled forward, autograd running the compiled backward
        yield "fusedops(compile)", Lazy(compiled_factory), lambda t: t
    if sweep and ctx.device.type == "cuda":
        for tiles in SWEEP[ndim]:
            def swept(q, k, v, tiles=tiles):
                from fusedops.neighborhood_attention.plan import tiles_from_string

                forced = tiles_from_string(tiles)  # the forward's and the backward's tiles, as given
                with fusedops.plan_override("neighborhood_attention", "fwd", **forced), \
                        fusedops.plan_override("neighborhood_attention", "bwd", **forced):
                    return fusedops.neighborhood_attention(q, k, v, list(kernel))

            yield f"fusedops[{tiles}]", swept, lambda t: t

    flat = lambda t: t.flatten(2, -2)  # noqa: E731  [B, H, S, D]
    if ctx.device.type == "cuda":
        def flex_factory():
            fa = optional_import("torch.nn.attention.flex_attention")
            torch._dynamo.reset()  # one compiled flex per case: never hit the recompile limit (eager fallback)
            tokens = math.prod(spatial)
            block_mask = fa.create_block_mask(neighborhood_mask_mod(spatial, kernel), None, None, tokens, tokens,
                                              device=ctx.device, _compile=True)
            compiled = torch.compile(fa.flex_attention)
            return lambda q, k, v: compiled(q, k, v, block_mask=block_mask)

        yield "flex", Lazy(flex_factory), flat
    yield "sdpa(full)", lambda q, k, v: F.scaled_dot_product_attention(q, k, v), flat
    if ndim == 1 and spatial[0] <= 4096 and not sweep:
        def liger(q, k, v):
            mod = optional_import("liger_kernel.ops.fused_neighborhood_attention")
            return mod.LigerFusedNeighborhoodAttentionFunction.apply(q, k, v, kernel[0], 1, None)

        yield "liger(truncated)", liger, lambda t: t


def run(ctx: Context, sweep: bool = False, all_cases: bool = False, stream: bool = False) -> list[dict]:
    cases = ctx.cases_of(sys.modules[__name__])
    if all_cases:
        cases = CPU_CASES if ctx.device.type == "cpu" else CASES
    rows = []
    for case in cases:
        b, h, spatial, d, kernel = case
        label = case_label(case)
        fwd_flops = 4.0 * b * h * math.prod(spatial) * math.prod(kernel) * d
        flops = {"fwd": fwd_flops, "fwd+bwd": 3.5 * fwd_flops}
        q, k, v = make_inputs(ctx, case)
        grad_out = torch.randn_like(q)
        steps = {}  # the calls timed again in alternation below
        for name, fn, view in providers(ctx, case, sweep):
            try:
                if isinstance(fn, Lazy):
                    fn = fn.build()
                qv, kv, vv = (view(t) for t in (q, k, v))
                go = view(grad_out)

                def fwd(fn=fn, qv=qv, kv=kv, vv=vv):
                    with torch.no_grad():
                        return fn(qv, kv, vv)

                def fwd_bwd(fn=fn, qv=qv, kv=kv, vv=vv, go=go):
                    return torch.autograd.grad(fn(qv, kv, vv), (q, k, v), go)

                fwd_bwd()  # compile / warm up outside the timed region
            except Exception as e:  # noqa: BLE001
                rows += ctx.failed(OP, label, name, ("fwd", "fwd+bwd"), e)
                ctx.empty_cache()
                continue
            rows.append(measure(ctx, OP, label, name, "fwd", fwd, flops=flops["fwd"]))
            rows.append(measure(ctx, OP, label, name, "fwd+bwd", fwd_bwd, flops=flops["fwd+bwd"]))
            if name in ALTERNATED:
                steps[name] = {"fwd": fwd, "fwd+bwd": fwd_bwd}
            if ctx.device.type == "cuda" and name in GPU_TIMED:
                for mode, f in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
                    rows.append(measure(ctx, OP, label, name, mode, f, flops=flops[mode], gpu_time=True))
            if stream:
                print(_table(rows[-2:]).split("\n", 1)[1], flush=True)
            ctx.empty_cache()
        if ctx.device.type == "cuda" and len(steps) == len(ALTERNATED):
            for mode in ("fwd", "fwd+bwd"):
                rows += alternated_rows(ctx, OP, label, mode, {name: fns[mode] for name, fns in steps.items()},
                                        flops=flops[mode])
        del q, k, v, grad_out, steps
        ctx.empty_cache()
    return rows


def _table(rows) -> str:
    lines = [f"{'case':34s} {'provider':28s} {'mode':8s} {'ms':>9s} {'TFLOP/s':>8s} {'peak MB':>9s}"]
    for r in rows:
        if r.get("error"):
            lines.append(f"{r['case']:34s} {r['provider']:28s} {r['mode']:8s} error: {r['error'][:80]}")
            continue
        peak = r.get("peak_mb")
        lines.append(f"{r['case']:34s} {r['provider']:28s} {r['mode']:8s} {r['ms']:9.3f} {r.get('tflops', 0):8.2f} "
                     f"{peak if peak is None else round(peak, 1)!s:>9s}")
    return "\n".join(lines)


if __name__ == "__main__":
    from fusedops.bench.common import DTYPES, detect_device

    args = sys.argv[1:]
    device = detect_device()
    ctx = Context(device=device, dtype=DTYPES["bf16"] if device.type != "cpu" else torch.float32,
                  quick="--quick" in args or "--fast" in args, verbose=False)
    result = run(ctx, sweep="--sweep" in args, all_cases="--fast" in args, stream="--stream" in args)
    print(_table(result))
