"""Kernel-vs-reference parity on CPU: a tiny case of each op through the op's PyTorch reference and
through the Triton kernels under the interpreter (FUSEDOPS_INTERPRET=cuda and =ascend), each compared
with an independent float64 formula, forward and every gradient.

Run by `python -m fusedops.bench` on CPU as a subprocess with TRITON_INTERPRET=1 (set before triton is first
imported); prints one JSON list of rows on its last stdout line:

    TRITON_INTERPRET=1 python -m fusedops.bench.parity attn_res --paths reference cuda ascend

An op module `fusedops/bench/<op>.py` may override the built-in case with
`parity_case(device, dtype) -> (fn, inputs, expected_fn)`: fn(*inputs) runs fusedops, expected_fn(*inputs)
gives the float64 answer (inputs are passed to it converted to float64).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
import time
from typing import Callable, Optional

import torch
import torch.nn.functional as F

PROVIDER = {"reference": "fusedops[reference]", "cuda": "fusedops[cuda-plan,interp]", "ascend": "fusedops[ascend-plan,interp]"}
TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}


# ---- built-in tiny cases: (case name, fusedops fn, inputs, float64 expected fn) ---------------------


def _attn_res_case(gen: torch.Generator):
    import fusedops

    n, b, t, d = 5, 2, 3, 40
    values = torch.randn(n, b, t, d, generator=gen)
    query = 0.5 * torch.randn(d, generator=gen)
    norm_weight = 1 + 0.1 * torch.randn(d, generator=gen)

    def expected(values, query, norm_weight, eps=1e-6):
        keys = values * torch.rsqrt(values.pow(2).mean(-1, keepdim=True) + eps) * norm_weight
        alpha = torch.softmax((keys * query).sum(-1), dim=0)
        return (alpha.unsqueeze(-1) * values).sum(0)

    return f"N{n} B{b} T{t} D{d}", lambda v, q, w: fusedops.attn_res(v, q, w), (values, query, norm_weight), expected


def _embedding_case(gen: torch.Generator):
    import fusedops

    v, d = 50, 24
    weight = torch.randn(v, d, generator=gen)
    indices = torch.randint(0, v, (3, 7), generator=gen)
    indices[0, :4] = 7  # duplicates, so the backward has runs to reduce

    def expected(weight, indices):
        return F.embedding(indices, weight)

    return f"V{v} D{d} tokens{indices.numel()}", lambda w, i: fusedops.embedding(i, w), (weight, indices), expected


def _na_window(length: int, kernel: int, causal: bool) -> torch.Tensor:
    """[L, L] bool: query i sees key j (window="shifted", stride 1, dilation 1; issue #3's formulas)."""
    mask = torch.zeros(length, length, dtype=torch.bool)
    for i in range(length):
        if causal:
            lo, hi = max(i - kernel + 1, 0), i
        else:
            lo = min(max(i - kernel // 2, 0), length - kernel)
            hi = lo + kernel - 1
        mask[i, lo : hi + 1] = True
    return mask


def _neighborhood_attention_case(gen: torch.Generator, causal: bool = True):
    import fusedops

    b, h, s, d, k = 1, 2, 24, 16, 5
    q, kk, v = (torch.randn(b, h, s, d, generator=gen) for _ in range(3))

    def expected(q, k, v):
        scores = (q @ k.transpose(-1, -2)) * d**-0.5
        scores = scores.masked_fill(~_na_window(s, kernel, causal), float("-inf"))
        return torch.softmax(scores, -1) @ v

    kernel = k
    name = f"1D B{b} H{h} S{s} D{d} k{k}" + (" causal" if causal else "")
    return name, lambda q, k, v: fusedops.neighborhood_attention(q, k, v, kernel, is_causal=causal), (q, kk, v), expected


BUILTIN = {
    "attn_res": [_attn_res_case],
    "embedding": [_embedding_case],
    "neighborhood_attention": [
        lambda g: _neighborhood_attention_case(g, causal=True),
        lambda g: _neighborhood_attention_case(g, causal=False),
    ],
}


# ---- running ----------------------------------------------------------------------------------------


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return math.inf
    denom = ref.norm().item()
    diff = (out - ref).norm().item()
    return diff / denom if denom > 0 else diff


def _run_all(fn: Callable, inputs: tuple, dtype: Optional[torch.dtype]) -> list[torch.Tensor]:
    """Forward output and the gradient of every floating input, for a fixed random cotangent."""
    xs = []
    for x in inputs:
        if x.is_floating_point():
            x = x.detach().to(dtype) if dtype is not None else x.detach()
            x.requires_grad_(True)
        xs.append(x)
    out = fn(*xs)
    gen = torch.Generator().manual_seed(1234)
    grad_out = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(out.dtype)
    req = [x for x in xs if x.is_floating_point()]
    grads = torch.autograd.grad(out, req, grad_out)
    return [out.detach()] + [g for g in grads]


def check(op: str, paths: list[str], dtype: torch.dtype = torch.float32) -> list[dict]:
    rows = []
    try:
        mod = importlib.import_module(f"fusedops.bench.{op}")
    except Exception:
        mod = None
    import fusedops

    if not hasattr(fusedops, op):
        return [{"op": op, "case": "parity", "provider": "fusedops", "mode": "fwd+bwd", "ms": None,
                 "error": f"fusedops.{op} is not available (not landed yet?)"}]
    makers = BUILTIN.get(op, [])
    if mod is not None and hasattr(mod, "parity_case"):
        makers = [lambda g, mod=mod: ("custom",) + tuple(mod.parity_case(torch.device("cpu"), dtype))]
    if not makers:
        return [{"op": op, "case": "parity", "provider": "fusedops", "mode": "fwd+bwd", "ms": None,
                 "error": "no parity case for this op"}]
    for make in makers:
        gen = torch.Generator().manual_seed(0)
        try:
            case, fn, inputs, expected_fn = make(gen)
        except Exception as e:  # e.g. fusedops has no such op yet
            rows.append({"op": op, "case": "parity", "provider": "fusedops", "mode": "fwd+bwd", "ms": None,
                         "error": f"{type(e).__name__}: {e}"})
            continue
        case = f"parity {case}"
        try:
            expected = _run_all(expected_fn, inputs, torch.float64)
        except Exception as e:
            rows.append({"op": op, "case": case, "provider": "float64 formula", "mode": "fwd+bwd", "ms": None,
                         "error": f"{type(e).__name__}: {e}"})
            continue
        for path in paths:
            r = {"op": op, "case": case, "provider": PROVIDER[path], "mode": "fwd+bwd", "ms": None}
            if path == "reference":
                os.environ.pop("FUSEDOPS_INTERPRET", None)
            else:
                os.environ["FUSEDOPS_INTERPRET"] = path
            try:
                t0 = time.perf_counter()
                got = _run_all(fn, inputs, dtype)
                r["ms"] = (time.perf_counter() - t0) * 1e3
                errs = [_rel_err(g, e) for g, e in zip(got, expected)]
                r["rel_err"] = max(errs)
                r["tol"] = TOL[dtype]
                r["ok"] = bool(r["rel_err"] <= r["tol"])
                if not r["ok"]:
                    r["error"] = f"max rel err {r['rel_err']:.2e} > {r['tol']:.0e} (fwd, grads: " + \
                        ", ".join(f"{x:.1e}" for x in errs) + ")"
            except Exception as e:  # noqa: BLE001
                r["ok"] = False
                r["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
            finally:
                os.environ.pop("FUSEDOPS_INTERPRET", None)
            rows.append(r)
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fusedops.bench.parity")
    p.add_argument("ops", nargs="+")
    p.add_argument("--paths", nargs="+", default=["reference", "cuda", "ascend"], choices=list(PROVIDER))
    args = p.parse_args(argv)
    if any(x != "reference" for x in args.paths) and os.environ.get("TRITON_INTERPRET") != "1":
        print("fusedops.bench.parity: the interpreter paths need TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    rows = []
    for op in args.ops:
        rows += check(op, args.paths)
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
