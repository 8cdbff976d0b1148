"""The eager direct path (registry.direct_call_ok / FusedOp) and the launch cache
(fusedops.launch): they must give exactly what torch.ops gives, and step aside whenever PyTorch is
tracing, faking, transforming or holding a tensor subclass."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fusedops
from fusedops import internals
from fusedops import launch as launch_mod
from fusedops.registry import direct_call_ok

from .helpers import KERNEL_PATHS, PATHS, execution_path, gpu


def _attn_res(direct: bool, device: str = "cpu"):
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(5, 3, 7, 40, generator=gen).to(device).requires_grad_()
    query = (0.3 * torch.randn(40, generator=gen)).to(device).requires_grad_()
    weight = (torch.rand(40, generator=gen) + 0.5).to(device).requires_grad_()
    if direct:
        out, lse = fusedops.attn_res(values, query, weight, return_lse=True)
    else:
        out, lse = torch.ops.fusedops.attn_res_with_lse(values, query, weight, 1e-6)
    return out + lse.unsqueeze(-1), (values, query, weight)


def _embedding(direct: bool, device: str = "cpu"):
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(50, 24, generator=gen).to(device).requires_grad_()
    indices = torch.randint(0, 50, (6, 9), generator=gen).to(device)
    out = (fusedops.embedding(indices, weight, padding_idx=3) if direct
           else torch.ops.fusedops.embedding(weight, indices, 3, False))
    return out, (weight,)


def _neighborhood_attention(direct: bool, device: str = "cpu"):
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 9, 11, 16, generator=gen).to(device).requires_grad_() for _ in range(3))
    if direct:
        out, lse = fusedops.neighborhood_attention(q, k, v, (3, 5), is_causal=(False, True), return_lse=True)
    else:
        out, lse = torch.ops.fusedops.neighborhood_attention(q, k, v, [3, 5], [1, 1], [1, 1], [False, True], None,
                                                           "shifted")
    return out + lse.unsqueeze(-1), (q, k, v)


def _attn_res_multi(direct: bool, device: str = "cpu"):
    gen = torch.Generator().manual_seed(5)
    values = torch.randn(4, 3, 5, 40, generator=gen).to(device).requires_grad_()
    queries = (0.3 * torch.randn(3, 40, generator=gen)).to(device).requires_grad_()
    if direct:
        out, lse = fusedops.attn_res_multi(values, queries)
    else:
        out, lse = torch.ops.fusedops.attn_res_multi(values, queries, 1e-6)
    return out + lse.unsqueeze(-1), (values, queries)


def _attn_res_merge(direct: bool, device: str = "cpu"):
    gen = torch.Generator().manual_seed(6)
    out, partial, addend = (torch.randn(3, 7, 40, generator=gen).to(device).requires_grad_() for _ in range(3))
    lse = torch.randn(3, 7, generator=gen).to(device).requires_grad_()
    query = (0.3 * torch.randn(40, generator=gen)).to(device).requires_grad_()
    gain = (torch.rand(40, generator=gen) + 0.5).to(device).requires_grad_()
    if direct:
        h, p = fusedops.attn_res_merge(out, lse, partial, query, addends=addend, gain=gain)
    else:
        h, p = torch.ops.fusedops.attn_res_merge(out, lse, partial, query, addend, None, gain, 1e-6, 1e-6)
    return h + p, (out, lse, partial, addend, query, gain)


OPS = {"attn_res": _attn_res, "attn_res_merge": _attn_res_merge, "attn_res_multi": _attn_res_multi,
       "embedding": _embedding, "neighborhood_attention": _neighborhood_attention}


def _outputs_and_grads(build, direct: bool, device: str = "cpu"):
    out, inputs = build(direct, device)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(device)
    return out.detach(), torch.autograd.grad(out, inputs, grad_out)


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("op", ["attn_res", "neighborhood_attention"])
def test_double_backward_raises_where_unsupported(op, direct):
    """attn_res and neighborhood attention have first derivatives only: a backward through their
    gradients must raise, never return a silently wrong second derivative (embedding's double backward
    is tested against float64 autograd in test_embedding)."""
    out, inputs = OPS[op](direct)
    grads = torch.autograd.grad((out * out).sum(), inputs, create_graph=True)
    with pytest.raises(RuntimeError, match="backward"):
        sum((g * g).sum() for g in grads).backward()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("op", sorted(OPS))
def test_direct_path_matches_torch_ops_bitwise(path, op):
    with execution_path(path):
        direct = _outputs_and_grads(OPS[op], True)
        via_ops = _outputs_and_grads(OPS[op], False)
    assert torch.equal(direct[0], via_ops[0])
    for a, b in zip(direct[1], via_ops[1]):
        assert torch.equal(a, b)


def test_every_op_is_one_declaration_and_calls_go_through_it():
    """Each registered op is a FusedOp (registry.fused_op: body, fake, autograd and eager routing in one
    declaration), an op with a gradient has its direct autograd.Function, and no op module calls torch.ops
    itself (the FusedOp picks the direct path or the dispatcher)."""
    import pathlib

    from fusedops import registry

    differentiable = {"attn_res", "attn_res_with_lse", "attn_res_multi", "attn_res_merge", "embedding",
                      "embedding_backward", "neighborhood_attention"}
    for name in registry.op_names():
        op = registry._IMPLS[name]
        assert isinstance(op, registry.FusedOp) and op.overload is getattr(torch.ops.fusedops, name).default
        assert (op._function is not None) == (name in differentiable), name
    package = pathlib.Path(fusedops.__file__).parent
    for path in package.glob("*/*.py"):
        if path.parent.name != "bench":
            assert "torch.ops.fusedops" not in path.read_text(), path


def test_direct_call_ok_only_for_plain_eager_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.func import vmap

    x = torch.ones(2, 3)
    assert direct_call_ok(x, None, torch.nn.Parameter(x))

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Seen():
        assert not direct_call_ok(x)
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(x)
    assert not direct_call_ok(fake)
    results = []
    vmap(lambda row: (results.append(direct_call_ok(row)), row)[1])(x)
    assert results == [False]

    class Sub(torch.Tensor):
        pass

    assert not direct_call_ok(x.as_subclass(Sub))


@pytest.mark.parametrize("direct", [True, False], ids=["wrapper", "torch.ops"])
@pytest.mark.parametrize("op", sorted(OPS))
def test_meta_tensors_give_shapes_and_dtypes(op, direct):
    """On the meta device (models built with torch.device("meta"), shape inference) forward and backward
    run without data and give what CPU tensors give, shape and dtype."""
    cpu = _outputs_and_grads(OPS[op], direct, "cpu")
    meta = _outputs_and_grads(OPS[op], direct, "meta")
    for a, b in zip((cpu[0], *cpu[1]), (meta[0], *meta[1])):
        assert b.device.type == "meta" and (b.shape, b.dtype) == (a.shape, a.dtype)


@pytest.mark.parametrize("path", PATHS)
def test_activation_checkpointing_gives_the_same_gradients(path):
    """torch.utils.checkpoint reruns the forward during backward; deterministic kernels make the
    gradients bitwise equal to the plain step's."""
    from torch.utils.checkpoint import checkpoint

    gen = torch.Generator().manual_seed(5)
    values, query = torch.randn(4, 2, 6, 24, generator=gen), torch.randn(24, generator=gen)
    weight, idx = torch.randn(30, 24, generator=gen), torch.randint(0, 30, (2, 6), generator=gen)
    x = torch.randn(2, 3, 6, 24, generator=gen)
    leaves = [t.requires_grad_() for t in (values, query, weight, x)]

    def block(values, query, weight, x):
        h = fusedops.attn_res(values, query) * fusedops.embedding(idx, weight, padding_idx=2)
        return fusedops.neighborhood_attention(x + h[:, None], x, x, 3).square().sum()

    with execution_path(path):
        plain = torch.autograd.grad(block(*leaves), leaves)
        again = torch.autograd.grad(checkpoint(block, *leaves, use_reentrant=False), leaves)
    for a, b in zip(again, plain):
        assert torch.equal(a, b)


