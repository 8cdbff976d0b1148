"""Adversarial inputs to attn_res and neighborhood attention (issue 34, input hardening): every tensor argument
of every op checked in its body and its fake kernel, float arguments held to the float32 range the kernels
compute in, flags and module sizes of the wrong type, calls from several threads, errors inside
torch.compile, and the truncated window wider than its axis (Liger's semantics)."""

from __future__ import annotations

import re
import threading
from types import SimpleNamespace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import fusedops
from fusedops import launch as launch_module
from fusedops.neighborhood_attention import op as na_op
from fusedops.neighborhood_attention.op import MAX_SCALE
from fusedops.validation import FP32, check_fp32_normal

from .helpers import KERNEL_PATHS, PATHS, execution_path, gpu, opaque_triton_ops, recorded_launches
from .test_neighborhood_attention import check_case

# ---- every tensor argument of every op: device, dtype, shape, in the body and in the fake kernel ---------------


def _attn_res_args():
    gen = torch.Generator().manual_seed(0)
    values, query, weight = torch.randn(3, 2, 8, generator=gen), torch.randn(8, generator=gen), torch.rand(8)
    out, lse = torch.ops.fusedops.attn_res_with_lse(values, query, weight, 1e-6)
    return dict(grad_out=torch.randn(2, 8, generator=gen), values=values, query=query, norm_weight=weight, eps=1e-6,
                need_values=True, need_query=True, need_norm_weight=True, out=out, lse=lse,
                grad_lse=torch.randn(2, generator=gen))


def _na_args():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=gen) for _ in range(3))
    out, lse = torch.ops.fusedops.neighborhood_attention(q, k, v, [3], [1], [1], [False], None, "shifted")
    return dict(grad_out=torch.randn_like(out), grad_lse=torch.randn_like(lse), q=q, k=k, v=v, out=out, lse=lse,
                kernel_size=[3], dilation=[1], stride=[1], is_causal=[False], scale=None, window="shifted")


AR_FORWARD = ("values", "query", "norm_weight", "eps")
NA_FORWARD = ("q", "k", "v", "kernel_size", "dilation", "stride", "is_causal", "scale", "window")
OPS = {  # op: (arguments, the forward's subset of them or None for a backward op)
    "attn_res": (_attn_res_args, AR_FORWARD),
    "attn_res_with_lse": (_attn_res_args, AR_FORWARD),
    "attn_res_backward": (_attn_res_args, None),
    "neighborhood_attention": (_na_args, NA_FORWARD),
    "neighborhood_attention_backward": (_na_args, None),
}
# (op, argument, how to spoil it): the tensor arguments of every op, on the wrong device, of the wrong dtype
# or of the wrong shape.
BAD_TENSORS = [
    ("attn_res", "values", lambda t: t.to(torch.int32)),
    ("attn_res", "query", lambda t: t.to("meta")),
    ("attn_res", "norm_weight", lambda t: t[:5]),
    ("attn_res_with_lse", "values", lambda t: t.bool()),
    ("attn_res_with_lse", "norm_weight", lambda t: t.to("meta")),
    ("attn_res_backward", "grad_out", lambda t: t.bool()),
    ("attn_res_backward", "grad_out", lambda t: t.half()),
    ("attn_res_backward", "grad_out", lambda t: t.to("meta")),
    ("attn_res_backward", "grad_out", lambda t: t[:1]),
    ("attn_res_backward", "out", lambda t: t.to("meta")),
    ("attn_res_backward", "out", lambda t: t.bool()),
    ("attn_res_backward", "lse", lambda t: t.long()),
    ("attn_res_backward", "lse", lambda t: t.to("meta")),
    ("attn_res_backward", "grad_lse", lambda t: t.double()),
    ("attn_res_backward", "grad_lse", lambda t: t[:1]),
    ("attn_res_backward", "values", lambda t: t.to("meta")),
    ("attn_res_backward", "query", lambda t: t.to(torch.int64)),
    ("neighborhood_attention", "q", lambda t: t.double()),
    ("neighborhood_attention", "k", lambda t: t.to("meta")),
    ("neighborhood_attention", "v", lambda t: t[:, :1, :4]),
    ("neighborhood_attention_backward", "grad_out", lambda t: t.to("meta")),
    ("neighborhood_attention_backward", "grad_out", lambda t: t.bool()),
    ("neighborhood_attention_backward", "grad_out", lambda t: t.half()),
    ("neighborhood_attention_backward", "grad_out", lambda t: t[..., :4]),
    ("neighborhood_attention_backward", "out", lambda t: t.to("meta")),
    ("neighborhood_attention_backward", "out", lambda t: t.bfloat16()),
    ("neighborhood_attention_backward", "out", lambda t: t[:, :1]),
    ("neighborhood_attention_backward", "lse", lambda t: t.long()),
    ("neighborhood_attention_backward", "lse", lambda t: t.to("meta")),
    ("neighborhood_attention_backward", "lse", lambda t: t[..., :3]),
    ("neighborhood_attention_backward", "grad_lse", lambda t: t.half()),
    ("neighborhood_attention_backward", "grad_lse", lambda t: t.to("meta")),
    ("neighborhood_attention_backward", "grad_lse", lambda t: t[None]),
    ("neighborhood_attention_backward", "q", lambda t: t.to("meta")),
    ("neighborhood_attention_backward", "v", lambda t: t.int()),
]
BAD_TENSOR_IDS = [f"{op}-{name}-{i}" for i, (op, name, _) in enumerate(BAD_TENSORS)]


