"""`python -m fusedops.bench` quick mode on CPU: exits 0, reports every op, and the interpreter parity passes.

Runs the real command in a subprocess (as a user would), plus unit checks of the harness pieces.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fusedops.bench import OPS
from fusedops.bench.__main__ import format_table, plot
from fusedops.bench.common import Context, case_name, error_row, fwd_bwd_fns, measure

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict:
    """The environment of a user's shell: no interpreter switches, this checkout's fusedops importable."""
    env = {k: v for k, v in os.environ.items() if k not in ("FUSEDOPS_INTERPRET", "TRITON_INTERPRET")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    proc = subprocess.run(
        [sys.executable, "-m", "fusedops.bench", "--quick", "--device", "cpu", "--no-plots", "--out", str(out)],
        cwd=out, env=_env(), capture_output=True, text=True, timeout=420,
    )
    files = list(out.glob("cpu-*.json"))
    data = json.loads(files[0].read_text()) if len(files) == 1 else None
    return proc, data


def test_quick_cpu_exits_zero_and_writes_json(quick_run):
    proc, data = quick_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert data is not None, "expected exactly one bench/results-style JSON file"
    assert data["meta"]["device"] == "cpu" and data["meta"]["quick"] is True
    assert data["meta"]["parity"].startswith("PASS")


def test_quick_cpu_table_leads_with_parity_and_calls_timings_indicative(quick_run):
    """On a CPU the parity check is the result: it heads the table; the timings under it say they are
    indicative, and no % of copy bandwidth is printed or recorded."""
    proc, data = quick_run
    out = proc.stdout
    assert out.lstrip().startswith("Kernel-vs-reference parity"), out[:500]
    assert "PASS" in out.splitlines()[0]
    assert "indicative only" in out and out.index("indicative only") > out.index("fusedops[ascend-plan,interp]")
    assert "% copy" not in out and "ceiling" not in out
    assert data["meta"]["ceiling_tbps"] is None
    assert not any("pct_ceiling" in r for r in data["rows"])


def test_quick_cpu_missing_baselines_get_one_line(quick_run):
    """Baselines that are not installed (Liger, fla on this machine) are one line, not an error per row."""
    proc, data = quick_run
    missing = [r for r in data["rows"] if r.get("missing")]
    assert len(missing) == len({(r["op"], r["provider"]) for r in missing})
    errors = [r for r in data["rows"] if r.get("error") and not r.get("missing")]
    assert not errors, errors
    lines = [ln for ln in proc.stdout.splitlines() if "not importable" in ln]
    assert len(lines) <= 1, lines
    if missing:
        assert lines and lines[0].startswith("optional baselines not importable, skipped:")


def test_sizes_select_the_cases_of_the_device_that_runs(tmp_path):
    """--sizes picks from the running device's cases (the CPU's here); an op with none selected is skipped, and
    a selection that matches nothing exits 2 and lists the cases there are."""
    from fusedops.bench import attn_res
    from fusedops.bench.__main__ import select_ops

    cpu = torch.device("cpu")
    ctx = Context(device=cpu, sizes=["16,1,256,1024"], verbose=False)
    assert ctx.cases_of(attn_res) == [(16, 1, 256, 1024)]
    assert select_ops(list(OPS), ctx) == (["attn_res"], "")
    assert Context(device=torch.device("cuda"), sizes=["8,1,8192,4096"]).cases_of(attn_res) == [(8, 1, 8192, 4096)]
    assert Context(device=cpu, sizes=["8,1,8192,4096"]).cases_of(attn_res) == []
    proc = subprocess.run(
        [sys.executable, "-m", "fusedops.bench", "--device", "cpu", "--no-plots", "--out", str(tmp_path),
         "--sizes", "8,1,8192,4096"], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "selects no case on cpu" in proc.stderr
    assert "attn_res: 8,1,512,1024" in proc.stderr and "embedding: 4096,256,2048" in proc.stderr
    assert not list(tmp_path.glob("*.json"))


def test_repository_alias_runs_the_packaged_bench():
    """`python -m bench` in a checkout is `python -m fusedops.bench`."""
    proc = subprocess.run([sys.executable, "-m", "bench", "--help"], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "python -m fusedops.bench" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize("op", OPS)
def test_quick_cpu_times_every_op(quick_run, op):
    _, data = quick_run
    rows = [r for r in data["rows"] if r["op"] == op and not r["case"].startswith("parity")]
    assert rows, f"no rows for {op}"
    timed = [r for r in rows if r.get("ms") is not None and not r.get("error")]
    assert timed, f"{op}: no provider was timed: {[r.get('error') for r in rows]}"
    fused = [r for r in timed if r["provider"] == "fusedops"]
    assert fused, f"{op}: fusedops itself was not timed"
    for r in timed:
        assert r["mode"] in ("fwd", "bwd", "fwd+bwd") and r["ms"] > 0


@pytest.mark.parametrize("op", OPS)
def test_quick_cpu_parity_under_the_interpreter(quick_run, op):
    _, data = quick_run
    rows = [r for r in data["rows"] if r["op"] == op and r["case"].startswith("parity")]
    providers = {r["provider"] for r in rows}
    assert {"fusedops[reference]", "fusedops[cuda-plan,interp]", "fusedops[ascend-plan,interp]"} <= providers, rows
    for r in rows:
        assert r.get("ok") is True, r
        assert r["rel_err"] <= r["tol"]


# ---- the harness's pieces ----------------------------------------------------------------------------


def test_measure_never_raises_and_fills_rates():
    ctx = Context(device=torch.device("cpu"), quick=True, verbose=False, ceiling_tbps=0.01)
    x = torch.randn(1000)
    r = measure(ctx, "op", (1, 2), "p", "fwd", lambda: x * 2, nbytes=8000, flops=1000)
    assert r["case"] == "1,2" and r["ms"] > 0 and r["tbps"] > 0 and r["tflops"] > 0
    assert r["pct_ceiling"] == pytest.approx(100 * r["tbps"] / 0.01)
    assert r["peak_mb"] is None  # CPU

    def boom():
        raise RuntimeError("provider exploded\nsecond line")

    bad = measure(ctx, "op", "c", "p", "bwd", boom)
    assert bad["ms"] is None and bad["error"] == "RuntimeError: provider exploded"


def test_fwd_bwd_fns_compute_gradients():
    w = torch.randn(4, 3, requires_grad=True)
    fns = fwd_bwd_fns(lambda: (w * w).sum(0), [w])
    assert set(fns) == {"fwd", "bwd", "fwd+bwd"}
    (g,) = fns["fwd+bwd"]()
    assert g.shape == w.shape
    assert not fns["fwd"]().requires_grad


def test_select_sizes_and_quick():
    cases = [(8, 1, 8192, 4096), (16, 1, 4096, 4096), (4, 2, 4096, 4096)]
    assert Context(torch.device("cpu")).select(cases) == cases
    assert Context(torch.device("cpu"), quick=True).select(cases) == cases[:1]
    assert Context(torch.device("cpu"), quick=True).select(cases, quick=[(1, 1, 1, 1)]) == [(1, 1, 1, 1)]
    assert Context(torch.device("cpu"), sizes=["16,1,4096,4096"]).select(cases) == [cases[1]]
    assert Context(torch.device("cpu"), sizes=["4096,4096"]).select(cases) == cases[1:]
    assert case_name(((1, 2), 3)) == "1,2,3"


def test_table_and_plot(tmp_path):
    rows = [
        {"op": "x", "case": "1,2", "provider": "fusedops", "mode": "fwd", "ms": 1.0, "tbps": 2.0, "pct_ceiling": 80.0,
         "peak_mb": 3.0},
        {"op": "x", "case": "1,2", "provider": "eager", "mode": "fwd", "ms": 2.0, "tbps": 1.0, "pct_ceiling": 40.0},
        error_row("x", "1,2", "flex", "fwd", RuntimeError("flex exploded")),
        {"op": "x", "case": "-", "provider": "liger", "mode": "-", "ms": None, "missing": True,
         "error": "liger_kernel.ops.x not importable (ModuleNotFoundError: No module named 'liger_kernel')"},
        {"op": "y", "case": "parity tiny", "provider": "fusedops[cuda-plan,interp]", "mode": "fwd+bwd", "ms": 9.0,
         "rel_err": 1e-7, "tol": 1e-4, "ok": True},
    ]
    table = format_table(rows, 2.5)
    assert "80.0" in table and "flex exploded" in table and "1.0e-07" in table and "% copy" in table
    (line,) = [ln for ln in table.splitlines() if "liger" in ln]
    assert line.startswith("optional baselines not importable, skipped: liger (x; ")
    cpu = format_table(rows, float("nan"), cpu=True)
    assert cpu.startswith("Kernel-vs-reference parity") and "PASS (1/1" in cpu.splitlines()[0]
    assert "80.0" not in cpu and "% copy" not in cpu and "indicative only" in cpu
    pytest.importorskip("matplotlib")
    paths = plot(rows, tmp_path, "gpu-test", "title")
    assert [p.name for p in paths] == ["gpu-test-x.png"] and paths[0].stat().st_size > 0
    paths = plot(rows, tmp_path, "cpu-test", "title", cpu=True)  # on a CPU, the parity panel too
    assert [p.name for p in paths] == ["cpu-test-x.png", "cpu-test-y.png"]


def test_missing_baseline_is_one_row_per_op():
    from fusedops.bench.common import optional_import

    ctx = Context(device=torch.device("cpu"), quick=True, verbose=False)
    with pytest.raises(ImportError) as info:
        optional_import("no_such_baseline_module")
    rows = ctx.failed("op", "1,2", "liger", ("fwd", "bwd"), info.value)
    rows += ctx.failed("op", "3,4", "liger", ("fwd", "bwd"), info.value)
    assert len(rows) == 1 and rows[0]["missing"] and rows[0]["case"] == "-"
    assert len(ctx.failed("other_op", "1,2", "liger", ("fwd",), info.value)) == 1
    broken = ctx.failed("op", "1,2", "fusedops", ("fwd", "bwd"), RuntimeError("boom"))
    assert [r["mode"] for r in broken] == ["fwd", "bwd"] and all("boom" in r["error"] for r in broken)


def test_missing_op_module_is_a_row_not_a_crash(monkeypatch):
    from fusedops.bench import __main__ as main

    ctx = Context(device=torch.device("cpu"), quick=True, verbose=False)
    rows = main.run_op("no_such_op_module", ctx)
    assert len(rows) == 1 and "not importable" in rows[0]["error"]


def test_alternated_rows_take_turns_and_report_medians():
    """The benches time host-bound steps in alternation: each round times every provider once, in
    order, and each row holds the median of its provider's rounds."""
    from fusedops.bench.common import alternated_rows

    calls = []

    class Clock:
        def time(self, fn):
            calls.append(fn.__name__)
            return fn()

        def progress(self, msg):
            pass

    times = {"a": iter([5.0, 1.0, 3.0]), "b": iter([2.0, 9.0, 4.0])}

    def a():
        return next(times["a"])

    def b():
        return next(times["b"])

    rows = alternated_rows(Clock(), "op", "case", "fwd+bwd", {"fusedops": a, "flex": b}, flops=3e9, nbytes=6e9,
                           rounds=3)
    assert calls == ["a", "b"] * 3
    by = {r["provider"]: r for r in rows}
    assert by["fusedops (alternating)"]["ms"] == 3.0 and by["flex (alternating)"]["ms"] == 4.0
    assert all(r["mode"] == "fwd+bwd" for r in rows)
    assert by["fusedops (alternating)"]["tflops"] == pytest.approx(3e9 / 3e-3 / 1e12)
    assert by["flex (alternating)"]["tbps"] == pytest.approx(6e9 / 4e-3 / 1e12)

    def broken():
        raise RuntimeError("boom")

    times["a"] = iter([1.0, 1.0])
    rows = alternated_rows(Clock(), "op", "case", "fwd", {"fusedops": a, "flex": broken}, flops=1.0, rounds=2)
    assert [r["provider"] for r in rows] == ["fusedops (alternating)", "flex (alternating)"]
    assert all("boom" in r["error"] for r in rows)