def test_double_backward_is_refused_not_silently_zero():
    out, (values, query, weight) = _attn_res(True)
    (grad_values,) = torch.autograd.grad(out.sum(), (values,), create_graph=True)
    with pytest.raises(RuntimeError, match="attn_res_backward"):
        torch.autograd.grad(grad_values.sum(), (query,))


@pytest.mark.parametrize("op", sorted(OPS))
def test_ops_under_a_dispatch_mode_go_through_the_dispatcher(op):
    seen = set()

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.add(str(func))
            return func(*args, **(kwargs or {}))

    with Record():
        out, inputs = OPS[op](True)
        torch.autograd.grad(out.sum(), inputs)
    forward = "attn_res_with_lse" if op == "attn_res" else op  # what fusedops.attn_res runs
    assert any(name.startswith(f"fusedops.{forward}.") for name in seen), sorted(seen)
    assert any(name.startswith(f"fusedops.{op}_backward.") for name in seen), sorted(seen)


# ---- the launch cache (CUDA only: elsewhere every launch goes through wrap_triton) ----

@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("op", sorted(OPS))
def test_gpu_cached_launches_match_first_launch_bitwise(op):
    launch_mod._CACHE.clear()
    first = _outputs_and_grads(OPS[op], True, "cuda")  # compiles through kernel[grid], fills the cache
    assert launch_mod._CACHE, "no launch was cached"
    again = _outputs_and_grads(OPS[op], True, "cuda")  # every launch from the cache
    assert torch.equal(first[0], again[0])
    for a, b in zip(first[1], again[1]):
        assert torch.equal(a, b)