def _spoiled(op: str, name: str, spoil) -> dict:
    make, forward = OPS[op]
    args = make()
    args[name] = spoil(args[name])
    return args if forward is None else {n: args[n] for n in forward}


def _fake(mode: FakeTensorMode, args: dict) -> dict:
    return {n: mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for n, a in args.items()}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("op, name, spoil", BAD_TENSORS, ids=BAD_TENSOR_IDS)
def test_op_body_checks_every_tensor_argument(path, op, name, spoil):
    """A bad tensor argument of any registered op raises ValueError naming it (the bug: a meta grad_out beside
    CPU q gave CPU garbage, a bool grad_out or an int64 lse was taken)."""
    with execution_path(path):
        args = _spoiled(op, name, spoil)
        with pytest.raises(ValueError, match=rf"\b{name}\b"):
            getattr(torch.ops.fusedops, op)(**args)


@pytest.mark.parametrize("op, name, spoil", BAD_TENSORS, ids=BAD_TENSOR_IDS)
def test_op_fake_kernel_checks_every_tensor_argument(op, name, spoil):
    """The same through the fake kernel (what torch.compile and export trace)."""
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    args = _fake(mode, _spoiled(op, name, spoil))
    with mode, pytest.raises(ValueError, match=rf"\b{name}\b"):
        getattr(torch.ops.fusedops, op)(**args)


def test_backward_reproduction_from_the_issue():
    q = k = v = torch.randn(1, 1, 6, 8)
    out, lse = fusedops.neighborhood_attention(q, k, v, 3, return_lse=True)
    with pytest.raises(ValueError, match="^grad_out is on meta but q is on cpu"):
        torch.ops.fusedops.neighborhood_attention_backward(torch.ones_like(out).to("meta"), None, q, k, v, out, lse,
                                                           [3], [1], [1], [False], None, "shifted")


# ---- float arguments in the float32 range the kernels compute in ---------------------------------------------

@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("eps", [1e-300, 1e-40, FP32.tiny / 2, 1e39, 1e300])
def test_eps_outside_float32_normals(path, eps):
    """eps=1e-300 is positive in float64 but 0 in the kernels' float32: a zero row then gave NaN."""
    values, query = torch.zeros(3, 2, 8), torch.randn(8)
    with execution_path(path):
        with pytest.raises(ValueError, match="^eps must be in"):
            fusedops.attn_res(values, query, None, eps)
        with pytest.raises(ValueError, match="^eps must be in"):
            torch.ops.fusedops.attn_res_backward(values[0], values, query, None, eps, True, True, False)
    with pytest.raises(ValueError, match="^eps must be in"):
        fusedops.nn.AttnRes(8, eps=eps)


@pytest.mark.parametrize("path", PATHS)
def test_smallest_eps_keeps_zero_rows_finite(path):
    """eps = the smallest normal float32: rstd of a zero row (2**63) and its square (2**126) stay finite, so
    outputs and every gradient do, on every path."""
    values = torch.zeros(3, 2, 8)
    values[1, 0] = torch.randn(8)
    values.requires_grad_()
    query, weight = torch.randn(8, requires_grad=True), torch.rand(8, requires_grad=True)
    with execution_path(path):
        out, lse = fusedops.attn_res(values, query, weight, FP32.tiny, return_lse=True)
        grads = torch.autograd.grad((out.sum() + lse.sum()), (values, query, weight))
    for t in (out, lse, *grads):
        assert torch.isfinite(t).all()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("scale", [3e38, 1e300, 1e20, 1e-300, 1e-40])
