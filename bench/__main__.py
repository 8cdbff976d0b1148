"""python -m bench [ops...] [--device cuda|npu|cpu] [--dtype bf16|fp16|fp32] [--quick] [--sizes ...]
                   [--matmul-precision highest|high|medium] [--out DIR] [--no-plots] [--no-parity]
                   [--parity-timeout S]

Runs every selected op's benchmark (bench/<op>.py) on the device it finds, prints one table, writes
<out>/<device>-<date>.json and PNG plots. On CPU it also runs a kernel-vs-reference parity check of each
op under the Triton interpreter (both launch plans), in a subprocess with TRITON_INTERPRET=1.
Exit status: 0, or 1 when a parity check ran and failed (error above tolerance or a crash).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench import OPS
from bench.common import DTYPES, Context, detect_device, device_name, error_row, measure_ceiling

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[1])
    p.add_argument("ops", nargs="*", help=f"ops to run (default: all of {', '.join(OPS)})")
    p.add_argument("--device", choices=["cuda", "npu", "cpu"], default=None, help="default: cuda, npu, then cpu")
    p.add_argument("--dtype", choices=list(DTYPES), default=None, help="default: bf16 (fp32 on cpu)")
    p.add_argument("--quick", action="store_true", help="one small case per op, short timing")
    p.add_argument("--matmul-precision", choices=["highest", "high", "medium"], default=None,
                   help="torch.set_float32_matmul_precision for every provider (fp32: 'high' lets fusedops, "
                        "Flex and torch use TF32)")
    p.add_argument("--sizes", nargs="+", default=None,
                   help='cases to run, e.g. "8,1,8192,4096" (a case runs when its name contains one of these)')
    p.add_argument("--out", default=str(HERE / "results"), help="directory for the JSON and PNGs")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-parity", action="store_true", help="skip the CPU interpreter parity check")
    p.add_argument("--parity-timeout", type=float, default=600.0, help="seconds per op's parity subprocess")
    args = p.parse_args(argv)
    unknown = [o for o in args.ops if o not in OPS]
    if unknown:
        p.error(f"unknown op(s) {unknown}; known: {OPS}")
    return args


def run_op(op: str, ctx: Context) -> list[dict]:
    import importlib

    ctx.progress(f"== {op}")
    try:
        mod = importlib.import_module(f"bench.{op}")
    except Exception as e:  # noqa: BLE001 - an op not written yet or broken is a row, not a crash
        return [error_row(op, "-", "-", "-", f"bench.{op} not importable: {type(e).__name__}: {e}")]
    try:
        rows = list(mod.run(ctx))
    except Exception as e:  # noqa: BLE001
        ctx.empty_cache()
        return [error_row(op, "-", "-", "-", f"bench.{op}.run failed: {type(e).__name__}: {e}")]
    for r in rows:
        r.setdefault("op", op)
    return rows or [error_row(op, "-", "-", "-", "no rows")]


def run_parity(op: str, ctx: Context, timeout: float) -> list[dict]:
    ctx.progress(f"== {op}: parity under the Triton interpreter (cuda and ascend plans)")
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop("FUSEDOPS_INTERPRET", None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [x for x in env.get("PYTHONPATH", "").split(os.pathsep) if x])
    cmd = [sys.executable, "-m", "bench.parity", op]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return [error_row(op, "parity", "fusedops[interp]", "fwd+bwd", f"parity timed out after {timeout:.0f} s")
                | {"ok": False}]
    lines = proc.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except Exception:  # noqa: BLE001
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return [error_row(op, "parity", "fusedops[interp]", "fwd+bwd", f"parity exited {proc.returncode}: {tail}")
                | {"ok": False}]


# ---- output ------------------------------------------------------------------------------------------


def _fmt(x, spec: str) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return ""
    return format(x, spec)


def format_table(rows: list[dict], ceiling_tbps: float) -> str:
    heads = ["op", "case", "provider", "mode", "ms", "TB/s | TFLOP/s", "% ceiling", "peak MB", "rel err", "note"]
    body = []
    for r in rows:
        if r.get("tbps") is not None:
            rate = f"{r['tbps']:.3g} TB/s"
        elif r.get("tflops") is not None:
            rate = f"{r['tflops']:.3g} TFLOP/s"
        else:
            rate = ""
        note = r.get("error") or ""
        if r.get("ok") is True:
            note = f"ok (tol {r.get('tol', 0):.0e})"
        body.append([
            str(r.get("op", "")), str(r.get("case", "")), str(r.get("provider", "")), str(r.get("mode", "")),
            _fmt(r.get("ms"), ".4g"), rate, _fmt(r.get("pct_ceiling"), ".1f"), _fmt(r.get("peak_mb"), ".1f"),
            _fmt(r.get("rel_err"), ".1e"), note[:100],
        ])
    keep = [i for i in range(len(heads)) if i < 4 or any(b[i] for b in body)]
    heads = [heads[i] for i in keep]
    body = [[b[i] for i in keep] for b in body]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(heads)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(heads, widths)), "  ".join("-" * w for w in widths)]
    prev = None
    for b in body:
        if prev is not None and b[0] != prev:
            lines.append("")
        prev = b[0]
        lines.append("  ".join(c.ljust(w) for c, w in zip(b, widths)).rstrip())
    lines.append(f"ceiling: device-to-device copy {ceiling_tbps:.3g} TB/s (bytes read + written)")
    return "\n".join(lines)


def plot(rows: list[dict], out: Path, stem: str, title: str) -> list[Path]:
    """Per op one PNG: ms per case and provider (one panel per mode), and % of ceiling."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001
        return []
    paths = []
    for op in dict.fromkeys(r["op"] for r in rows):
        timed = [r for r in rows if r["op"] == op and r.get("ms") is not None and not r["case"].startswith("parity")]
        if not timed:
            continue
        modes = [m for m in ("fwd", "bwd", "fwd+bwd") if any(r["mode"] == m for r in timed)] or \
            sorted({r["mode"] for r in timed})
        has_pct = any(r.get("pct_ceiling") is not None for r in timed)
        has_tf = any(r.get("tflops") is not None for r in timed)
        nrows = 2 if (has_pct or has_tf) else 1
        fig, axes = plt.subplots(nrows, len(modes), figsize=(6 * len(modes), 4.2 * nrows), squeeze=False)
        for j, mode in enumerate(modes):
            mr = [r for r in timed if r["mode"] == mode]
            cases = list(dict.fromkeys(r["case"] for r in mr))
            providers = list(dict.fromkeys(r["provider"] for r in mr))
            width = 0.8 / max(1, len(providers))
            metric = ("pct_ceiling", "% of copy bandwidth") if has_pct else ("tflops", "TFLOP/s")
            for k, prov in enumerate(providers):
                by_case = {r["case"]: r for r in mr if r["provider"] == prov}
                xs = [i + (k - (len(providers) - 1) / 2) * width for i in range(len(cases))]
                axes[0][j].bar(xs, [by_case[c]["ms"] if c in by_case else 0 for c in cases], width, label=prov)
                if nrows == 2:
                    vals = [(by_case.get(c) or {}).get(metric[0]) or 0 for c in cases]
                    axes[1][j].bar(xs, vals, width, label=prov)
            for i in range(nrows):
                ax = axes[i][j]
                ax.set_xticks(range(len(cases)))
                ax.set_xticklabels(cases, rotation=30, ha="right", fontsize=7)
                ax.grid(axis="y", alpha=0.3)
            axes[0][j].set_ylabel("ms (lower is better)")
            axes[0][j].set_yscale("log")
            axes[0][j].set_title(f"{op} {mode}")
            axes[0][j].legend(fontsize=7)
            if nrows == 2:
                axes[1][j].set_ylabel(f"{metric[1]} (higher is better)")
                if has_pct:
                    axes[1][j].axhline(100, color="k", lw=0.8, ls="--")
        fig.suptitle(title, fontsize=9)
        fig.tight_layout()
        path = out / f"{stem}-{op}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    device = detect_device(args.device)
    dtype = DTYPES[args.dtype] if args.dtype else (torch.float32 if device.type == "cpu" else torch.bfloat16)
    ops = args.ops or list(OPS)
    if args.matmul_precision:
        torch.set_float32_matmul_precision(args.matmul_precision)
    ctx = Context(device=device, dtype=dtype, quick=args.quick, sizes=args.sizes)
    name = device_name(device)
    ctx.progress(f"device {device} ({name}), dtype {str(dtype).replace('torch.', '')}, ops {', '.join(ops)}"
                 + (", quick" if args.quick else ""))
    ctx.progress("measuring the copy-bandwidth ceiling")
    ctx.ceiling_tbps = measure_ceiling(device, quick=args.quick)
    ctx.progress(f"ceiling {ctx.ceiling_tbps:.3f} TB/s")

    rows: list[dict] = []
    for op in ops:
        rows += run_op(op, ctx)
    if device.type == "cpu" and not args.no_parity:
        for op in ops:
            rows += run_parity(op, ctx, args.parity_timeout)

    print(format_table(rows, ctx.ceiling_tbps))

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{device.type}-{datetime.date.today().isoformat()}"
    meta = {
        "device": str(device), "device_name": name, "dtype": str(dtype).replace("torch.", ""),
        "quick": args.quick, "sizes": args.sizes, "ops": ops, "matmul_precision": args.matmul_precision,
        "ceiling_tbps": ctx.ceiling_tbps,
        "torch": torch.__version__, "python": platform.python_version(), "argv": sys.argv[1:],
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "seconds": round(time.perf_counter() - started, 1),
    }
    try:
        import triton

        meta["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        pass
    json_path = out / f"{stem}.json"
    json_path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    print(f"wrote {json_path}")
    if not args.no_plots:
        title = f"fusedops on {name} ({device.type}, {meta['dtype']}), {meta['date']}; copy ceiling {ctx.ceiling_tbps:.3g} TB/s"
        pngs = plot(rows, out, stem, title)
        for pth in pngs:
            print(f"wrote {pth}")
        if not pngs:
            print("no plots (matplotlib missing or nothing timed)")
    failed = [r for r in rows if r.get("ok") is False]
    if failed:
        print(f"{len(failed)} parity check(s) FAILED", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
