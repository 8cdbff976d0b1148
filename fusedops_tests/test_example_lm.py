"""The example language model (fusedops.examples.lm) trains, compiles without graph breaks, and exports.

One tiny model is trained once per session (module fixture) and shared by the tests, to stay within
CI's time on a 2-core CPU. The compile backend is aot_eager: it runs dynamo with fullgraph=True (a
graph break raises) and AOTAutograd (the fusedops backward ops in the joint graph) without inductor's
C++ code generation, which alone takes minutes on the CI machine.
"""

from __future__ import annotations

import math

import pytest
import torch

import fusedops
from fusedops.examples import lm
from fusedops_tests.helpers import gpu

TINY = lm.Config(vocab=64, dim=32, heads=2, layers=2, block_layers=1, window=4, period=3, seq=32, batch=8,
                 steps=20, lr=1e-2, noise=0.05, seed=0)


@pytest.fixture(scope="module")
def trained():
    torch.manual_seed(TINY.seed)
    torch._dynamo.reset()
    data = lm.SyntheticText(TINY.vocab, TINY.period, TINY.noise, TINY.seed)
    model = lm.AttnResLM(TINY)
    losses = lm.train(model, data, TINY.steps, torch.device("cpu"), compile=True, backend="aot_eager", log=None)
    return model, data, losses


def test_model_uses_the_fusedops_modules():
    model = lm.AttnResLM(TINY)
    assert isinstance(model.embed, fusedops.nn.Embedding)
    mixes = [m for m in model.modules() if isinstance(m, fusedops.nn.AttnRes)]
    assert len(mixes) == 2 * TINY.layers + 1  # one per sublayer, one before the head
    assert all(torch.count_nonzero(m.query) == 0 for m in mixes)  # zero-initialised pseudo-queries
    # the head is tied to the embedding: no separate output matrix
    assert not any(p.shape == model.embed.weight.shape for n, p in model.named_parameters() if n != "embed.weight")


def test_block_sources_are_counted_as_in_the_paper():
    """Sources of sublayer i (blocks of 2 sublayers): embedding + completed blocks + partial sum."""
    cfg = lm.Config(vocab=32, dim=16, heads=2, layers=4, block_layers=1, window=4, seq=8)
    model = lm.AttnResLM(cfg)
    seen = []
    for sub in list(model.sublayers) + [model.final_mix]:
        mix = sub.mix if hasattr(sub, "mix") else sub
        mix.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[0]))
    model(torch.randint(0, 32, (2, 8)))
    # block 1: [emb], [emb, partial]; block 2: [emb, b1], [emb, b1, partial]; ... final: [emb, b1..b4]
    assert seen == [1, 2, 2, 3, 3, 4, 4, 5, 5]


def test_loss_falls(trained):
    _, data, losses = trained
    assert len(losses) == TINY.steps and all(math.isfinite(x) for x in losses)
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first - 0.3, f"loss {first:.3f} -> {last:.3f}"
    assert last > data.loss_floor(TINY.seq) - 0.05  # sanity: not below the entropy of the data