@gpu
@pytest.mark.gpu
def test_gpu_launch_cache_keys_on_alignment():
    # a view starting 2 elements in is not 16-byte aligned: Triton specialises on that, so must the cache
    base = torch.randn(64 * 64 + 2, device="cuda")
    weight_aligned = base[:4096].view(64, 64)
    weight_shifted = base[2:4098].view(64, 64)
    indices = torch.randint(0, 64, (100,), device="cuda")
    for weight in (weight_aligned, weight_shifted, weight_aligned, weight_shifted):
        assert torch.equal(fusedops.embedding(indices, weight), weight[indices])


def test_launches_switch_to_the_tensors_device(monkeypatch):
    """Triton launches on the current device: a launch whose tensors live on another device of the
    same kind makes theirs current for the launch (a stand-in device module on CPU here; the real
    thing in test_gpu_ops_on_a_device_that_is_not_current)."""
    entered = []

    class FakeCuda:
        @staticmethod
        def current_device():
            return 0

        @staticmethod
        def device(index):
            entered.append(index)
            return contextlib.nullcontext()

    class FakeTensor:
        def __init__(self, device):
            self.device = torch.device(device)

    monkeypatch.setattr(torch, "cuda", FakeCuda)
    for device, expected in (("cuda:1", [1]), ("cuda:0", []), ("cpu", []), ("cuda", [])):
        entered.clear()
        with launch_mod.device_switch(FakeTensor(device)):
            pass
        assert entered == expected, device


class _StandInKernel:
    """A JITFunction stand-in: kernel[grid](...) "compiles" (records the call) and returns a compiled
    kernel whose launcher and runner record theirs."""

    arg_names = ["x_ptr", "out_ptr", "n", "BLOCK"]

    def __init__(self):
        self.compiles, self.launches, self.runs = [], [], []

    def __getitem__(self, grid):
        def compile_and_launch(*args, **meta):
            self.compiles.append((grid, args, meta))
            kernel = self

            class Compiled:
                function, packed_metadata = "function-handle", ("warps", "ctas", "smem")

                def run(self, *args):
                    kernel.launches.append(args)

                def __getitem__(self, grid3):
                    return lambda *args: kernel.runs.append((grid3, args))

            return Compiled()

        return compile_and_launch


class _StandInTensor:
    is_cuda, device = True, torch.device("cpu")  # a CPU device: no device switch to make

    def __init__(self, address, dtype=torch.float32):
        self.address, self.dtype = address, dtype

    def get_device(self):
        return 0

    def data_ptr(self):
        return self.address


