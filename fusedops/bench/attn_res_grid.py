"""The attn_res shape grid (issue #31): fusedops.attn_res (with a norm weight, as the attn_res bench calls it)
against fla-core's fused_attnres and Liger's LigerAttnResFunction when they import, over N sources x tokens x D,
forward and forward+backward.

    python -m fusedops.bench.attn_res_grid [--quick] [--device cuda|npu|cpu] [--dtype bf16|fp16|fp32]
        [--shapes 60] [--sample 12] [--seed 0] [--max-input-gb 16] [--max-seconds S] [--sizes ...]
        [--providers fusedops fla liger] [--out DIR] [--no-plots]

Shapes are (N, tokens, D), named "N,tokens,D" (tokens = batch x sequence; --sizes selects by that name, as the
other benches do). First --shapes steps of a covering walk: step i is (N[i mod 12], tokens[i mod 11], D[i mod 13]),
coprime cycles, so any 13 consecutive steps hold every value of every axis (a combination met again is not
repeated); the tokens cycle holds the four larger counts twice, so that more than half the shapes are throughput
shapes. Then --sample further combinations drawn with a fixed seed. A combination whose inputs (N x tokens x D x
element size) exceed --max-input-gb is skipped.

A shape moving >= 64 MiB in a mode (forward: (N + 1) x tokens x D x element size; forward+backward adds the
backward's (2N + 1), as the attn_res bench counts them) is a throughput shape in that mode, judged by % of the
device-to-device copy bandwidth measured in the same run; a smaller one is a latency shape, judged by its time.
On CUDA every step is also captured once in a CUDA graph and its replay timed (the same do_bench): both judgements
use that device time, since an eager call's host overhead (~20-40 us) is as long as a 64 MB step; the eager
wall clock stays beside it (ms, and pct_ceiling_eager). Each row's ratio is provider time / fusedops time by that
judgement (> 1: fusedops faster).
Targets (issue #31): forward >= 88% of copy on every throughput shape, median >= 92%; forward+backward >= 75%
every, median >= 80%; faster than fla and Liger on every throughput shape in both modes; on latency shapes a
replay no slower than fla's and Liger's.

Writes <out>/attn_res_grid-<device>-<date>.json (rewritten after every shape; every row also goes to stderr as it
lands, so a run cut by a time limit keeps its numbers), and with matplotlib two heatmaps, rows N, columns D, a
panel per mode: fusedops % of copy and fusedops time / best baseline time, each the worst over tokens. Ends with
a summary per provider and mode (worst, median, target). --max-seconds: start no new shape after that many
seconds, and summarise what was measured. The whole grid takes ~40 s a shape on a fresh H200 (compiles and
fla's autotuning included): split it over device calls with --part I/K and summarise the parts' JSON files
together with --summarize. --warm runs each shape's steps once and times nothing: several such processes
(--sub J/W of a part) fill Triton's on-disk cache (and fla's compiles) in parallel before the timed runs
(bench/gpu_check.sh STEPS=gridpar: one timed part per GPU after the warm-up; on a 4-GPU H200 host a timed part
ran 10 shapes in ~280 s, fla's autotuning included: the 72 shapes take 8 parts, two calls). On a CPU a few tiny
shapes of the grid run the PyTorch reference path: a smoke test, the timings indicative only.
bench/gpu_check.sh runs it as STEPS=grid.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from fusedops.bench import attn_res
from fusedops.bench.common import (DTYPES, Context, case_name, cuda_graph, cuda_graph_step, detect_device,
                                   device_name, fwd_bwd_fns, measure, measure_ceiling, save_figure, synchronize)

PROG = "python -m fusedops.bench.attn_res_grid"
OP = "attn_res_grid"
NS = (2, 3, 4, 6, 8, 9, 12, 16, 24, 32, 64, 128)
DS = (1024, 1536, 2048, 2304, 3072, 3584, 4096, 5120, 6144, 7168, 8192, 12288, 16384)
TOKENS = (1, 8, 64, 512, 2048, 8192, 32768)
TOKEN_CYCLE = TOKENS + TOKENS[3:]  # 11 long: coprime with 12 and 13
THROUGHPUT_BYTES = 64 * 2**20
MODES = ("fwd", "fwd+bwd")
BASELINES = ("fla", "liger")
COPY_TARGETS = {"fwd": (88.0, 92.0), "fwd+bwd": (75.0, 80.0)}  # % of copy: on every throughput shape, median
CPU_ELEMENTS = 2**20  # the CPU smoke runs the grid's shapes of at most this many input elements
CPU_NOTE = "CPU timings are indicative only: wall clock of the PyTorch reference path on this host, no CUDA graphs"


def grid(count: int = 60, sample: int = 12, seed: int = 0, cap_bytes: float = 16e9, elem: int = 2):
    """(shapes, skipped): `count` shapes of the covering walk, then `sample` more drawn with `seed`, all with
    inputs of at most cap_bytes; skipped: the walk's combinations over the cap."""
    def fits(s):
        return s[0] * s[1] * s[2] * elem <= cap_bytes

    shapes, skipped = [], []
    for i in range(len(NS) * len(TOKEN_CYCLE) * len(DS)):
        if len(shapes) == count:
            break
        s = (NS[i % len(NS)], TOKEN_CYCLE[i % len(TOKEN_CYCLE)], DS[i % len(DS)])
        if s not in shapes:
            (shapes if fits(s) else skipped).append(s)
    rest = [s for s in itertools.product(NS, TOKENS, DS) if fits(s) and s not in shapes]
    return shapes + random.Random(seed).sample(rest, min(sample, len(rest))), skipped


