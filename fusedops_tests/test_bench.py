"""`python -m bench` quick mode on CPU: exits 0, reports every op, and the interpreter parity passes.

Runs the real command in a subprocess (as a user would), plus unit checks of the harness pieces.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import OPS  # noqa: E402
from bench.__main__ import format_table, plot  # noqa: E402
from bench.common import Context, case_name, error_row, fwd_bwd_fns, measure  # noqa: E402


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    env = {k: v for k, v in os.environ.items() if k not in ("FUSEDOPS_INTERPRET", "TRITON_INTERPRET")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--device", "cpu", "--no-plots", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=420,
    )
    files = list(out.glob("cpu-*.json"))
    data = json.loads(files[0].read_text()) if len(files) == 1 else None
    return proc, data


def test_quick_cpu_exits_zero_and_writes_json(quick_run):
    proc, data = quick_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert data is not None, "expected exactly one bench/results-style JSON file"
    assert data["meta"]["device"] == "cpu" and data["meta"]["quick"] is True
    assert data["meta"]["ceiling_tbps"] > 0
    # the table is printed, with a header and the ceiling line
    assert "provider" in proc.stdout and "ceiling" in proc.stdout


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
        error_row("x", "1,2", "liger", "fwd", ImportError("liger_kernel not importable")),
        {"op": "y", "case": "parity tiny", "provider": "fusedops[cuda-plan,interp]", "mode": "fwd+bwd", "ms": 9.0,
         "rel_err": 1e-7, "tol": 1e-4, "ok": True},
    ]
    table = format_table(rows, 2.5)
    assert "80.0" in table and "liger_kernel not importable" in table and "1.0e-07" in table
    pytest.importorskip("matplotlib")
    paths = plot(rows, tmp_path, "cpu-test", "title")
    assert [p.name for p in paths] == ["cpu-test-x.png"] and paths[0].stat().st_size > 0


def test_missing_op_module_is_a_row_not_a_crash(monkeypatch):
    from bench import __main__ as main

    ctx = Context(device=torch.device("cpu"), quick=True, verbose=False)
    rows = main.run_op("no_such_op_module", ctx)
    assert len(rows) == 1 and "not importable" in rows[0]["error"]


def test_alternated_rows_take_turns_and_report_medians():
    """The benches time host-bound steps in alternation: each round times every provider once, in
    order, and each row holds the median of its provider's rounds."""
    from bench.common import alternated_rows

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
