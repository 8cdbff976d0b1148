"""Block AttnRes benchmark (issue 37): fusedops.attn_res_multi and fusedops.attn_res_merge against the unfused
composition (single-query fusedops.attn_res calls, RMSNorm and residual adds; fla-core's fused_attnres when
importable), forward, inference form.

    python -m fusedops.bench.block_attn_res [--quick] [--device cuda|npu|cpu] [--dtype bf16|fp16|fp32]
                                            [--parts multi merge block decode] [--sizes ...]

Parts and what issue 37 asks of them (U = tokens x D x element size):
  multi   phase 1, cases (N, M, tokens, D): >= 85% of copy bandwidth counting (N + M) U (+ the fp32 lse);
          providers fusedops.attn_res_multi, M x fusedops.attn_res (single query), eager.
  merge   phase 2 with one addend and the output norm, cases (tokens, D): >= 85% of copy counting 5 U
          (out, partial, addend read; h, partial' written); against add + merge + rms_norm unfused.
  block   a block of M merges after phase 1, cases (N, M, tokens, D): >= 1.8x faster than M x (add into the
          bank + fusedops.attn_res over [b_0..b_{N-1}, p] + rms_norm), and than fla-core's fused_attnres with its
          output norm; the byte floor is (N + 2 M + 5 M) U, reported as % of copy against it.
  decode  per-sublayer latency at 1, 8, 64, 512 tokens (N = 9, D = 7168): phase 1 / M + one merge, replayed from a
          CUDA graph on CUDA; target: no slower than fla's single-query kernel (10.9 us at 1 token on the H100).
  multi-bwd  phase 1 forward+backward (gradients of values and queries, training form), eager, against M x
          fusedops.attn_res with their backward; % of copy counting (N + M) U forward and (2N + M) U backward
          (values and grad_out read, grad_values written). No issue target: issue 37 asks that it be timed.
Not in `python -m fusedops.bench`'s op list (its CPU parity check has no Block AttnRes case yet): run it directly.
On a CPU the PyTorch reference path is timed at tiny sizes (indicative only).
"""

from __future__ import annotations

import argparse
import sys

import torch

from fusedops.bench.common import (DTYPES, Context, cuda_graph, detect_device, measure, measure_ceiling,
                                   optional_import)

OP = "block_attn_res"
# (N, M, tokens, D)
MULTI_CASES = [(n, m, t, d) for n in (4, 8, 9) for m in (6, 16, 24) for d in (4096, 7168) for t in (2048, 8192, 32768)]
MERGE_CASES = [(t, d) for t in (2048, 8192, 32768) for d in (4096, 7168)]
BLOCK_CASES = [(8, 24, 8192, 7168), (8, 24, 2048, 7168), (4, 24, 8192, 4096)]
DECODE_CASES = [(9, 24, t, 7168) for t in (1, 8, 64, 512)]
CPU = {"multi": [(3, 4, 64, 256)], "merge": [(64, 256)], "block": [(3, 4, 64, 256)], "decode": [(3, 4, 1, 256)],
       "multi-bwd": [(3, 4, 64, 256)]}
MULTI_BWD_CASES = [(8, 24, 8192, 7168), (8, 24, 2048, 7168), (9, 6, 8192, 4096), (9, 16, 8192, 7168),
                   (4, 16, 32768, 4096), (4, 6, 32768, 4096)]
GPU = {"multi": MULTI_CASES, "merge": MERGE_CASES, "block": BLOCK_CASES, "decode": DECODE_CASES,
       "multi-bwd": MULTI_BWD_CASES}
QUICK = {"cpu": {k: v[:1] for k, v in CPU.items()},
         "gpu": {"multi": [(8, 24, 8192, 7168)], "merge": [(8192, 7168)], "block": [(8, 24, 8192, 7168)],
                 "decode": [(9, 24, 1, 7168)], "multi-bwd": [(8, 24, 8192, 7168)]}}
PARTS = ("multi", "merge", "block", "decode", "multi-bwd")
EPS = 1e-6


def _rms_norm(h, gain):
    return torch.nn.functional.rms_norm(h, (h.shape[-1],), gain, EPS)


def _eager_multi(values, queries):
    v = values.float()
    rstd = torch.rsqrt(v.square().mean(-1, keepdim=True) + EPS)
    logits = torch.einsum("ntd,md->mnt", v, queries.float()) * rstd.squeeze(-1)
    alpha = torch.softmax(logits, dim=1)
    return torch.einsum("mnt,ntd->mtd", alpha, v).to(values.dtype), torch.logsumexp(logits, dim=1)