def test_scale_outside_float32_range(path, scale):
    """scale=3e38 or 1e300 passed check_positive_finite, then overflowed in float32 (NaN outputs)."""
    q = torch.randn(1, 2, 9, 8)
    with execution_path(path), pytest.raises(ValueError, match="^scale must be in"):
        fusedops.neighborhood_attention(q, q, q, 3, scale=scale)


@pytest.mark.parametrize("path", PATHS)
def test_largest_scale_gives_finite_results(path):
    q, k, v = (torch.randn(1, 1, 9, 8, generator=torch.Generator().manual_seed(i)) * 1e-10 for i in range(3))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with execution_path(path):
        out, lse = fusedops.neighborhood_attention(q, k, v, 3, scale=MAX_SCALE, return_lse=True)
        grads = torch.autograd.grad(out.sum() + lse.sum(), (q, k, v))
    for t in (out, lse, *grads):
        assert torch.isfinite(t).all()


def _symfloat(value: float) -> torch.SymFloat:
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    env = ShapeEnv()
    symbol = env.create_symbol(value, ConstantSource("x"), dynamic_dim=DimDynamic.DYNAMIC)
    return env.create_symfloatnode(symbol, hint=value)


def test_float32_range_check_takes_symbolic_floats():
    """A torch.SymFloat (dynamic-shape tracing) is compared, not converted: in range it passes, out of range
    it raises the same ValueError."""
    check_fp32_normal("eps", _symfloat(1e-6))
    with pytest.raises(ValueError, match="^eps must be in"):
        check_fp32_normal("eps", _symfloat(1e-300))


# ---- flags and module sizes ----------------------------------------------------------------------------------

@pytest.mark.parametrize("flag", ["no", 1, 0, None, torch.tensor(True)])
def test_return_lse_must_be_a_bool(flag):
    """return_lse="no" used to return a tuple."""
    values, query = torch.randn(3, 2, 8), torch.randn(8)
    q = torch.randn(1, 2, 9, 8)
    with pytest.raises(ValueError, match="^return_lse must be a bool"):
        fusedops.attn_res(values, query, return_lse=flag)
    with pytest.raises(ValueError, match="^return_lse must be a bool"):
        fusedops.neighborhood_attention(q, q, q, 3, return_lse=flag)


BAD_MODULE_SIZES = [
    (dict(dim=8.0), "dim"), (dict(dim="8"), "dim"), (dict(dim=-8), "dim"), (dict(dim=True), "dim"),
    (dict(dim=16.0, num_heads=2), "dim"), (dict(dim=-16, num_heads=-2), "dim"),
    (dict(dim=16, num_heads=2.0), "num_heads"),
    (dict(dim=16, num_heads="2"), "num_heads"), (dict(dim=16, num_heads=0), "num_heads"),
    (dict(dim=16, num_heads=-2), "num_heads"), (dict(dim=16, num_heads=2, kernel_size=3.0), "kernel_size"),
    (dict(dim=16, num_heads=2, kernel_size="3"), "kernel_size"), (dict(dim=16, num_heads=2, dilation=1.5), "dilation"),
    (dict(dim=16, num_heads=2, qkv_bias="yes"), "qkv_bias"), (dict(dim=16, num_heads=2, proj_bias=None), "proj_bias"),
]


@pytest.mark.parametrize("kwargs, name", BAD_MODULE_SIZES[:4])
def test_attn_res_module_sizes(kwargs, name):
    """AttnRes(8.0) or AttnRes("8") raised torch's TypeError, not a ValueError naming dim."""
    with pytest.raises(ValueError, match=rf"^{name} must be"):
        fusedops.nn.AttnRes(**kwargs)


@pytest.mark.parametrize("ndim", [1, 2, 3])
@pytest.mark.parametrize("kwargs, name", BAD_MODULE_SIZES[4:])
def test_neighborhood_attention_module_sizes(ndim, kwargs, name):
    kwargs = {"kernel_size": 3, **kwargs}
    with pytest.raises(ValueError, match=rf"^{name} must be"):
        getattr(fusedops.nn, f"NeighborhoodAttention{ndim}d")(**kwargs)


# ---- several Python threads at once --------------------------------------------------------------------------