FAST_PATH_OFF = """
import torch, fusedops
from fusedops import internals, registry
off = internals.fast_path()
assert off == {"direct calls": "FUSEDOPS_FAST_PATH=0", "cached launches": "FUSEDOPS_FAST_PATH=0"}, off
values, query = torch.randn(3, 4, 6, requires_grad=True), torch.randn(6, requires_grad=True)
assert not registry.direct_call_ok(values, query)
from fusedops.attn_res.op import attn_res_with_lse_op
calls, dispatched = [], attn_res_with_lse_op.overload
attn_res_with_lse_op.overload = lambda *args: calls.append(1) or dispatched(*args)
fusedops.attn_res(values, query).sum().backward()
assert calls == [1], calls  # through the dispatcher (the direct path never calls torch.ops)
weight = torch.randn(10, 3, requires_grad=True)
fusedops.embedding(torch.tensor([1, 2, 2]), weight).sum().backward()
assert values.grad is not None and weight.grad[2].eq(2).all()
print("ok")
"""


def test_fast_path_switch_and_probe(monkeypatch):
    """FUSEDOPS_FAST_PATH=0 turns the direct calls and the cached launches off (fusedops.internals.fast_path()
    says why) and every op still runs, through torch.ops; another value is refused at import; an internal that
    a part needs and cannot find turns that part off, naming it."""
    env = dict(os.environ, FUSEDOPS_FAST_PATH="0")
    if env.get("TRITON_INTERPRET") == "1":
        env["FUSEDOPS_INTERPRET"] = "cuda"  # the kernels, launched through torch.ops
    done = subprocess.run([sys.executable, "-c", FAST_PATH_OFF], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]
    env["FUSEDOPS_FAST_PATH"] = "maybe"
    done = subprocess.run([sys.executable, "-c", "import fusedops"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode != 0 and "FUSEDOPS_FAST_PATH must be 0 or 1" in done.stderr
    monkeypatch.delenv("FUSEDOPS_FAST_PATH", raising=False)
    assert internals._probe("a part", ("torch.cat",))
    assert not internals._probe("a part", ("torch._C._no_such_internal", "torch.cat"))
    assert internals._REASONS["a part"] == "not found: torch._C._no_such_internal"


def test_launch_cache_hands_pointers_and_options_to_the_compiled_launcher(monkeypatch):
    """The CUDA launch cache (stand-ins for Triton and the device here; the real launches are checked
    bitwise in test_gpu_cached_launches_match_first_launch_bitwise): the first launch compiles through
    kernel[grid]; later ones call the compiled launcher with what Triton's runner passes (grid, the
    current stream, the function handle, the packed metadata, no launch metadata or hooks, then every
    parameter, constexprs included, pointers as integers); a new alignment or scalar compiles again;
    while a launch hook is set, launches go through the runner so the hook sees them."""
    if internals._knobs is None:
        pytest.skip("this Triton has no knobs module: launches go through the runner")
    monkeypatch.setattr(internals, "CACHED_LAUNCHES", True)  # a CPU torch has no CUDA stream functions
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(launch_mod, "_CACHE", {})
    kernel = _StandInKernel()
    x, out = _StandInTensor(4096), _StandInTensor(8192)
    launch_mod._launch_cuda(kernel, (3,), (x, out), (10,), {"BLOCK": 64, "num_warps": 4})
    assert len(kernel.compiles) == 1 and not kernel.launches
    launch_mod._launch_cuda(kernel, (3,), (x, out), (10,), {"BLOCK": 64, "num_warps": 4})
    assert len(kernel.compiles) == 1
    assert kernel.launches == [(3, 1, 1, 1234, "function-handle", ("warps", "ctas", "smem"), None, None, None,
                                4096, 8192, 10, 64)]
    launch_mod._launch_cuda(kernel, (3,), (_StandInTensor(4098), out), (10,), {"BLOCK": 64, "num_warps": 4})
    launch_mod._launch_cuda(kernel, (3,), (x, out), (11,), {"BLOCK": 64, "num_warps": 4})
    launch_mod._launch_cuda(kernel, (3,), (x, out), (10,), {"BLOCK": 32, "num_warps": 4})
    launch_mod._launch_cuda(kernel, (3,), (x, _StandInTensor(8192, torch.float16)), (10,), {"BLOCK": 64, "num_warps": 4})
    assert len(kernel.compiles) == 5 and len(kernel.launches) == 1
    hook = lambda metadata: None  # noqa: E731
    internals._knobs.runtime.launch_enter_hook.add(hook)
    try:
        launch_mod._launch_cuda(kernel, (3,), (x, out), (10,), {"BLOCK": 64, "num_warps": 4})
    finally:
        internals._knobs.runtime.launch_enter_hook.remove(hook)
    assert kernel.runs == [((3, 1, 1), (4096, 8192, 10, 64))] and len(kernel.launches) == 1


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("op", sorted(OPS))
def test_gpu_ops_on_a_device_that_is_not_current(op):
    """Inputs on cuda:1 while cuda:0 is current (a model spread over GPUs): the same bits as on cuda:0."""
    with torch.cuda.device(0):
        ref = _outputs_and_grads(OPS[op], True, "cuda:0")
        got = _outputs_and_grads(OPS[op], True, "cuda:1")
    assert got[0].device == torch.device("cuda:1")
    assert torch.equal(ref[0], got[0].to("cuda:0"))
    for a, b in zip(ref[1], got[1]):
        assert torch.equal(a, b.to("cuda:0"))


def _neighborhood_attention_1d(direct: bool, device: str = "cpu"):
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 37, 16, generator=gen).to(device).requires_grad_()
    k, v = (torch.randn(2, 2, 37, 16, generator=gen).to(device).requires_grad_() for _ in range(2))
    out = fusedops.neighborhood_attention(q, k, v, 7, dilation=2, stride=2)
    return out, (q, k, v)


@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("op", sorted(OPS) + ["neighborhood_attention_1d"])
def test_plans_from_any_size_hint_stay_correct(path, op, monkeypatch):
    """A graph compiled with dynamic shapes keeps the tiles its first sizes chose (targets.size_hint) and
    runs them on every later size. Plans made from a hint of 1 or of 10**6 instead of the real sizes must
    therefore still give the reference's outputs and gradients: tiles and grids cover any size."""
    from fusedops.attn_res import plan as ar_plan
    from fusedops.embedding import plan as em_plan
    from fusedops.neighborhood_attention import op as na_op

    build = {**OPS, "neighborhood_attention_1d": _neighborhood_attention_1d}[op]
    caches = (ar_plan.make_plan, ar_plan.reduce_plan, em_plan.make_plan, na_op._forward_spec, na_op._backward_spec)
    with execution_path("reference"):
        ref = _outputs_and_grads(build, True)
    try:
        for hint in (1, 10**6):
            for module in (ar_plan, em_plan, na_op):
                monkeypatch.setattr(module, "size_hint", lambda n, fallback=4096, hint=hint: hint)
            for cache in caches:
                cache.cache_clear()
            with execution_path(path):
                got = _outputs_and_grads(build, True)
            for a, b in zip((ref[0], *ref[1]), (got[0], *got[1])):
                torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    finally:
        for cache in caches:
            cache.cache_clear()


# ----- symbolic sizes: what Inductor traces under torch.compile(dynamic=True) ---------------------------


def _bodies():
    """Each op body on the H100 plan, with inputs whose dims are all traced as symbols: (name, fn, inputs,
    the (input, dim) pairs a plan may specialise on: feature and head dims, model constants)."""
    from fusedops.attn_res import op as ar
    from fusedops.block_attn_res import op as br
    from fusedops.embedding import op as em
    from fusedops.neighborhood_attention import op as na

    from .compile_sm90 import H100

    bf16 = torch.bfloat16
    v, q, w = torch.randn(4, 2, 64, 256, dtype=bf16), torch.randn(256), torch.rand(256)
    out, lse, go = torch.randn(2, 64, 256, dtype=bf16), torch.randn(2, 64), torch.randn(2, 64, 256, dtype=bf16)
    weight, idx = torch.randn(5000, 96), torch.randint(0, 5000, (4, 100))
    qkv = [torch.randn(2, 4, 100, 64, dtype=bf16) for _ in range(4)]
    qkv2 = [torch.randn(2, 4, 12, 16, 32, dtype=bf16) for _ in range(3)]
    na_args = ((7,), (2,), (1,), (False,), 0.125, "shifted", (0,), H100)
    return [
        ("attn_res", lambda v, q, w: ar._forward(v, q, w, 1e-6, H100), (v, q, w), {(0, 3), (1, 0), (2, 0)}),
        ("attn_res_backward", lambda go, v, q, w, o, l: ar._backward(go, v, q, w, 1e-6, True, True, True, H100, o, l),
         (go, v, q, w, out, lse), {(0, 2), (1, 3), (2, 0), (3, 0), (4, 2)}),
        ("embedding", lambda w, i: em._forward(w, i, H100), (weight, idx), {(0, 1)}),
        ("embedding_backward", lambda g, i: em._backward(g, i, 5000, -1, False, H100),
         (torch.randn(4, 100, 96), idx), {(0, 2)}),
        ("neighborhood_attention 1d", lambda q, k, v: na._forward(q, k, v, *na_args), tuple(qkv[:3]),
         {(0, 3), (1, 3), (2, 3)}),
        ("neighborhood_attention 2d", lambda q, k, v: na._forward(q, k, v, (5, 7), (1, 1), (1, 1), (False, False),
                                                                   0.125, "shifted", (0, 0), H100), tuple(qkv2),
         {(0, 4), (1, 4), (2, 4)}),
        ("neighborhood_attention_backward", lambda g, q, k, v, o, l: na._backward(g, None, q, k, v, o, l, *na_args),
         (qkv[3], *qkv[:3], qkv[3], torch.randn(2, 4, 100)), {(0, 3), (1, 3), (2, 3), (3, 3), (4, 3)}),
        # the queries (M pseudo-queries of a block) are a model constant; the depth N is not
        ("attn_res_multi", lambda v, qs: br._multi_forward(v, qs, 1e-6, H100), (v, torch.randn(6, 256)),
         {(0, 3), (1, 0), (1, 1)}),
        ("attn_res_merge", lambda o, l, p, a, q, g: br._merge_forward(o, l, p, q, a, None, g, 1e-6, 1e-6, H100),
         (out, lse, go, out.clone(), q, w), {(0, 2), (2, 2), (3, 2), (4, 0), (5, 0)}),
    ]


def _specialised_sizes() -> dict:
    """{op body: the Eq guards its trace put on a data size}. Run without TRITON_INTERPRET: a kernel
    traced under the interpreter is launched on the fake tensors."""
    from torch.fx.experimental.proxy_tensor import make_fx

    report = {}
    for name, fn, inputs, allowed in _bodies():
        graph = make_fx(fn, tracing_mode="symbolic")(*inputs)
        placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
        env = placeholders[0].meta["val"].fake_mode.shape_env
        free = set()
        for i, node in enumerate(placeholders):
            for d, size in enumerate(node.meta["val"].shape):
                if (i, d) not in allowed and isinstance(size, torch.SymInt):
                    free |= size.node.expr.free_symbols
        launches = sum("triton_kernel_wrapper" in str(n.target) for n in graph.graph.nodes)
        fixed = [str(g.expr) for g in env.guards if g.expr.func.__name__ == "Equality" and g.expr.free_symbols & free]
        report[name] = {"launches": launches, "fixed": fixed}
    return report


def test_plans_do_not_specialise_on_token_or_spatial_sizes():
    """Traced with symbolic sizes (as Inductor traces a triton_op's body under dynamic shapes), the plans
    may fix feature/head dims, but never batch, depth, token or spatial sizes: tile shapes come from
    size hints and grids stay symbolic, so a compiled graph is not recompiled per sequence length."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FUSEDOPS_INTERPRET")}
    code = "import json; from fusedops_tests.test_dispatch import _specialised_sizes as f; print(json.dumps(f()))"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(report) == 9
    for name, entry in report.items():
        assert entry["launches"] >= 1, f"{name}: no kernel in the trace"
        assert not entry["fixed"], f"{name}: a plan specialised a data size: {entry['fixed']}"
