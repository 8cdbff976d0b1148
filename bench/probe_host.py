"""Where the host time of an eager embedding fwd+bwd step goes (CUDA): python -m bench.probe_host

Each row is the host time of one call (calls issued back to back without a sync, so none waits on the
GPU; best of several rounds, the rows timed in turn), for a size where the GPU never bounds the step
(V=32768 D=768, 4096 tokens): whole steps of torch, Liger and fusedops, then fusedops' pieces down to
one kernel launch through each layer (fusedops.launch, Triton's runner, Triton's C launcher). The first
row times a pure-Python loop, to compare this host's speed with another's. Then the backward's layers
timed on autograd's device thread, a step timeline, and whether any call waits for the GPU.
"""

from __future__ import annotations

import inspect
import time

import torch
import torch.nn.functional as F

import fusedops
from bench.common import optional_import
from bench.host import host_ms
from fusedops.registry import call_direct

ROUNDS, REPS = 7, 50


def _inputs(v: int, d: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [V, D] bf16 requiring grad, uniform indices [tokens], grad_out [tokens, D] bf16, on CUDA."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(v, d, generator=gen).to("cuda", torch.bfloat16).requires_grad_()
    idx = torch.randint(0, v, (tokens,), generator=gen).cuda()
    return w, idx, torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16)


def _fused_step(w, idx, go):
    return torch.autograd.grad(fusedops.embedding(idx, w), [w], go)


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


