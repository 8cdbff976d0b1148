"""python -m fusedops.bench [ops...] [--device cuda|npu|cpu] [--dtype bf16|fp16|fp32] [--quick] [--sizes ...]
                           [--matmul-precision highest|high|medium] [--out DIR] [--no-plots] [--no-parity]
                           [--parity-timeout S]

Runs every selected op's benchmark (fusedops/bench/<op>.py) on the device it finds, prints one table, writes
<out>/<device>-<date>.json and PNG plots. On a CPU the result is a kernel-vs-reference parity check of each op
under the Triton interpreter (both launch plans, in a subprocess with TRITON_INTERPRET=1); the CPU timings
beside it (the PyTorch reference path) are indicative only.
Exit status: 0; 1 when a parity check ran and failed (error above tolerance or a crash); 2 for bad arguments,
e.g. --sizes that select no case of the device that runs.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from fusedops.bench import OPS
from fusedops.bench.common import (DTYPES, Context, case_name, detect_device, device_name, error_row, measure_ceiling,
                                   save_figure)

PROG = "python -m fusedops.bench"
# Where the package lives (site-packages, or the repository root): the parity subprocess imports the same fusedops.
PACKAGE_PARENT = Path(__file__).resolve().parents[2]
CPU_NOTE = ("CPU timings are indicative only: wall clock of the PyTorch reference path on this host (shared, "
            "noisy), not what the kernels do on an accelerator; no % of copy bandwidth on a CPU")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[1])
    p.add_argument("ops", nargs="*", help=f"ops to run (default: all of {', '.join(OPS)})")
    p.add_argument("--device", choices=["cuda", "npu", "cpu"], default=None, help="default: cuda, npu, then cpu")
    p.add_argument("--dtype", choices=list(DTYPES), default=None, help="default: bf16 (fp32 on cpu)")
    p.add_argument("--quick", action="store_true", help="one small case per op, short timing")
    p.add_argument("--matmul-precision", choices=["highest", "high", "medium"], default=None,
                   help="torch.set_float32_matmul_precision for every provider (fp32: 'high' lets fusedops, "
                        "Flex and torch use TF32)")
    p.add_argument("--sizes", nargs="+", default=None,
                   help='cases to run, e.g. "8,1,8192,4096": a case of the device that runs is selected when its '
                        "name contains one of these (an op with none selected is skipped; none at all is an error)")
    p.add_argument("--out", default=os.path.join("bench", "results"),
                   help="directory for the JSON and PNGs (default: bench/results under the current directory)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-parity", action="store_true", help="skip the CPU interpreter parity check")
    p.add_argument("--parity-timeout", type=float, default=600.0, help="seconds per op's parity subprocess")
    args = p.parse_args(argv)
    unknown = [o for o in args.ops if o not in OPS]
    if unknown:
        p.error(f"unknown op(s) {unknown}; known: {OPS}")
    return args


def _op_module(op: str):
    return importlib.import_module(f"fusedops.bench.{op}")


def select_ops(ops: list[str], ctx: Context) -> tuple[list[str], str]:
    """The ops that have cases under ctx's --sizes (all of them without --sizes), and an error message
    listing the device's cases when --sizes selects none at all ("" otherwise)."""
    if not ctx.sizes:
        return ops, ""
    kept, skipped, available = [], [], []
    for op in ops:
        try:
            mod = _op_module(op)
            selected, cases = ctx.cases_of(mod), mod.CPU_CASES if ctx.device.type == "cpu" else mod.CASES
        except Exception:  # noqa: BLE001 - a broken op module is reported by run_op as a row
            kept.append(op)
            continue
        (kept if selected else skipped).append(op)
        available.append(f"  {op}: " + "  ".join(case_name(c) for c in cases))
    if kept:
        for op in skipped:
            ctx.progress(f"{op}: no {ctx.device.type} case matches --sizes {' '.join(ctx.sizes)}; skipped")
        return kept, ""
    return [], (f"{PROG}: --sizes {' '.join(ctx.sizes)} selects no case on {ctx.device.type} (a case is selected "
                f"when its name contains a --sizes string). The {ctx.device.type} cases:\n" + "\n".join(available))


def run_op(op: str, ctx: Context) -> list[dict]:
    ctx.progress(f"== {op}")
    try:
        mod = _op_module(op)
    except Exception as e:  # noqa: BLE001 - an op not written yet or broken is a row, not a crash
        return [error_row(op, "-", "-", "-", f"fusedops.bench.{op} not importable: {type(e).__name__}: {e}")]
    try:
        rows = list(mod.run(ctx))
    except Exception as e:  # noqa: BLE001
        ctx.empty_cache()
        return [error_row(op, "-", "-", "-", f"fusedops.bench.{op}.run failed: {type(e).__name__}: {e}")]
    for r in rows:
        r.setdefault("op", op)
    return rows or [error_row(op, "-", "-", "-", "no rows")]