def _inputs(ctx: Context, n: int, m: int, tokens: int, dim: int):
    dev, dt = ctx.device, ctx.dtype
    bank = torch.randn(tokens, n + 2, dim, device=dev, dtype=dt)  # token-major [tokens, N_max, D], K3's layout
    queries = 0.05 * torch.randn(m, dim, device=dev)
    gain = torch.rand(dim, device=dev) + 0.5
    addend = torch.randn(tokens, dim, device=dev, dtype=dt)
    return bank, queries, gain, addend


def run_multi(ctx: Context, cases) -> list[dict]:
    import fusedops

    rows = []
    esize = torch.empty((), dtype=ctx.dtype).element_size()
    for case in cases:
        n, m, tokens, dim = case
        bank, queries, _, _ = _inputs(ctx, n, m, tokens, dim)
        values = bank[:, :n].movedim(1, 0)  # read in place
        nbytes = (n + m) * tokens * dim * esize + m * tokens * 4
        with torch.no_grad():
            rows.append(measure(ctx, OP, ("multi",) + case, "fusedops", "fwd",
                                lambda: fusedops.attn_res_multi(values, queries, EPS), nbytes=nbytes))
            rows.append(measure(ctx, OP, ("multi",) + case, "M x fusedops.attn_res", "fwd",
                                lambda: [fusedops.attn_res(values, q, None, EPS, return_lse=True) for q in queries],
                                nbytes=nbytes))
            contiguous = values.contiguous()
            rows.append(measure(ctx, OP, ("multi",) + case, "eager", "fwd", lambda: _eager_multi(contiguous, queries),
                                nbytes=nbytes))
        del bank, values
        ctx.empty_cache()
    return rows


def run_multi_backward(ctx: Context, cases) -> list[dict]:
    import fusedops

    rows = []
    esize = torch.empty((), dtype=ctx.dtype).element_size()
    for case in cases:
        n, m, tokens, dim = case
        values = torch.randn(n, tokens, dim, device=ctx.device, dtype=ctx.dtype).requires_grad_()
        queries = (0.05 * torch.randn(m, dim, device=ctx.device)).requires_grad_()
        grad_out = torch.randn(m, tokens, dim, device=ctx.device, dtype=ctx.dtype)
        nbytes = (3 * n + 2 * m) * tokens * dim * esize + m * tokens * 4

        def fused():
            values.grad = queries.grad = None
            out, _ = fusedops.attn_res_multi(values, queries, EPS)
            out.backward(grad_out)

        def single():
            values.grad = queries.grad = None
            outs = [fusedops.attn_res(values, q, None, EPS) for q in queries.unbind(0)]
            torch.autograd.backward(outs, list(grad_out.unbind(0)))

        rows.append(measure(ctx, OP, ("multi-bwd",) + case, "fusedops", "fwd+bwd", fused, nbytes=nbytes))
        rows.append(measure(ctx, OP, ("multi-bwd",) + case, "M x fusedops.attn_res", "fwd+bwd", single,
                            nbytes=nbytes))
        values.grad = queries.grad = None
        del values, queries, grad_out
        ctx.empty_cache()
    return rows


def run_merge(ctx: Context, cases) -> list[dict]:
    import fusedops

    rows = []
    esize = torch.empty((), dtype=ctx.dtype).element_size()
    for case in cases:
        tokens, dim = case
        bank, queries, gain, addend = _inputs(ctx, 1, 1, tokens, dim)
        out, partial = bank[:, 0].contiguous(), bank[:, 1].contiguous()
        lse = torch.randn(tokens, device=ctx.device)
        nbytes = 5 * tokens * dim * esize + tokens * 4

        def unfused():
            p = partial + addend
            s = (p.float() * queries[0]).sum(-1) * torch.rsqrt(p.float().square().mean(-1) + EPS)
            h = (torch.sigmoid(lse - s)[:, None] * out.float() + torch.sigmoid(s - lse)[:, None] * p.float())
            return _rms_norm(h.to(out.dtype), gain.to(out.dtype)), p

        with torch.no_grad():
            rows.append(measure(ctx, OP, ("merge",) + case, "fusedops", "fwd",
                                lambda: fusedops.attn_res_merge(out, lse, partial, queries[0], addend, gain, EPS),
                                nbytes=nbytes))
            rows.append(measure(ctx, OP, ("merge",) + case, "unfused (add + merge + rms_norm)", "fwd", unfused,
                                nbytes=nbytes))
        ctx.empty_cache()
    return rows


