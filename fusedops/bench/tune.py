"""python -m fusedops.bench tune <op> [--device cuda|cpu] [--quick] [--write | --table PATH] [--run NAME]

Tunes an op's launch-plan table (fusedops/<op>/plans.json, see fusedops/plans.py) on the device that runs:
for each table row the op's benchmark cases resolve to, it times the op under candidate variations of that
row's params (each candidate installed as a row of this device's arch, ahead of the table; all of them timed
in turn, three rounds, ranked by median) and emits the fastest as a table row named by the run
("h100-2026-11-26-attn-res-tune"), or the row itself where no candidate beats it by 2%. The rows are printed
as JSON lines; --write puts them into the package's table, --table PATH writes the updated table to PATH
instead.

Nothing is chosen at run time: the op reads what this command wrote, so every process computes the same bits
(candidates may differ in reduction order; only the table decides which one runs).

On a CPU it runs the kernels in the Triton interpreter (TRITON_INTERPRET=1, FUSEDOPS_INTERPRET=cuda by
default) over one tiny case and a two-value sweep: a smoke test of the machinery (CI), not a measurement.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import statistics
import sys
import time

PROG = "python -m fusedops.bench tune"

# Candidate values per table param, per op and kernel (params left out keep the row's value). Only params that
# exist in the row are swept; a candidate equal to the row is the baseline.
CANDIDATES = {
    "attn_res": {
        "fwd": {"tile_elements": [4096, 8192, 16384], "num_warps": [4, 8]},
        "bwd": {"tile_elements": [2048, 4096, 8192], "programs_per_core": [1, 2, 4]},
        "bwd_onepass": {"tile_elements": [2048, 4096, 8192], "programs_per_core": [1, 2, 4]},
        "fwd_depth": {"programs_per_core": [2, 4, 8], "per_token_elements": [2048, 4096, 8192],
                      "group_rows": [1, 2, 4]},
        "bwd_depth": {"programs_per_core": [1, 2, 4], "elements_per_thread": [64, 128]},
        "reduce": {"block_d": [32, 64, 128], "max_block_p": [64, 128, 256]},
    },
    "block_attn_res": {
        "multi_fwd": {"tile_elements": [4096, 8192, 16384]},
        # the two-pass keys (logit_*, out_warps) are swept kernel by kernel: fusedops.bench.tune_block_attn_res two-pass
        "multi_dot": {"rows": [32, 64, 128], "wide_tile_d": [64, 128, 256], "narrow_tile_d": [32, 64, 128]},
        "multi_bwd": {"tile_elements": [2048, 4096, 8192]},
        "merge_fwd": {"tile_d": [2048, 4096, 8192], "many_rows_max_warps": [4, 8, 16], "whole_row_d": [16384, 0]},
        "merge_bwd": {"tile_elements": [4096, 8192, 16384]},
    },
    "embedding": {
        "fwd": {"tile_bytes": [8192, 16384, 32768], "max_block_d": [512, 1024, 2048]},
        "bwd": {"rows": [2, 4, 8], "max_block_d": [512, 1024]},
        "bwd_launch": {"num_warps": [2, 4, 8], "max_registers": [0, 128, 168]},
    },
    "neighborhood_attention": {
        "fwd": {"num_warps": [4, 8], "registers": [0, 128, 168]},
        "bwd": {"num_warps": [0, 4, 8], "registers": [0, 128, 168]},
        "fused": {"block": [32, 64], "num_stages": [1, 2]},
    },
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[1])
    p.add_argument("op", choices=sorted(CANDIDATES))
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when there is one")
    p.add_argument("--quick", action="store_true", help="one case, two values per param")
    p.add_argument("--write", action="store_true", help="write the rows into fusedops/<op>/plans.json")
    p.add_argument("--table", default=None, help="write the updated table here instead of the package's")
    p.add_argument("--run", default=None, help='the rows\' "run" name (default: <gpu>-<date>-<op>-tune)')
    p.add_argument("--reps", type=int, default=None, help="timed repetitions per candidate")
    return p.parse_args(argv)


def _device(name: str | None):
    import torch

    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit(f"{PROG}: on a CPU the kernels run in the Triton interpreter: set TRITON_INTERPRET=1")
        os.environ.setdefault("FUSEDOPS_INTERPRET", "cuda")
    return torch.device(name)


def _gpu_name(device) -> str:
    import torch

    from fusedops.targets import target_for

    if device.type != "cuda":
        return "interpreter-" + os.environ.get("FUSEDOPS_INTERPRET", "cuda")
    name = torch.cuda.get_device_name(device).upper()
    for short in ("H200", "H100", "A100", "L40S", "B200"):
        if short in name:
            return short.lower()
    return target_for(device).arch or "cuda"


# ---- the op's cases: (label, a function running one step) --------------------------------------------------

def _cases(op: str, device, quick: bool) -> list:
    import torch

    import fusedops

    cpu = device.type == "cpu"
    dtype = torch.float32 if cpu else torch.bfloat16
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape, grad=False):
        t = torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)
        return t.requires_grad_() if grad else t

    out = []
    if op == "attn_res":
        from fusedops.bench.attn_res import CASES

        shapes = [(4, 1, 16, 64)] if cpu else CASES[:1] if quick else CASES
        for n, b, t, d in shapes:
            v, q, w = rand(n, b, t, d, grad=True), rand(d, grad=True), rand(d, grad=True)
            g = rand(b, t, d)

            def step(v=v, q=q, w=w, g=g):
                fusedops.attn_res(v, q, w).backward(g)
            out.append((f"N{n} B{b} T{t} D{d}", step))
    elif op == "block_attn_res":
        from fusedops.bench.block_attn_res import MERGE_CASES, MULTI_CASES

        multi = [(4, 3, 16, 32)] if cpu else MULTI_CASES[:1] if quick else MULTI_CASES[::6]
        for n, m, t, d in multi:
            values, queries = rand(n, t, d, grad=True), rand(m, d, grad=True)
            g, g_lse = rand(m, t, d), rand(m, t).float()

            def step(values=values, queries=queries, g=g, g_lse=g_lse):
                torch.autograd.backward(fusedops.attn_res_multi(values, queries), (g, g_lse))
            out.append((f"multi N{n} M{m} T{t} D{d}", step))
        merge = [(16, 32)] if cpu else MERGE_CASES[:1] if quick else MERGE_CASES
        for t, d in merge:
            o, p, a, q = rand(t, d, grad=True), rand(t, d, grad=True), rand(t, d, grad=True), rand(d, grad=True)
            lse, g = rand(t).float().requires_grad_(), rand(t, d)

            def step(o=o, lse=lse, p=p, a=a, q=q, g=g):
                fusedops.attn_res_merge(o, lse, p, q, a)[0].backward(g)
            out.append((f"merge T{t} D{d}", step))
    elif op == "embedding":
        from fusedops.bench.embedding import CASES

        shapes = [(64, 48, 32)] if cpu else CASES[:1] if quick else CASES
        for v, d, tokens in shapes:
            weight = rand(v, d, grad=True)
            idx = torch.randint(0, v, (tokens,), generator=gen).to(device)
            g = rand(tokens, d)

            def step(weight=weight, idx=idx, g=g):
                fusedops.embedding(idx, weight).backward(g)
            out.append((f"V{v} D{d} T{tokens}", step))
    else:
        from fusedops.bench.neighborhood_attention import CASES

        shapes = [(1, 2, (32,), 16, (5,))] if cpu else CASES[:1] if quick else CASES
        for b, h, spatial, d, kernel in shapes:
            q, k, v = (rand(b, h, *spatial, d, grad=True) for _ in range(3))
            g = rand(b, h, *spatial, d)

            def step(q=q, k=k, v=v, g=g, kernel=kernel):
                fusedops.neighborhood_attention(q, k, v, kernel).backward(g)
            out.append((f"B{b} H{h} {'x'.join(map(str, spatial))} D{d} k{'x'.join(map(str, kernel))}", step))
    return out


def _timer(device, reps: int):
    if device.type == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, rep=max(reps, 1) * 10) * 1e-3

    def wall(fn):
        fn()  # warm-up (the interpreter has nothing to compile, but caches fill)
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - start) / reps
    return wall


# ---- tuning -------------------------------------------------------------------------------------------------

def _row_key(row: dict) -> tuple:
    return row["kernel"], row["vendor"], row["arch"], json.dumps(row["when"], sort_keys=True)


ROUNDS = 3  # timings of each candidate, taken in turn with the others
MARGIN = 0.02  # how much faster than the table's row a candidate must be to replace it


def _candidates(op: str, row: dict, quick: bool) -> list[dict]:
    sweep = {k: v for k, v in CANDIDATES[op].get(row["kernel"], {}).items() if k in row["params"]}
    if quick:
        sweep = {k: v[:2] for k, v in sweep.items()}
    names = sorted(sweep)
    out = [dict(row["params"])]
    for values in itertools.product(*(sweep[n] for n in names)):
        params = dict(row["params"], **dict(zip(names, values)))
        if params not in out:
            out.append(params)
    return out


def choose(results: list, row_params: dict) -> tuple:
    """(time, params) of the fastest of `results` [(median time, params)], or the row's own entry unless the
    fastest beats it by MARGIN (the fastest when the row has no entry: it failed)."""
    best = min(results, key=lambda r: r[0])
    base = next((r for r in results if r[1] == row_params), None)
    return base if base is not None and best[0] > base[0] * (1 - MARGIN) else best


def tune(op: str, device, *, quick: bool, reps: int, run: str) -> list[dict]:
    """The tuned rows: one per table row that the op's cases resolve, for this device's arch."""
    from fusedops import plans
    from fusedops.targets import target_for

    target = target_for(device)
    arch = target.arch or "*"
    cases = _cases(op, device, quick)
    timer = _timer(device, reps)
    tuned = []
    for label, step in cases:
        with plans.recorded_resolutions() as seen:
            step()
        rows = {}
        for o, kernel, _features, row in seen:
            if o == op and kernel in CANDIDATES[op]:
                rows.setdefault(_row_key(row), row)
        for row in rows.values():
            # Candidates are timed in turn, ROUNDS times, and ranked by their medians: a GPU's speed drifts
            # between consecutive timings by more than the candidates differ (bench/NOTES.md, attn_res on the
            # H200: the same row read 768 and 658 us one kernel apart). A candidate replaces the row only when
            # it beats it by MARGIN.
            candidates = _candidates(op, row, quick)
            times: dict = {i: [] for i in range(len(candidates))}
            for _ in range(1 if quick else ROUNDS):
                for i, params in enumerate(candidates):
                    if times[i] is None:
                        continue
                    try:
                        with plans.candidate_rows(op, [dict(row, arch=arch, params=params, run=run)]):
                            times[i].append(timer(step))
                    except Exception as e:  # noqa: BLE001 - a candidate that fails to compile or fit is skipped
                        print(f"  {label} {row['kernel']} {params}: failed ({type(e).__name__}: {e})",
                              file=sys.stderr)
                        times[i] = None
            results = [(statistics.median(t), candidates[i]) for i, t in times.items() if t]
            for t, params in results:
                print(f"  {label} {row['kernel']} {json.dumps(row['when'])} {params}: {t * 1e6:.1f} us",
                      file=sys.stderr)
            if not results:
                continue
            best_t, best = choose(results, row["params"])
            base_t = results[0][0] if results[0][1] == row["params"] else float("nan")
            print(f"{label} {row['kernel']}: best {best_t * 1e6:.1f} us (table's row {base_t * 1e6:.1f} us)",
                  file=sys.stderr)
            tuned.append(dict(kernel=row["kernel"], vendor=row["vendor"], arch=arch, when=row["when"], params=best,
                              run=run))
    # one row per (kernel, when): the first case's choice (cases that share a row are tuned on the first)
    unique = {}
    for row in tuned:
        unique.setdefault(_row_key(row), row)
    return list(unique.values())


def merge(table: dict, rows: list[dict]) -> dict:
    """The table with `rows` in place of the rows of the same (kernel, vendor, arch, when), others appended."""
    out = dict(table, rows=list(table["rows"]))
    index = {_row_key(r): i for i, r in enumerate(out["rows"])}
    for row in rows:
        i = index.get(_row_key(row))
        if i is None:
            out["rows"].append(row)
        else:
            out["rows"][i] = row
    return out


def dump(table: dict) -> str:
    """A table as plans.json holds it: one row per line."""
    head = {k: v for k, v in table.items() if k != "rows"}
    lines = ["{"] + [f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()] + ['  "rows": [']
    lines += ["    " + json.dumps(r) + ("," if i + 1 < len(table["rows"]) else "") for i, r in enumerate(table["rows"])]
    return "\n".join(lines + ["  ]", "}"]) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    device = _device(args.device)
    from fusedops import plans

    if args.write and device.type == "cpu":
        raise SystemExit(f"{PROG}: --write takes a GPU's measurements; on a CPU (a smoke test) use --table PATH")

    run = args.run or f"{_gpu_name(device)}-{datetime.date.today().isoformat()}-{args.op.replace('_', '-')}-tune"
    reps = args.reps or (1 if device.type == "cpu" else 20)
    rows = tune(args.op, device, quick=args.quick or device.type == "cpu", reps=reps, run=run)
    for row in rows:
        print(json.dumps(row))
    if args.write or args.table:
        table = merge(plans.table(args.op), rows)
        plans.validate(table)
        path = args.table or str(plans.table_path(args.op))
        with open(path, "w") as f:
            f.write(dump(table))
        print(f"{len(rows)} rows written to {path}", file=sys.stderr)
        plans.reload()
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