def run_parity(op: str, ctx: Context, timeout: float) -> list[dict]:
    ctx.progress(f"== {op}: parity under the Triton interpreter (cuda and ascend plans)")
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop("FUSEDOPS_INTERPRET", None)
    paths = [str(PACKAGE_PARENT)] + [x for x in env.get("PYTHONPATH", "").split(os.pathsep) if x]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    cmd = [sys.executable, "-m", "fusedops.bench.parity", op]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
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


def is_parity(r: dict) -> bool:
    return str(r.get("case", "")).startswith("parity")


def _columns(heads: list[str], body: list[list[str]], always: int) -> list[str]:
    """Aligned lines of a table, dropping the columns past the first `always` that are empty in every row;
    a blank line between ops."""
    keep = [i for i in range(len(heads)) if i < always or any(b[i] for b in body)]
    heads = [heads[i] for i in keep]
    body = [[b[i] for i in keep] for b in body]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(heads)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(heads, widths)).rstrip(), "  ".join("-" * w for w in widths)]
    prev = None
    for b in body:
        if prev is not None and b[0] != prev:
            lines.append("")
        prev = b[0]
        lines.append("  ".join(c.ljust(w) for c, w in zip(b, widths)).rstrip())
    return lines


def parity_verdict(rows: list[dict]) -> str:
    checks = [r for r in rows if is_parity(r) or r.get("ok") is not None]
    if not checks:
        return "not run"
    passed = sum(r.get("ok") is True for r in checks)
    return f"{'PASS' if passed == len(checks) else 'FAIL'} ({passed}/{len(checks)} within tolerance)"


def format_parity(rows: list[dict]) -> list[str]:
    checks = [r for r in rows if is_parity(r) or r.get("ok") is not None]
    lines = [f"Kernel-vs-reference parity on CPU, Triton interpreter, fp32 forward and every gradient against a "
             f"float64 formula: {parity_verdict(rows)}"]
    if not checks:
        return lines
    body = []
    for r in checks:
        result = "ok" if r.get("ok") is True else "FAILED"
        if r.get("error"):
            result += f": {r['error'][:100]}"
        tol = f"{r['tol']:.0e}" if r.get("tol") is not None else ""
        body.append([str(r.get("op", "")), str(r.get("case", "")).removeprefix("parity "), str(r.get("provider", "")),
                     _fmt(r.get("rel_err"), ".1e"), tol, result])
    return lines + _columns(["op", "case", "path", "rel err", "tol", "result"], body, always=6)


def missing_line(rows: list[dict]) -> str:
    """One line for every optional baseline that did not import (rows marked `missing`)."""
    by_provider: dict = {}
    for r in rows:
        if r.get("missing"):
            by_provider.setdefault(r["provider"], (r.get("reason") or r.get("error") or "", []))[1].append(r["op"])
    if not by_provider:
        return ""
    parts = [f"{prov} ({', '.join(ops)}; {reason})" for prov, (reason, ops) in by_provider.items()]
    return "optional baselines not importable, skipped: " + "; ".join(parts)


def format_table(rows: list[dict], ceiling_tbps: float, cpu: bool = False) -> str:
    """The run's table. On a CPU: the parity check first (the result), then the timings, marked indicative,
    without the % of copy column. Optional baselines that did not import get one line at the end."""
    heads = ["op", "case", "provider", "mode", "ms", "TB/s | TFLOP/s", "% copy", "peak MB", "rel err", "note"]
    body = []
    for r in rows:
        if r.get("missing") or (cpu and is_parity(r)):
            continue
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
            _fmt(r.get("ms"), ".4g"), rate, "" if cpu else _fmt(r.get("pct_ceiling"), ".1f"),
            _fmt(r.get("peak_mb"), ".1f"), _fmt(r.get("rel_err"), ".1e"), note[:100],
        ])
    lines = []
    if cpu:
        lines += format_parity(rows) + ["", f"Timings ({CPU_NOTE}):"]
    lines += _columns(heads, body, always=4)
    if not cpu and ceiling_tbps == ceiling_tbps:
        lines.append(f"% copy: of the device-to-device copy bandwidth, {ceiling_tbps:.3g} TB/s "
                     "(bytes read + written), measured in this run")
    missing = missing_line(rows)
    if missing:
        lines.append(missing)
    return "\n".join(lines)