def _op_calls(device: str = "cpu", scale: int = 1) -> dict:
    """Every attn_res and neighborhood-attention op, forward and backward, plus the public wrappers' forward
    and backward (their direct path), as argument-free calls; inputs made, forwards saved, on `device`."""
    gen = torch.Generator().manual_seed(7)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    a = SimpleNamespace(values=rand(5, 3, 24 * scale), query=rand(24 * scale), weight=rand(24 * scale).abs() + 0.5,
                        grad_out=rand(3, 24 * scale), q=rand(1, 4, 12 * scale, 16), k=rand(1, 2, 12 * scale, 16),
                        v=rand(1, 2, 12 * scale, 16), na=([5], [2], [1], [False], None, "truncated"))
    a.out, a.lse = torch.ops.fusedops.attn_res_with_lse(a.values, a.query, a.weight, 1e-6)
    a.na_out, a.na_lse = torch.ops.fusedops.neighborhood_attention(a.q, a.k, a.v, *a.na)
    a.na_grad = rand(*a.na_out.shape)

    def wrapper_step(fn, *inputs):
        leaves = [t.detach().requires_grad_() for t in inputs]
        out = fn(*leaves)
        return (out.detach(), *torch.autograd.grad(out, leaves, torch.ones_like(out)))

    return {
        "attn_res": lambda: torch.ops.fusedops.attn_res(a.values, a.query, a.weight, 1e-6),
        "attn_res_with_lse": lambda: torch.ops.fusedops.attn_res_with_lse(a.values, a.query, a.weight, 1e-6),
        "attn_res_backward": lambda: torch.ops.fusedops.attn_res_backward(
            a.grad_out, a.values, a.query, a.weight, 1e-6, True, True, True),
        "attn_res_backward_saved": lambda: torch.ops.fusedops.attn_res_backward(
            a.grad_out, a.values, a.query, a.weight, 1e-6, True, True, True, a.out, a.lse),
        "attn_res_wrapper": lambda: wrapper_step(fusedops.attn_res, a.values, a.query, a.weight),
        "neighborhood_attention": lambda: torch.ops.fusedops.neighborhood_attention(a.q, a.k, a.v, *a.na),
        "neighborhood_attention_backward": lambda: torch.ops.fusedops.neighborhood_attention_backward(
            a.na_grad, a.na_lse, a.q, a.k, a.v, a.na_out, a.na_lse, *a.na),
        "neighborhood_attention_wrapper": lambda: wrapper_step(
            lambda q, k, v: fusedops.neighborhood_attention(q, k, v, 3, dilation=(2,), window="shifted"),
            a.q, a.k, a.v),
    }


def _flat(result) -> list:
    return list(result) if isinstance(result, (tuple, list)) else [result]


def _concurrent_results(calls: dict, threads: int, rounds: int) -> list[dict]:
    """Each thread calls every op `rounds` times, in its own order, all threads released at once."""
    barrier = threading.Barrier(threads)
    results: list[dict] = [{} for _ in range(threads)]
    errors: list[BaseException] = []
    names = sorted(calls)

    def work(i):
        try:
            barrier.wait()
            for r in range(rounds):
                for name in names[i % len(names):] + names[:i % len(names)]:
                    results[i][(name, r)] = _flat(calls[name]())
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise errors[0]
    return results


def _assert_threads_match_serial(calls: dict, threads: int, rounds: int) -> None:
    serial = {name: _flat(call()) for name, call in calls.items()}
    for per_thread in _concurrent_results(calls, threads, rounds):
        assert len(per_thread) == len(calls) * rounds
        for (name, _), got in per_thread.items():
            assert all(torch.equal(g, s) for g, s in zip(got, serial[name], strict=True)), name


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_threads_under_the_interpreter_match_serial(path):
    """4 threads calling every op at once under the Triton interpreter: each result is the serial one, bitwise
    (the interpreter patches triton.language per launch; concurrent launches raised InterpreterError)."""
    with execution_path(path), recorded_launches(na_op) as launches:
        _assert_threads_match_serial(_op_calls(), threads=4, rounds=2)
    assert launches  # the kernels ran, not the reference


@pytest.mark.gpu
@gpu
def test_gpu_threads_match_serial():
    """8 threads calling every op at once on CUDA (the direct launch path, no lock) give the serial bits,
    including first launches that fill the launch cache concurrently."""
    calls = _op_calls("cuda", scale=8)
    serial = {name: _flat(call()) for name, call in calls.items()}
    torch.cuda.synchronize()
    launch_module._CACHE.clear()
    for per_thread in _concurrent_results(calls, threads=8, rounds=3):
        for (name, _), got in per_thread.items():
            assert all(torch.equal(g, s) for g, s in zip(got, serial[name], strict=True)), name


# ---- errors inside torch.compile(fullgraph=True) -------------------------------------------------------------