def main(v: int = 32768, d: int = 768, tokens: int = 4096) -> None:
    from fusedops.embedding import op as emb
    from fusedops.embedding.kernels import embedding_bwd_kernel
    from fusedops.launch import _CACHE, launch
    from fusedops.targets import target_for

    import triton

    print("torch", torch.__version__, "triton", triton.__version__)
    w, idx, go = _inputs(v, d, tokens)
    target = target_for(w.device)
    try:
        liger = optional_import("liger_kernel.ops.experimental.embedding")
    except ImportError:
        liger = None

    rows = {"python loop sum(range(1000))": lambda: sum(range(1000))}
    rows["torch F.embedding fwd+bwd"] = lambda: torch.autograd.grad(F.embedding(idx, w), [w], go)
    if liger is not None:
        rows["liger fwd+bwd"] = lambda: torch.autograd.grad(liger.LigerEmbeddingFunction.apply(w, idx), [w], go)
    rows["fusedops fwd+bwd"] = lambda: _fused_step(w, idx, go)
    from fusedops import launch as launch_mod

    def through_runner():  # every launch through Triton's runner (as while a launch hook is set)
        saved, launch_mod._hooks_set = launch_mod._hooks_set, lambda: True
        try:
            return _fused_step(w, idx, go)
        finally:
            launch_mod._hooks_set = saved

    rows["fusedops fwd+bwd, launches via Triton's runner"] = through_runner
    rows["fusedops fwd (graph built)"] = lambda: fusedops.embedding(idx, w)

    def no_grad_fwd():
        with torch.no_grad():
            return fusedops.embedding(idx, w)

    rows["fusedops fwd (no_grad)"] = no_grad_fwd
    out_f, out_t = fusedops.embedding(idx, w), F.embedding(idx, w)
    rows["fusedops bwd (saved graph)"] = lambda: torch.autograd.grad(out_f, [w], go, retain_graph=True)
    rows["torch bwd (saved graph)"] = lambda: torch.autograd.grad(out_t, [w], go, retain_graph=True)
    x = torch.zeros(4, device="cuda", requires_grad=True)
    g4 = torch.ones(4, device="cuda")
    rows["identity Function fwd+bwd (autograd floor)"] = lambda: torch.autograd.grad(_Identity.apply(x), [x], g4)
    rows["autograd.Function.apply alone"] = lambda: _Identity.apply(x)

    class EmptyGrad(torch.autograd.Function):  # autograd with a [V, D] gradient and no kernel
        @staticmethod
        def forward(ctx, weight, indices):
            return weight.new_empty((*indices.shape, weight.shape[1]))

        @staticmethod
        def backward(ctx, g):
            return g.new_empty((v, d)), None

    rows["Function fwd+bwd, [V,D] new_empty grad"] = lambda: torch.autograd.grad(EmptyGrad.apply(w, idx), [w], go)

    def body(fn, *args):  # an op body with its launches direct, as the eager path runs it
        return lambda: call_direct(fn, *args)

    rows["_backward body (keys, sort, offsets, bwd)"] = body(emb._backward, go, idx, v, -1, False, target)
    rows["_sorted_runs (keys, sort, offsets)"] = body(emb._sorted_runs, idx, v, target)
    rows["_forward body"] = body(emb._forward, w.detach(), idx, target)
    keys = idx.to(torch.int16)
    rows["torch.sort int16 stable"] = lambda: torch.sort(keys, stable=True)
    rows["new_empty [V, D]"] = lambda: go.new_empty((v, d))
    rows["call_direct of a no-op (set_wrap_triton_enabled)"] = body(lambda: None)
    rows["target_for"] = lambda: target_for(w.device)
    rows["check_args"] = lambda: emb.check_args(w, idx, None)

    # One launch of the backward kernel through each layer.
    keys_s, perm, offsets = body(emb._sorted_runs, idx, v, target)()
    gw = go.new_empty((v, d))
    plan = emb.make_plan(target, v, d, 2, backward=True, tokens=tokens)
    tensors = (go, keys_s, perm, offsets, gw)
    scalars = (v, d, tokens, go.stride(0), go.stride(1), -1, plan.zeros_per_run(v, tokens))
    meta = dict(SCALE=False, BLOCK_R=plan.block_rows, BLOCK_D=plan.block_d, EVICT=plan.evict, num_warps=plan.num_warps,
                **({"maxnreg": plan.max_registers} if plan.max_registers else {}))
    rows["fusedops.launch (cached)"] = body(launch, embedding_bwd_kernel, (plan.grid,), tensors, scalars, meta)
    compiled = embedding_bwd_kernel[(plan.grid,)](*tensors, *scalars, **meta)
    torch.cuda.synchronize()
    constexprs = tuple(meta[n] for n in embedding_bwd_kernel.arg_names[len(tensors) + len(scalars):])
    runner = compiled[(plan.grid, 1, 1)]
    rows["Triton runner"] = lambda: runner(*tensors, *scalars, *constexprs)
    rows["JITFunction kernel[grid](...)"] = lambda: embedding_bwd_kernel[(plan.grid,)](*tensors, *scalars, **meta)
    stream = torch.cuda.current_stream().cuda_stream
    rows["_cuda_getCurrentRawStream"] = lambda: torch._C._cuda_getCurrentRawStream(0)
    try:
        run = compiled.run
        lean_args = (*tensors, *scalars, *constexprs)
        if hasattr(run, "arg_annotations"):  # Triton 3.7: one generic C launcher
            def lean():
                run.launch(plan.grid, 1, 1, stream, compiled.function, run.launch_cooperative_grid, run.launch_pdl,
                           compiled.packed_metadata, None, None, None, None, None, run.arg_annotations,
                           run.kernel_signature, lean_args)
        else:  # Triton 3.6: a C launcher compiled per signature
            def lean():
                run.launch(plan.grid, 1, 1, stream, compiled.function, run.launch_cooperative_grid, run.launch_pdl,
                           None, None, compiled.packed_metadata, None, None, None, *lean_args)
        print(inspect.getsource(compiled.__getitem__))
        ref = gw.clone()
        gw.fill_(7)
        lean()
        print("lean launch equal to the runner's:", torch.equal(gw, ref))
        rows["Triton C launcher (no hooks, no metadata)"] = lean
    except Exception as e:  # noqa: BLE001
        print("lean launch unavailable:", type(e).__name__, e)
        print(inspect.getsource(type(compiled.run)))
    print(f"launch cache entries: {len(_CACHE)}")

    rows["fusedops fwd+bwd (again, last in the turn)"] = rows["fusedops fwd+bwd"]
    best = {name: float("inf") for name in rows}
    for _ in range(ROUNDS):  # rows in turn, so the host's drift during the run touches them alike
        for name, fn in rows.items():
            try:
                best[name] = min(best[name], host_ms(fn, REPS) * 1e3)
            except Exception as e:  # noqa: BLE001
                best[name] = f"error {type(e).__name__}: {str(e)[:160]}"
    for name, us in best.items():
        print(f"{name:46s} {us:9.1f} us" if isinstance(us, float) else f"{name:46s} {us}", flush=True)