# ---- the attn_res shape grid (issue #31) ---------------------------------------------------------------


def test_attn_res_grid_covers_every_axis_and_runs_quick_on_cpu(tmp_path, monkeypatch, capsys):
    """The grid holds every value of every axis under the input cap, the walk's first 60 plus 12 drawn with a
    fixed seed; `--quick --device cpu` runs tiny shapes through the reference path, writes every row with its
    ratio to fusedops, and prints the summary with the issue's targets; --sizes that select nothing exit 2."""
    from fusedops.bench import attn_res_grid as grid

    monkeypatch.delenv("FUSEDOPS_INTERPRET", raising=False)  # the reference path, not the interpreter
    shapes, skipped = grid.grid()
    assert len(shapes) == len(set(shapes)) == 72 and shapes == grid.grid()[0]
    assert all(n * t * d * 2 <= 16e9 for n, t, d in shapes) and all(n * t * d * 2 > 16e9 for n, t, d in skipped)
    for axis, values in enumerate((grid.NS, grid.TOKENS, grid.DS)):
        assert {s[axis] for s in shapes[:60]} == set(values)
    assert grid.kind(grid.mode_bytes((8, 8192, 4096), 2)["fwd"]) == "throughput"
    assert grid.kind(grid.mode_bytes((8, 8, 4096), 2)["fwd+bwd"]) == "latency"

    assert grid.main(["--quick", "--device", "cpu", "--no-plots", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    (path,) = tmp_path.glob("attn_res_grid-cpu-*.json")
    data = json.loads(path.read_text())
    fused = [r for r in data["rows"] if r["provider"] == "fusedops"]
    assert len(fused) == 2 * data["meta"]["shapes_measured"] == 6
    assert all(r["ms"] > 0 and r["ratio"] == 1.0 and not r.get("error") and r["kind"] for r in fused), fused
    assert not any("pct_ceiling" in r or "replay_us" in r for r in data["rows"])
    assert out.startswith("attn_res grid summary: 3 of 3 shapes") and "indicative only" in out
    assert ">= 88 every, median >= 92" in out and ">= 75 every, median >= 80" in out

    assert grid.main(["--device", "cpu", "--sizes", "no-such-shape", "--out", str(tmp_path)]) == 2
    assert "selects no shape on cpu" in capsys.readouterr().err

    # --warm times and writes nothing; --summarize merges parts' rows into one JSON beside its summary
    warm = ["--quick", "--device", "cpu", "--warm", "--part", "1/2", "--sub", "1/2", "--out", str(tmp_path / "w")]
    assert grid.main(warm) == 0
    assert "warm " in capsys.readouterr().err and not (tmp_path / "w").exists()
    assert grid.main(["--summarize", str(path), str(path), "--out", str(tmp_path / "m"), "--no-plots"]) == 0
    merged = json.loads((tmp_path / "m" / "attn_res_grid-cpu-merged.json").read_text())
    assert merged["rows"] == data["rows"] * 2 and len(merged["meta"]["parts"]) == 2
    assert capsys.readouterr().out.startswith("attn_res grid summary: 3 shapes from 2 runs")


def test_attn_res_grid_heatmaps(tmp_path):
    pytest.importorskip("matplotlib")
    from fusedops.bench import attn_res_grid as grid

    rows = [dict(N=8, tokens=t, D=4096, provider=p, mode=m, kind="throughput", ms=1.0, pct_ceiling=pct, ratio=ratio)
            for t, pct in ((8192, 90.0), (32768, 85.0)) for m in grid.MODES
            for p, ratio in (("fusedops", 1.0), ("fla", 1.3), ("liger", 0.9))]
    paths = grid.heatmaps(rows, tmp_path, "t", "title")
    assert [p.name for p in paths] == ["t-copy.png", "t-vs-baseline.png"] and all(p.stat().st_size for p in paths)


# ---- the neighborhood-attention grid (issue #32) --------------------------------------------------------------


def test_na_grid_covers_the_issue_and_flex_sees_fusedops_windows():
    """The grid holds at least 30 shapes over what the issue lists (1-D windows 3..4096 with causal sliding windows
    of 1024 and 4096 and dilation up to 8, 2-D windows 3x3 up to 13x13 and beyond with dilation, 3-D shapes, head
    dims 32..256, GQA), and the Flex baselines' mask (the grid's and `python -m fusedops.bench`'s) is fusedops'
    neighbourhood: on small shapes with dilation and causal axes its dense mask equals the reference's neighbour
    table."""
    from fusedops.bench import na_grid
    from fusedops.bench.neighborhood_attention import neighborhood_mask_mod
    from fusedops.neighborhood_attention.reference import neighbor_table

    grid = na_grid.GRID
    assert len(grid) >= 30 and len({na_grid.label(c) for c in grid}) == len(grid)
    one_d = [c for c in grid if len(c[3]) == 1]
    assert {c[5][0] for c in one_d if c[7][0]} >= {1024, 4096} and max(c[6][0] for c in one_d) == 8
    assert min(c[5][0] for c in one_d) == 3 and max(c[5][0] for c in one_d) == 4096
    assert {c[4] for c in grid} == {32, 64, 96, 128, 256} and any(c[2] != c[1] for c in grid)
    assert {len(c[3]) for c in grid} == {1, 2, 3} and sum(map(na_grid.small_window, grid)) >= 8
    assert any(len(c[3]) == 2 and max(c[6]) > 1 for c in grid)
    for spatial, kernel, dil, causal in [((23,), (5,), (3,), (False,)), ((19,), (6,), (2,), (True,)),
                                         ((9, 10), (3, 4), (2, 1), (False, True)),
                                         ((5, 6, 7), (3, 2, 3), (1, 2, 2), (True, False, False)),
                                         ((11, 12), (5, 7), None, None)]:  # the benchmark's default call
        s = math.prod(spatial)
        index, valid = neighbor_table(spatial, kernel, dil or (1,) * len(spatial), (1,) * len(spatial),
                                      causal or (False,) * len(spatial), "shifted")
        want = torch.zeros(s, s, dtype=torch.bool)
        want[torch.arange(s)[:, None].expand_as(index)[valid], index[valid]] = True
        mask_mod = neighborhood_mask_mod(spatial, kernel, dil, causal)
        got = mask_mod(0, 0, torch.arange(s)[:, None], torch.arange(s)[None, :])
        assert torch.equal(got, want), (spatial, kernel, dil, causal)