def _compile_cases() -> dict:
    values, query = torch.randn(3, 2, 8), torch.randn(8)
    q = torch.randn(1, 2, 9, 8)
    return {
        "eps": lambda: fusedops.attn_res(values, query, None, 1e-300),
        "query_dtype": lambda: fusedops.attn_res(values, query.long()),
        "norm_weight_shape": lambda: fusedops.attn_res(values, query, query[:5]),
        "kernel_size": lambda: fusedops.neighborhood_attention(q, q, q, 1),
        "scale": lambda: fusedops.neighborhood_attention(q, q, q, 3, scale=1e300),
        "window": lambda: fusedops.neighborhood_attention(q, q, q, 3, window="centered"),
        "k_dtype": lambda: fusedops.neighborhood_attention(q, q.half(), q, 3),
        "shifted_window_too_long": lambda: fusedops.neighborhood_attention(q, q, q, (5,), dilation=2),
    }


def _causes(e: BaseException):
    while e is not None:
        yield e
        e = e.__cause__ or e.__context__


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", sorted(_compile_cases()))
def test_bad_input_under_compile_reports_the_value_error(path, case):
    """Under torch.compile(fullgraph=True) the wrappers leave the checks to the op's fake kernel, whose
    ValueError dynamo reports with its message (and chains): checked in traced Python, it surfaced as
    "Observed exception", the message only in the developer debug context."""
    fn = _compile_cases()[case]
    with pytest.raises(ValueError) as eager:
        fn()
    text = str(eager.value)
    with execution_path(path), opaque_triton_ops():
        torch._dynamo.reset()
        with pytest.raises(Exception, match=re.escape(text)) as compiled:
            torch.compile(fn, fullgraph=True, backend="aot_eager")()
    assert text in str(compiled.value).split("Developer debug context")[0]
    assert any(isinstance(c, ValueError) and str(c) == text for c in _causes(compiled.value))


# ---- the truncated window wider than its axis (Liger) -------------------------------------------------------

TRUNCATED_WIDE = [  # (spatial, kernel_size, dilation, is_causal): kernel_size * dilation > L on some axis
    ([16], [9], [2], [False]),  # the issue's case: groups of 8 under a 9-wide window
    ([16], [9], [2], [True]),
    ([5], [7], [1], [False]),
    ([4], [3], [8], [False]),  # dilation past the axis: each query sees itself
    ([40], [33], [2], [False]),
    ([6, 5], [7, 5], [2, 1], [False, True]),
    ([5, 7], [9, 3], [1, 3], [False, False]),
]


# Every path, and the kernels' paths again under a small on-chip budget.
PATH_BUDGETS = [pytest.param(p.values[0], budget, id=f"{p.id}-{budget or 'planned'}", marks=p.marks)
                for p in PATHS for budget in (None, 4096) if budget is None or p.values[0] != "reference"]


@pytest.mark.parametrize("path, onchip_bytes", PATH_BUDGETS)
@pytest.mark.parametrize("spatial, ks, dil, causal", TRUNCATED_WIDE)
def test_truncated_window_wider_than_axis(path, onchip_bytes, spatial, ks, dil, causal):
    """window="truncated" with kernel_size * dilation > L: border queries see fewer keys, as in Liger; forward
    and gradients against the float64 dense-mask oracle, 1D and 2D, with GQA, on every path (a small budget:
    many tiles, and the two-kernel backward instead of the fused 1-D one)."""
    case = dict(spatial=spatial, ks=ks, dil=dil, strd=[1] * len(spatial), causal=causal, window="truncated",
                batch=1, kv_heads=1, groups=2, head_dim=16, head_dim_v=8, dtype=torch.float32, strided=True,
                scale=None, with_lse_grad=True, seed=len(spatial) + ks[0])
    with execution_path(path, onchip_bytes), recorded_launches(na_op) as launches:
        check_case(case)
    if onchip_bytes:
        assert any(name == "na_bwd_dkdv_kernel" for name, _, _ in launches)


def test_shifted_window_still_needs_the_axis():
    """NATTEN's shifted window needs kernel_size keys in every dilation group: unchanged."""
    q = torch.randn(1, 1, 16, 8)
    with pytest.raises(ValueError, match=r"^kernel_size \* dilation must not exceed the axis length"):
        fusedops.neighborhood_attention(q, q, q, 9, dilation=2)
    assert fusedops.neighborhood_attention(q, q, q, 9, dilation=2, window="truncated").shape == q.shape


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("spatial, ks, dil, causal", TRUNCATED_WIDE)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_truncated_window_wider_than_axis(spatial, ks, dil, causal, dtype):
    case = dict(spatial=spatial, ks=ks, dil=dil, strd=[1] * len(spatial), causal=causal, window="truncated",
                batch=2, kv_heads=2, groups=2, head_dim=64, head_dim_v=64, dtype=dtype, strided=True,
                scale=None, with_lse_grad=True, seed=3)
    check_case(case, "cuda")