def mode_bytes(shape, elem: int) -> dict:
    n, tokens, d = shape
    fwd = (n + 1) * tokens * d * elem
    return {"fwd": fwd, "fwd+bwd": fwd + (2 * n + 1) * tokens * d * elem}


def kind(nbytes: float) -> str:
    return "throughput" if nbytes >= THROUGHPUT_BYTES else "latency"


def split(shapes, elem: int) -> str:
    """"fwd 34 throughput / 26 latency, fwd+bwd ..." for the shapes."""
    parts = []
    for mode in MODES:
        thr = sum(kind(mode_bytes(s, elem)[mode]) == "throughput" for s in shapes)
        parts.append(f"{mode} {thr} throughput / {len(shapes) - thr} latency")
    return ", ".join(parts)


PROVIDERS = ("fusedops",) + BASELINES
_chosen = PROVIDERS  # --providers


def providers() -> dict:
    import fusedops

    every = {"fusedops": lambda v, q, w: fusedops.attn_res(v, q, w), "fla": attn_res.fla, "liger": attn_res.liger}
    return {name: every[name] for name in _chosen}


def judged_ms(r: dict, graphs: bool):
    """The time a row is judged by: its CUDA-graph replay (device time, where graphs run), else its eager ms."""
    if graphs:
        return r["replay_us"] / 1e3 if r.get("replay_us") else None
    return r.get("ms")


def replay(ctx: Context, shape, name: str, mode: str, fn, fns: dict, inputs) -> dict:
    """{"replay_us"} of the mode's step captured once in a CUDA graph, or {"replay_error"}."""
    try:
        step = cuda_graph(fns["fwd"]) if mode == "fwd" else cuda_graph_step(fn, inputs)
    except Exception as e:  # noqa: BLE001 - e.g. a provider that syncs the host cannot be captured
        return {"replay_error": f"capture: {type(e).__name__}: {e}".splitlines()[0][:300]}
    g = measure(ctx, OP, shape, f"{name} (CUDA graph)", mode, step, memory=False)
    return {"replay_us": 1e3 * g["ms"]} if g.get("ms") is not None else {"replay_error": g["error"]}


def fla_configs() -> dict:
    """{"fla_configs": {kernel: its autotuned config}} of fla-core's attnres kernels' last call, or {}."""
    try:
        from fla.ops.attnres import fused
    except Exception:  # noqa: BLE001 - not installed
        return {}
    kernels = ("attnres_fwd_kernel", "attnres_bwd_kernel_dv", "attnres_bwd_kernel_dqdw")
    return {"fla_configs": {k: str(getattr(getattr(fused, k, None), "best_config", None)) for k in kernels}}