def instrumented(v: int = 32768, d: int = 768, tokens: int = 4096, steps: int = 100) -> None:
    """Host time inside each layer of fusedops' backward, timed where it runs (autograd's device
    thread), next to the step's: per step, mean of `steps` steps."""
    from fusedops.embedding import op as emb

    w, idx, go = _inputs(v, d, tokens)
    spent: dict[str, float] = {}

    def timed(name, fn):
        def call(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t
        return call

    patches = {"launch": emb.launch, "_sorted_runs": emb._sorted_runs, "_backward": emb._backward,
               "_run_backward": emb._run_backward, "check_backward_args": emb.check_backward_args,
               "backward_direct_ok": emb.backward_direct_ok, "make_plan": emb.make_plan}
    rule = emb._Direct.backward
    try:
        for name, fn in patches.items():
            setattr(emb, name, timed(name, fn))
        emb._Direct.backward = staticmethod(timed("backward rule (whole)", rule))
        sort = torch.sort
        torch.sort = timed("torch.sort", sort)
        for _ in range(10):
            _fused_step(w, idx, go)
        torch.cuda.synchronize()
        spent.clear()
        t = time.perf_counter()
        for _ in range(steps):
            _fused_step(w, idx, go)
        total = time.perf_counter() - t
        torch.cuda.synchronize()
    finally:
        torch.sort = sort
        emb._Direct.backward = staticmethod(rule)
        for name, fn in patches.items():
            setattr(emb, name, fn)
    print(f"instrumented step (V={v} D={d} tokens={tokens}): {total / steps * 1e6:.1f} us a step (wall, no sync)")
    for name, s in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"  {name:28s} {s / steps * 1e6:8.1f} us a step")
    timeline(w, idx, go, steps)


def timeline(w, idx, go, steps: int) -> None:
    """Mean gaps between the moments of a fwd+bwd step: the forward's call and return, the backward
    rule's entry and exit (on autograd's device thread), autograd.grad's return, the step's end (its
    tensors freed)."""
    from fusedops.embedding import op as emb

    stamps: list[dict] = []
    rule = emb._Direct.backward

    def stamped_rule(ctx, grad_out):
        stamps[-1]["bwd in"] = time.perf_counter()
        try:
            return rule(ctx, grad_out)
        finally:
            stamps[-1]["bwd out"] = time.perf_counter()

    def step():
        st = {"start": time.perf_counter()}
        stamps.append(st)
        out = fusedops.embedding(idx, w)
        st["fwd out"] = time.perf_counter()
        grads = torch.autograd.grad(out, [w], go)
        st["grad out"] = time.perf_counter()
        del out, grads
        st["end"] = time.perf_counter()

    emb._Direct.backward = staticmethod(stamped_rule)
    try:
        for _ in range(10):
            step()
        torch.cuda.synchronize()
        stamps.clear()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    finally:
        emb._Direct.backward = staticmethod(rule)
    names = ["start", "fwd out", "bwd in", "bwd out", "grad out", "end"]
    gaps = {f"{a} -> {b}": sum(st[b] - st[a] for st in stamps) / len(stamps) * 1e6 for a, b in zip(names, names[1:])}
    gaps["end -> next start"] = sum(b["start"] - a["end"] for a, b in zip(stamps, stamps[1:])) / (len(stamps) - 1) * 1e6
    print("step timeline (mean us): " + ", ".join(f"{k} {v:.1f}" for k, v in gaps.items()))


def sync_check(v: int = 151936, d: int = 4096, tokens: int = 16384) -> None:
    """Whether a call waits for the GPU: its host time right after a ~1 ms torch.cuda._sleep is queued
    (a call that syncs takes the sleep's remainder)."""
    from fusedops.embedding import op as emb
    from fusedops.targets import target_for

    w, idx, go = _inputs(v, d, tokens)
    target = target_for(idx.device)
    k16, k32 = idx.to(torch.int16), idx.to(torch.int32)
    calls = {
        "torch.sort int16 stable": lambda: torch.sort(k16, stable=True),
        "torch.sort int32 stable": lambda: torch.sort(k32, stable=True),
        "_sorted_runs": lambda: call_direct(emb._sorted_runs, idx, v, target),
        "_backward body": lambda: call_direct(emb._backward, go, idx, v, -1, False, target),
        "fusedops fwd": lambda: fusedops.embedding(idx, w),
        "fusedops fwd+bwd": lambda: _fused_step(w, idx, go),
        "torch fwd+bwd": lambda: torch.autograd.grad(F.embedding(idx, w), [w], go),
    }
    for name, fn in calls.items():
        fn()
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000)  # cycles: ~1-1.3 ms of GPU time at 1.5-2 GHz
        t = time.perf_counter()
        fn()
        host = (time.perf_counter() - t) * 1e6
        torch.cuda.synchronize()
        print(f"sync check {name:28s} host {host:8.1f} us behind a queued GPU sleep")


if __name__ == "__main__":
    sync_check()
    main()
    instrumented()