def test_compiled_graph_has_no_break(trained):
    """fullgraph=True already raised on a break during training; dynamo's explain counts them too."""
    model, data, _ = trained
    x, y = data.batch(2, TINY.seq)
    torch._dynamo.reset()
    with lm.graph_context(x.device):
        explanation = torch._dynamo.explain(model)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def test_export_reload_matches_eager(trained, tmp_path):
    model, data, _ = trained
    x, _ = data.batch(3, TINY.seq)
    loaded = lm.export_and_reload(model, x, str(tmp_path / "lm.pt2"))
    with torch.no_grad():
        ref = model(x)
        got = loaded.module()(x)
        x2, _ = data.batch(3, TINY.seq)  # a fresh batch, not the one traced
        torch.testing.assert_close(loaded.module()(x2), model(x2), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    names = {str(n.target) for n in loaded.graph.nodes if n.op == "call_function"}
    assert any("fusedops" in n for n in names), "the exported program should call the fusedops ops"


_AOTI_RUN = """
import sys, torch
idx, ref = torch.load(sys.argv[2])
got = torch._inductor.aoti_load_package(sys.argv[1])(idx)
assert "fusedops" not in sys.modules, "the package should need no fusedops import"
torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
"""


def _load_in_fresh_process(package: str, idx, ref, tmp_path):
    """Run _AOTI_RUN on the package in a new interpreter; returns the CompletedProcess."""
    import subprocess
    import sys

    torch.save((idx, ref), tmp_path / "case.pt")
    return subprocess.run([sys.executable, "-c", _AOTI_RUN, str(package), str(tmp_path / "case.pt")],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_aoti_package_matches_eager(trained, tmp_path):
    """AOTInductor compiles the exported model (on CPU: C++ from the ops' reference path) into a package that
    matches the eager model on a batch it was not traced with, loaded here and in a process that never
    imports fusedops (the package is self-contained)."""
    model, data, _ = trained
    x, _ = data.batch(3, TINY.seq)
    path = str(tmp_path / "lm_aoti.pt2")
    compiled = lm.aoti_package(model, x, path)
    x2, _ = data.batch(3, TINY.seq)
    with torch.no_grad():
        ref = model(x2)
    torch.testing.assert_close(compiled(x2), ref, rtol=1e-5, atol=1e-5)
    run = _load_in_fresh_process(path, x2, ref, tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]


class _ThreeOps(torch.nn.Module):
    """One of each op: embedding, then 1-D neighborhood attention, then an AttnRes mix of the two."""

    def __init__(self, vocab: int = 512, dim: int = 128):
        super().__init__()
        self.embed = fusedops.nn.Embedding(vocab, dim)
        self.attn = fusedops.nn.NeighborhoodAttention1d(dim, 2, 7)
        self.mix = fusedops.nn.AttnRes(dim)
        torch.nn.init.normal_(self.mix.query, std=0.5)

    def forward(self, idx):
        x = self.embed(idx)
        return self.mix(torch.stack([x, self.attn(x)]))


_PLAIN_RUN = """
import sys, torch
model = torch.nn.Linear(8, 8).cuda().eval()
x = torch.randn(2, 8, device="cuda")
with torch.no_grad():
    path = torch._inductor.aoti_compile_and_package(torch.export.export(model, (x,)), package_path=sys.argv[1])
torch._inductor.aoti_load_package(path)(x)
"""


@gpu
@pytest.mark.gpu
@pytest.mark.slow  # 3.5-5 minutes of Inductor and Triton compiling on the H100 machine
def test_gpu_aoti_package_holds_the_kernels_and_matches_eager(tmp_path):
    """On a GPU the AOTInductor package holds the fusedops Triton kernels (named in its wrapper); loaded back in
    a process that never imports fusedops (which also keeps a crashing loader, seen on some torch builds, out
    of the test process) it matches the eager model."""
    import subprocess
    import sys
    import zipfile

    torch.manual_seed(3)
    model = _ThreeOps().cuda().eval()
    idx = torch.randint(0, 512, (2, 256), device="cuda")
    with torch.no_grad():
        ref = model(idx)
    package = lm.build_aoti_package(model, idx, str(tmp_path / "three.pt2"))
    with zipfile.ZipFile(package) as z:
        wrapper = "".join(z.read(n).decode(errors="ignore") for n in z.namelist() if n.endswith("wrapper.cpp"))
    for kernel in ("embedding_fwd_kernel", "na_fwd_kernel", "attn_res_fwd"):
        assert kernel in wrapper, f"no {kernel} in the package"
    run = _load_in_fresh_process(package, idx, ref, tmp_path)
    if run.returncode < 0:  # killed by a signal: is it this torch build's AOTInductor loader?
        plain = subprocess.run([sys.executable, "-c", _PLAIN_RUN, str(tmp_path / "plain.pt2")],
                               capture_output=True, text=True, timeout=300)
        if plain.returncode < 0:
            pytest.skip(f"aoti_load_package crashes on this torch build ({torch.__version__}) for a plain "
                        f"nn.Linear package too (signal {-plain.returncode})")
    assert run.returncode == 0, run.stderr[-3000:]


def test_synthetic_text_is_deterministic_and_shifted():
    a = lm.SyntheticText(50, 4, 0.0, seed=3)
    b = lm.SyntheticText(50, 4, 0.0, seed=3)
    x, y = a.batch(2, 20)
    x2, y2 = b.batch(2, 20)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert torch.equal(x[:, 1:], y[:, :-1])
    full = torch.cat([x, y[:, -1:]], dim=1)
    assert torch.equal(full[:, 4:], full[:, :-4])  # without noise the text repeats with the period


@pytest.mark.interpreter
@pytest.mark.parametrize("path", ["cuda", pytest.param("ascend", marks=pytest.mark.ascend)])
def test_kernels_in_the_model_match_the_reference(path):
    """The whole model's logits and gradients with the Triton kernels (interpreted, both plans) agree
    with the PyTorch reference path; compiled (opaque ops) as in training."""
    from fusedops_tests.helpers import execution_path, rel_err

    torch.manual_seed(1)
    cfg = lm.Config(vocab=48, dim=32, heads=2, layers=2, block_layers=1, window=4, seq=16)
    model = lm.AttnResLM(cfg)
    for mix in (m for m in model.modules() if isinstance(m, fusedops.nn.AttnRes)):
        torch.nn.init.normal_(mix.query, std=0.5)  # non-uniform depth mixing, so the softmax matters
    x, y = lm.SyntheticText(cfg.vocab, cfg.period, 0.1, seed=2).batch(2, cfg.seq)

    def run():
        model.zero_grad(set_to_none=True)
        loss = lm.compiled_loss(model, backend="aot_eager")
        with lm.graph_context(x.device):
            torch._dynamo.reset()
            value = loss(x, y)
            value.backward()
        return [value.detach()] + [p.grad.clone() for p in model.parameters()]

    with execution_path("reference"):
        ref = run()
    with execution_path(path):
        got = run()
    errs = [rel_err(g, r) for g, r in zip(got, ref)]
    assert 0 < max(errs) < 1e-4, errs  # > 0: the kernels did run, not the reference again


def test_command_line_runs_with_inductor(tmp_path):
    """`python -m fusedops.examples.lm` as a user runs it (inductor, the default backend), a few steps of a
    small model: exit 0, a loss-curve PNG, an exported program that reloads and matches eager."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "FUSEDOPS_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    cmd = [sys.executable, "-m", "fusedops.examples.lm", "--steps", "6", "--layers", "2", "--block-layers", "1",
           "--dim", "32", "--seq", "32", "--batch", "4", "--lr", "1e-2", "--device", "cpu", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "torch.compile(fullgraph=True, backend='inductor')" in proc.stdout
    assert "reloaded: max |logits - eager|" in proc.stdout
    assert (tmp_path / "lm.pt2").stat().st_size > 0
    pytest.importorskip("matplotlib")
    assert (tmp_path / "loss.png").stat().st_size > 0


def test_loss_plot_without_matplotlib_says_it_was_skipped(tmp_path, monkeypatch, capsys):
    """Without matplotlib the example still runs, and says that it skipped the PNG and why."""
    import sys

    from fusedops.examples.lm import save_loss_plot

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    assert save_loss_plot([3.0, 2.0], str(tmp_path / "loss.png")) is False
    out = capsys.readouterr().out
    assert "loss curve not saved" in out and "matplotlib is not importable" in out
    assert not (tmp_path / "loss.png").exists()