def shape_inputs(ctx: Context, shape) -> list:
    """[values [N, 1, tokens, D], query, norm_weight] of a grid shape, each requiring grad."""
    n, tokens, d = shape
    values = torch.randn(n, 1, tokens, d, device=ctx.device, dtype=ctx.dtype, requires_grad=True)
    query = (0.1 * torch.randn(d, device=ctx.device)).requires_grad_()
    return [values, query, torch.ones(d, device=ctx.device, requires_grad=True)]


def run_shape(ctx: Context, shape, elem: int) -> list[dict]:
    """Every provider's rows of one shape, fwd and fwd+bwd, with their kind, replay and ratio."""
    n, tokens, d = shape
    graphs = ctx.device.type == "cuda"
    nbytes = mode_bytes(shape, elem)
    inputs = shape_inputs(ctx, shape)
    rows = []
    for name, fn in providers().items():
        try:
            fns = fwd_bwd_fns(lambda fn=fn: fn(*inputs), inputs)
        except Exception as e:  # noqa: BLE001 - a baseline not installed is one row per run
            rows += ctx.failed(OP, shape, name, MODES, e)
            continue
        for mode in MODES:
            r = measure(ctx, OP, shape, name, mode, fns[mode], nbytes=nbytes[mode], memory=False)
            # % of copy from device time: an eager call's host overhead (~20-40 us) is as long as a 64 MB step
            eager_pct = r.pop("pct_ceiling", None)
            if graphs and r["ms"] is not None:
                r.update(replay(ctx, shape, name, mode, fn, fns, inputs))
            if kind(nbytes[mode]) == "throughput" and eager_pct is not None:  # (no copy ceiling on a CPU)
                r["pct_ceiling_eager"] = eager_pct
                if r.get("replay_us"):
                    r["pct_ceiling"] = 100 * nbytes[mode] / (r["replay_us"] * 1e-6) / (ctx.ceiling_tbps * 1e12)
                elif not graphs:
                    r["pct_ceiling"] = eager_pct
            if name == "fla" and mode == "fwd+bwd":  # every fla kernel has run on this shape by now
                r.update(fla_configs())
            rows.append(r)
        del fns
    del inputs
    ctx.empty_cache()
    for r in rows:
        if r["mode"] in MODES:  # not the one row of a baseline that does not import
            r.update(N=n, tokens=tokens, D=d, kind=kind(nbytes[r["mode"]]))
    fused = {r["mode"]: judged_ms(r, graphs) for r in rows if r["provider"] == "fusedops"}
    for r in rows:
        t, t0 = judged_ms(r, graphs), fused.get(r["mode"])
        if t and t0:
            r["ratio"] = t / t0
    return rows


WARM_LOCKED_BYTES = 2**30  # inputs above this take the GPU's lock in --warm: one large shape a GPU at a time


def warm_shape(ctx: Context, shape) -> str:
    """Every provider's forward and forward+backward of one shape run once, untimed (compiles and autotuning
    land in the caches); a line saying which failed. Inputs over WARM_LOCKED_BYTES wait for a file lock per
    visible GPU, so that warm-up processes sharing a GPU hold one large shape at a time."""
    import fcntl

    n, tokens, d = shape
    elem = torch.empty((), dtype=ctx.dtype).element_size()
    lock = None
    if n * tokens * d * elem > WARM_LOCKED_BYTES:
        gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "all").replace(",", "_")
        lock = open(f"/tmp/fusedops-grid-warm-{gpu}.lock", "w")
        fcntl.flock(lock, fcntl.LOCK_EX)
    failed = []
    try:
        inputs = shape_inputs(ctx, shape)
        for name, fn in providers().items():
            try:
                fns = fwd_bwd_fns(lambda fn=fn: fn(*inputs), inputs)
                fns["fwd"]()
                fns["fwd+bwd"]()
                del fns
            except Exception as e:  # noqa: BLE001 - the timed run reports it
                failed.append(f"{name}: {type(e).__name__}")
        del inputs
        synchronize(ctx.device)
    finally:
        ctx.empty_cache()
        if lock is not None:
            lock.close()
    return "; ".join(failed) or "ok"