def plot(rows: list[dict], out: Path, stem: str, title: str, cpu: bool = False) -> list[Path]:
    """Per op one PNG: ms per case and provider (one panel per mode), and % of ceiling (accelerators). On a
    CPU the first panel is the interpreter parity check (error against tolerance per path, the result) and
    the timing panels are labelled indicative."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001
        return []
    paths = []
    for op in dict.fromkeys(r["op"] for r in rows):
        timed = [r for r in rows if r["op"] == op and r.get("ms") is not None and not is_parity(r)]
        parity = [r for r in rows if r["op"] == op and is_parity(r)] if cpu else []
        if not timed and not parity:
            continue
        modes = [m for m in ("fwd", "bwd", "fwd+bwd") if any(r["mode"] == m for r in timed)] or \
            sorted({r["mode"] for r in timed})
        has_pct = not cpu and any(r.get("pct_ceiling") is not None for r in timed)
        has_tf = any(r.get("tflops") is not None for r in timed)
        nrows = 2 if (has_pct or has_tf) else 1
        first = 1 if parity else 0
        ncols = first + len(modes)
        fig, axes = plt.subplots(nrows, ncols, figsize=(6 * ncols, 4.2 * nrows), squeeze=False)
        if parity:
            ax = axes[0][0]
            labels = [f"{r['case'].removeprefix('parity ')}\n{r['provider']}" for r in parity]
            errs = [max(r.get("rel_err") or 0.0, 1e-12) if r.get("rel_err") is not None and
                    math.isfinite(r["rel_err"]) else 1.0 for r in parity]
            colors = ["tab:green" if r.get("ok") is True else "tab:red" for r in parity]
            ax.bar(range(len(parity)), errs, color=colors)
            tols = {r["tol"] for r in parity if r.get("tol") is not None}
            for tol in tols:
                ax.axhline(tol, color="k", lw=0.8, ls="--", label=f"tolerance {tol:.0e}")
            ax.set_yscale("log")
            ax.set_xticks(range(len(parity)))
            ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=6)
            ax.set_ylabel("relative error vs float64 (lower is better)")
            ax.set_title(f"{op}: interpreter parity {parity_verdict(parity)}", fontsize=9, fontweight="bold")
            if tols:
                ax.legend(fontsize=7)
            for i in range(1, nrows):
                axes[i][0].axis("off")
        for j, mode in enumerate(modes, start=first):
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
            axes[0][j].set_title(f"{op} {mode}" + (" (CPU wall clock, indicative only)" if cpu else ""), fontsize=9)
            axes[0][j].legend(fontsize=7)
            if nrows == 2:
                axes[1][j].set_ylabel(f"{metric[1]} (higher is better)")
                if has_pct:
                    axes[1][j].axhline(100, color="k", lw=0.8, ls="--")
        paths.append(save_figure(fig, title, out / f"{stem}-{op}.png"))
    return paths


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["tune"]:  # python -m fusedops.bench tune <op> ...: writes launch-plan table rows
        from fusedops.bench import tune

        return tune.main(argv[1:])
    args = parse_args(argv)
    started = time.perf_counter()
    device = detect_device(args.device)
    cpu = device.type == "cpu"
    dtype = DTYPES[args.dtype] if args.dtype else (torch.float32 if cpu else torch.bfloat16)
    if args.matmul_precision:
        torch.set_float32_matmul_precision(args.matmul_precision)
    ctx = Context(device=device, dtype=dtype, quick=args.quick, sizes=args.sizes)
    ops, error = select_ops(args.ops or list(OPS), ctx)
    if error:
        print(error, file=sys.stderr)
        return 2
    name = device_name(device)
    ctx.progress(f"device {device} ({name}), dtype {str(dtype).replace('torch.', '')}, ops {', '.join(ops)}"
                 + (", quick" if args.quick else ""))
    if cpu:
        ctx.progress(CPU_NOTE + ("" if args.no_parity else "; the result is the interpreter parity check"))
    else:
        ctx.progress("measuring the copy-bandwidth ceiling")
        ctx.ceiling_tbps = measure_ceiling(device, quick=args.quick)
        ctx.progress(f"ceiling {ctx.ceiling_tbps:.3f} TB/s")

    rows: list[dict] = []
    if cpu and not args.no_parity:
        for op in ops:
            rows += run_parity(op, ctx, args.parity_timeout)
    for op in ops:
        rows += run_op(op, ctx)

    print(format_table(rows, ctx.ceiling_tbps, cpu=cpu))

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{device.type}-{datetime.date.today().isoformat()}"
    meta = {
        "device": str(device), "device_name": name, "dtype": str(dtype).replace("torch.", ""),
        "quick": args.quick, "sizes": args.sizes, "ops": ops, "matmul_precision": args.matmul_precision,
        "ceiling_tbps": None if cpu else ctx.ceiling_tbps,
        "torch": torch.__version__, "python": platform.python_version(), "argv": sys.argv[1:],
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "seconds": round(time.perf_counter() - started, 1),
    }
    if cpu:
        meta["parity"] = "not run (--no-parity)" if args.no_parity else parity_verdict(rows)
        meta["note"] = CPU_NOTE
    try:
        import triton

        meta["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        pass
    json_path = out / f"{stem}.json"
    json_path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    print(f"wrote {json_path}")
    if not args.no_plots:
        if cpu:
            title = (f"fusedops on {name} (cpu, {meta['dtype']}), {meta['date']}: interpreter parity "
                     f"{meta['parity']}; timings indicative only")
        else:
            title = (f"fusedops on {name} ({device.type}, {meta['dtype']}), {meta['date']}; copy ceiling "
                     f"{ctx.ceiling_tbps:.3g} TB/s")
        pngs = plot(rows, out, stem, title, cpu=cpu)
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