def _block_fns(ctx: Context, case):
    """(fused, single-query composition, fla or None) callables of one block's forward."""
    import fusedops

    n, m, tokens, dim = case
    bank, queries, gain, addend = _inputs(ctx, n, m, tokens, dim)
    values = bank[:, :n].movedim(1, 0)
    start = bank[:, n].clone()
    gain_t = gain.to(ctx.dtype)

    def fused():
        out, lse = fusedops.attn_res_multi(values, queries, EPS)
        p = start
        for l in range(m):
            # p' alternates between the bank's two spare slots (written in place, never over its own input)
            y, p = fusedops.attn_res_merge(out[l], lse[l], p, queries[l], addend, gain, EPS,
                                           partial_out=bank[:, n + (l + 1) % 2])
        return y

    stacked = torch.empty(n + 1, tokens, dim, device=ctx.device, dtype=ctx.dtype)
    stacked[:n] = values

    def single():
        stacked[n].copy_(start)
        for l in range(m):
            torch.add(stacked[n], addend, out=stacked[n])  # the residual add, into the bank
            y = _rms_norm(fusedops.attn_res(stacked, queries[l], None, EPS), gain_t)
        return y

    fla = None
    try:
        mod = optional_import("fla.ops.attnres")

        ones = torch.ones(dim, device=ctx.device)  # the queries already hold the key-norm gains

        def fla():
            srcs = list(values.unbind(0))
            p = start.clone()
            for l in range(m):
                p = p + addend
                y = mod.fused_attnres(queries[l], srcs + [p], ones, output_rms_weight=gain_t, rms_eps=EPS)
            return y
    except Exception:  # noqa: BLE001 - optional baseline
        fla = None
    return fused, single, fla


def run_block(ctx: Context, cases, part: str = "block") -> list[dict]:
    rows = []
    esize = torch.empty((), dtype=ctx.dtype).element_size()
    for case in cases:
        n, m, tokens, dim = case
        floor = (n + 2 * m + 5 * m) * tokens * dim * esize  # ~(N + 7M) U: issue 37's 152 U at N = 8, M = 24
        fused, single, fla = _block_fns(ctx, case)
        per = m if part == "decode" else 1
        with torch.no_grad():
            for name, fn in (("fusedops (phase 1 + M merges)", fused),
                             ("M x fusedops.attn_res + rms_norm + add", single),
                             ("fla fused_attnres (output norm) + add", fla)):
                if fn is None:
                    continue
                if part == "decode" and ctx.device.type == "cuda":
                    fn = cuda_graph(fn)
                    name += " (CUDA graph)"
                r = measure(ctx, OP, (part,) + case, name, "fwd", fn, nbytes=floor, memory=part != "decode")
                if r.get("ms") is not None and per > 1:
                    r["us_per_sublayer"] = 1e3 * r["ms"] / per
                rows.append(r)
        ctx.empty_cache()
    return rows


def run(ctx: Context, parts=PARTS) -> list[dict]:
    table = QUICK["cpu" if ctx.device.type == "cpu" else "gpu"] if ctx.quick else (
        CPU if ctx.device.type == "cpu" else GPU)
    rows = []
    for part in parts:
        cases = table[part]
        if ctx.sizes:
            cases = [c for c in cases if any(s.replace(" ", "") in ",".join(map(str, c)) for s in ctx.sizes)]
        runner = {"multi": run_multi, "merge": run_merge, "multi-bwd": run_multi_backward}.get(part)
        rows += runner(ctx, cases) if runner else run_block(ctx, cases, part)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fusedops.bench.block_attn_res", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "npu", "cpu"], default=None)
    p.add_argument("--dtype", choices=list(DTYPES), default=None)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--sizes", nargs="+", default=None, help='cases containing one of these, e.g. "8,24,8192"')
    args = p.parse_args(argv)
    device = detect_device(args.device)
    dtype = DTYPES[args.dtype] if args.dtype else (torch.float32 if device.type == "cpu" else torch.bfloat16)
    ctx = Context(device=device, dtype=dtype, quick=args.quick, sizes=args.sizes)
    if device.type != "cpu":
        ctx.ceiling_tbps = measure_ceiling(device, args.quick)
    rows = []
    for part in args.parts:  # printed part by part, so a run cut by a time limit keeps what it measured
        part_rows = run(ctx, [part])
        for r in part_rows:
            extra = "".join(f" {k}={r[k]:.4g}" for k in ("tbps", "pct_ceiling", "us_per_sublayer")
                            if r.get(k) is not None)
            status = f"{r['ms']:.4g} ms" if r.get("ms") is not None else f"ERROR {r.get('error')}"
            print(f"{r['case']:>24}  {r['provider']:<44} {status}{extra}", flush=True)
        rows += part_rows
    return 1 if any(r.get("error") and not r.get("missing") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