def summary(rows: list[dict], graphs: bool, header: str) -> str:
    """Per provider and mode: worst and median beside issue #31's targets."""
    timed = [r for r in rows if r.get("N") is not None and r.get("ms") is not None]
    body = []

    def line(provider, mode, metric, values, worst, fmt, target="", miss=None, median_min=None):
        if not values:
            body.append([provider, mode, metric, "0", "-", "-", target, "not measured"])
            return
        med = statistics.median(values)
        misses = "-"
        if miss is not None:
            misses = f"{sum(map(miss, values))}/{len(values)}"
            if median_min is not None and med < median_min:
                misses += " median MISS"
        body.append([provider, mode, metric, str(len(values)), format(worst(values), fmt), format(med, fmt), target,
                     misses])

    for mode in MODES:
        fused = [r for r in timed if r["provider"] == "fusedops" and r["mode"] == mode]
        every, med = COPY_TARGETS[mode]
        line("fusedops", mode, "% of copy (throughput)", [r["pct_ceiling"] for r in fused if "pct_ceiling" in r],
             min, ".1f", f">= {every:g} every, median >= {med:g}", lambda x: x < every, med)
        if graphs:
            line("fusedops", mode, "replay us (latency)", [r["replay_us"] for r in fused if "replay_us" in r], max,
                 ".1f", "<= fla's and Liger's (below)")
        else:
            line("fusedops", mode, "ms (every shape)", [r["ms"] for r in fused], max, ".4g")
    for prov, mode, k in itertools.product(BASELINES, MODES, ("throughput", "latency")):
        ratios = [r["ratio"] for r in timed if r["provider"] == prov and r["mode"] == mode and r["kind"] == k
                  and r.get("ratio")]
        how = "replay" if graphs and k == "latency" else "ms"
        strict = k == "throughput"  # faster on throughput shapes; no slower on latency shapes
        line(prov, mode, f"fusedops speed-up ({k}, {how})", ratios, min, ".2f", "> 1 every" if strict else ">= 1 every",
             (lambda x: x <= 1) if strict else (lambda x: x < 1))
    heads = ["provider", "mode", "metric", "shapes", "worst", "median", "target", "misses"]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(heads)]
    table = ["  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip() for cols in [heads] + body]
    return "\n".join([header] + table[:1] + ["  ".join("-" * w for w in widths)] + table[1:])


def heatmaps(rows: list[dict], out: Path, stem: str, title: str) -> list[Path]:
    """Two PNGs, rows N x columns D, a panel per mode: fusedops % of copy on throughput shapes (worst over tokens),
    and fusedops time / best baseline time (worst over tokens). One line and none when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import TwoSlopeNorm
    except Exception:  # noqa: BLE001
        print("no heatmaps: matplotlib not importable")
        return []
    timed = [r for r in rows if r.get("N") is not None and r.get("ms") is not None]

    def pct(mode):
        return [(r, r["pct_ceiling"]) for r in timed
                if r["provider"] == "fusedops" and r["mode"] == mode and "pct_ceiling" in r]

    def vs_best(mode):
        best: dict = {}  # fusedops time / best baseline time = 1 / the largest baseline ratio
        for r in timed:
            if r["provider"] in BASELINES and r["mode"] == mode and r.get("ratio"):
                key = (r["N"], r["tokens"], r["D"])
                best[key] = max(best.get(key, 0.0), r["ratio"])
        return [({"N": k[0], "D": k[2]}, 1 / v) for k, v in best.items()]

    # colours turn from green to red at the target: the mode's every-shape % of copy, and 1 against the baselines
    figures = [
        ("copy", "fusedops % of copy bandwidth on throughput shapes, worst over tokens (higher is better)", pct, min,
         ".0f", lambda mode: ("RdYlGn", TwoSlopeNorm(COPY_TARGETS[mode][0], 50, 100))),
        ("vs-baseline", "fusedops time / best baseline time, worst over tokens (< 1: fusedops faster; CUDA-graph "
         "replay on latency shapes)", vs_best, max, ".2f", lambda mode: ("RdYlGn_r", TwoSlopeNorm(1.0, 0.5, 2.0))),
    ]
    paths = []
    for name, label, values, worst, fmt, style in figures:
        if not any(values(m) for m in MODES):
            print(f"no {name} heatmap: nothing to show (no {'% of copy' if name == 'copy' else 'baseline'} timings)")
            continue
        fig, axes = plt.subplots(1, len(MODES), figsize=(8 * len(MODES), 6.5), squeeze=False)
        for ax, mode in zip(axes[0], MODES):
            cells: dict = {}
            for r, v in values(mode):
                cells.setdefault((NS.index(r["N"]), DS.index(r["D"])), []).append(v)
            grid_ = torch.full((len(NS), len(DS)), float("nan"))
            for (i, j), vs in cells.items():
                grid_[i, j] = worst(vs)
                ax.text(j, i, format(worst(vs), fmt), ha="center", va="center", fontsize=7)
            cmap, norm = style(mode)
            image = ax.imshow(grid_.numpy(), aspect="auto", cmap=cmap, norm=norm)
            fig.colorbar(image, ax=ax)
            ax.set_xticks(range(len(DS)), [str(d) for d in DS], rotation=45, fontsize=7)
            ax.set_yticks(range(len(NS)), [str(n) for n in NS], fontsize=7)
            ax.set_xlabel("D")
            ax.set_ylabel("N (sources)")
            ax.set_title(f"{mode} (colour turns at {norm.vcenter:g})", fontsize=9)
        paths.append(save_figure(fig, f"{label}\n{title}", out / f"{stem}-{name}.png"))
    return paths


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "npu", "cpu"], default=None, help="default: cuda, npu, then cpu")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--quick", action="store_true", help="12 shapes of the walk (3 tiny ones on a CPU), short timing")
    p.add_argument("--sizes", nargs="+", default=None,
                   help='shapes "N,tokens,D" to run: those whose name contains one of these (none is an error)')
    p.add_argument("--shapes", type=int, default=60, help="shapes of the covering walk (default 60)")
    p.add_argument("--sample", type=int, default=12, help="further shapes drawn with --seed (default 12)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-input-gb", type=float, default=16.0,
                   help="skip combinations whose inputs, N x tokens x D x element size, exceed this (1e9 bytes)")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="start no new shape after this many seconds; summarise what was measured")
    p.add_argument("--part", default=None, metavar="I/K",
                   help="every K-th shape from the I-th (1-based): the grid split over K runs (e.g. device calls)")
    p.add_argument("--sub", default=None, metavar="J/W",
                   help="of the shapes --part selects, every W-th from the J-th (1-based): --warm over W processes")
    p.add_argument("--summarize", nargs="+", default=None, metavar="JSON",
                   help="measure nothing: the summary and heatmaps of these runs' JSON files together, and their "
                        "rows in one JSON file in --out")
    p.add_argument("--warm", action="store_true",
                   help="time nothing: run each shape once (fills the compile caches for a later timed run)")
    p.add_argument("--out", default=os.path.join("bench", "results"), help="directory for the JSON and PNGs")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS),
                   help="what to time (default all; fusedops is always timed, the baselines' ratios need it)")
    args = p.parse_args(argv)
    global _chosen
    _chosen = tuple(dict.fromkeys(["fusedops", *args.providers]))
    if args.summarize:
        return summarize(args.summarize, Path(args.out), args.no_plots)

    device = detect_device(args.device)
    cpu, graphs = device.type == "cpu", device.type == "cuda"
    dtype = DTYPES[args.dtype]
    elem = torch.empty((), dtype=dtype).element_size()
    ctx = Context(device=device, dtype=dtype, quick=args.quick, sizes=args.sizes)
    full, skipped = grid(args.shapes, args.sample, args.seed, args.max_input_gb * 1e9, elem)
    if cpu:
        full = [s for s in full if s[0] * s[1] * s[2] <= CPU_ELEMENTS][:8]
    shapes = ctx.select(full, quick=full[:3] if cpu else full[:12])
    if args.part:
        i, k = (int(x) for x in args.part.split("/"))
        if not 1 <= i <= k:
            p.error(f"--part {args.part}: want I/K with 1 <= I <= K")
        shapes = shapes[i - 1::k]
    if args.sub:
        j, w = (int(x) for x in args.sub.split("/"))
        if not 1 <= j <= w:
            p.error(f"--sub {args.sub}: want J/W with 1 <= J <= W")
        shapes = shapes[j - 1::w]
    if not shapes:
        print(f"{PROG}: --sizes {' '.join(args.sizes or [])} selects no shape on {device.type}; its shapes: "
              + " ".join(case_name(s) for s in full), file=sys.stderr)
        return 2
    if args.warm:
        for shape in shapes:
            ctx.progress(f"warm {case_name(shape)}: {warm_shape(ctx, shape)}")
        return 0
    name = device_name(device)
    ctx.progress(f"device {device} ({name}), {args.dtype}, {len(shapes)} shapes: {split(shapes, elem)}")
    if skipped:
        ctx.progress(f"over the {args.max_input_gb:g} GB input cap, skipped: {' '.join(map(case_name, skipped))}")
    if cpu:
        ctx.progress(CPU_NOTE)
    else:
        ctx.ceiling_tbps = measure_ceiling(device, quick=args.quick)
        ctx.progress(f"copy ceiling {ctx.ceiling_tbps:.3f} TB/s")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    date = datetime.datetime.now().isoformat(timespec="seconds")
    stem = f"attn_res_grid-{device.type}-{date[:10]}" + (f"-part{args.part.replace('/', 'of')}" if args.part else "")
    json_path = out / f"{stem}.json"
    meta = {"device": str(device), "device_name": name, "dtype": args.dtype, "quick": args.quick, "sizes": args.sizes,
            "ceiling_tbps": None if cpu else ctx.ceiling_tbps, "shapes": [case_name(s) for s in shapes],
            "skipped_over_cap": [case_name(s) for s in skipped], "throughput_bytes": THROUGHPUT_BYTES,
            "ratio": "provider time / fusedops time (> 1: fusedops faster); CUDA-graph replay times on CUDA",
            "torch": torch.__version__, "argv": sys.argv[1:] if argv is None else list(argv), "date": date,
            "shapes_measured": 0, "note": CPU_NOTE if cpu else None}
    rows: list[dict] = []
    for i, shape in enumerate(shapes):
        if args.max_seconds is not None and time.perf_counter() - ctx.started > args.max_seconds:
            ctx.progress(f"--max-seconds {args.max_seconds:g} reached: {len(shapes) - i} of {len(shapes)} shapes "
                         "not measured")
            break
        rows += run_shape(ctx, shape, elem)
        meta["shapes_measured"] = i + 1
        json_path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    json_path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))

    from fusedops.bench.__main__ import missing_line

    measured = shapes[:meta["shapes_measured"]]
    header = (f"attn_res grid summary: {len(measured)} of {len(shapes)} shapes ({split(measured, elem)}), "
              f"{args.dtype}, {name}" + (f"; {CPU_NOTE}" if cpu else f"; copy {ctx.ceiling_tbps:.3g} TB/s"))
    print(summary(rows, graphs, header))
    if missing_line(rows):
        print(missing_line(rows))
    print(f"wrote {json_path}")
    if not args.no_plots:
        title = f"{name} ({device.type}, {args.dtype}), {date}" + ("" if cpu else f"; copy {ctx.ceiling_tbps:.3g} TB/s")
        for path in heatmaps(rows, out, stem, title):
            print(f"wrote {path}")
    return 1 if any(r["provider"] == "fusedops" and r.get("error") for r in rows) else 0


def summarize(paths, out: Path, no_plots: bool) -> int:
    """The summary (and heatmaps) of several runs' JSON files, e.g. the --part runs of one grid."""
    runs = [json.loads(Path(path).read_text()) for path in paths]
    rows = [r for run in runs for r in run["rows"]]
    meta = runs[0]["meta"]
    graphs = meta["device"].startswith("cuda")
    names = sorted({f"{r['N']},{r['tokens']},{r['D']}" for r in rows if r.get("N") is not None})
    header = (f"attn_res grid summary: {len(names)} shapes from {len(runs)} runs, {meta['dtype']}, "
              f"{meta['device_name']}; copy {', '.join(str(run['meta']['ceiling_tbps']) for run in runs)} TB/s")
    print(summary(rows, graphs, header))
    out.mkdir(parents=True, exist_ok=True)
    stem = f"attn_res_grid-{meta['device'].split(':')[0]}-merged"
    merged = {"meta": {**meta, "parts": [run["meta"] for run in runs], "shapes": names, "summary": header},
              "rows": rows}
    (out / f"{stem}.json").write_text(json.dumps(merged, indent=1, default=str))
    print(f"wrote {out / f'{stem}.json'}")
    if not no_plots:
        for path in heatmaps(rows, out, stem, header):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
