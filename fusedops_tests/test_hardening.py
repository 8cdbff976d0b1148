"""Adversarial inputs to attn_res and neighborhood attention (issue 34, input hardening): every tensor argument
of every op checked in its body and its fake kernel, float arguments held to the float32 range the kernels
compute in, flags and module sizes of the wrong type, calls from several threads, errors inside
torch.compile, the truncated window wider than its axis (Liger's semantics), non-finite values (they stay in
their windows and give the reference's IEEE results), and float64 on every path (gradcheck of every op)."""

from __future__ import annotations

import math
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
from fusedops.numerics import float_args, split_float32
from fusedops.validation import FP32, check_fp32_normal

from .helpers import KERNEL_PATHS, PATHS, execution_path, gpu, opaque_triton_ops, recorded_launches
from .test_neighborhood_attention import check_case, dense_mask, oracle

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
    ("neighborhood_attention", "q", lambda t: t.to(torch.int32)),
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


# ---- non-finite values stay inside the windows that hold them ------------------------------------------------

# NumPy warns of the infs and NaNs the interpreter computes with (0 * inf, inf - inf): expected here.
NON_FINITE_ARITHMETIC = pytest.mark.filterwarnings("ignore:(invalid value|divide by zero|overflow):RuntimeWarning")

# (spatial, kernel_size, dilation, stride, is_causal, window, query heads, kv heads, on-chip budget): 1-D (the fused
# backward on both plans; under a small budget the dQ and dK/dV kernels), causal, dilated, strided (GNA), truncated
# with GQA, and 2-D.
WINDOW_CASES = {
    "1d": ([24], [3], [1], [1], [False], "shifted", 1, 1, None),
    "1d_two_kernel_backward": ([24], [3], [1], [1], [False], "shifted", 1, 1, 4096),
    "1d_causal": ([24], [4], [1], [1], [True], "shifted", 1, 1, None),
    "1d_dilated": ([24], [3], [2], [1], [False], "shifted", 1, 1, None),
    "1d_strided": ([24], [4], [1], [2], [False], "shifted", 1, 1, None),
    "1d_truncated_gqa": ([24], [5], [1], [1], [False], "truncated", 2, 1, None),
    "2d_strided_causal_gqa": ([6, 7], [3, 3], [1, 1], [1, 2], [False, True], "shifted", 2, 1, None),
}
POISONED = {"q": (0, 1), "k": (0, 14), "v": (0, -2), "grad_out": (-1, 6)}  # tensor: (head, flat position)
# The 2-D case takes ~20 s a path in the interpreter (its exact path walks windows one pair at a time).
WINDOW_CASE_PARAMS = [pytest.param(name, marks=[pytest.mark.slow] if name.startswith("2d") else [])
                      for name in sorted(WINDOW_CASES)]


def _window_inputs(case: str, gen: torch.Generator) -> dict:
    spatial, _, _, _, _, _, heads, kv_heads, _ = WINDOW_CASES[case]
    q, grad_out = (torch.randn(1, heads, *spatial, 8, generator=gen) for _ in range(2))
    k, v = (torch.randn(1, kv_heads, *spatial, 8, generator=gen) for _ in range(2))
    return dict(q=q, k=k, v=v, grad_out=grad_out, grad_lse=torch.randn(q.shape[:-1], generator=gen))


def _poison(inputs: dict, value: float) -> dict:
    """The inputs with one entry of q, k, v and grad_out set to value (at POISONED)."""
    inputs = {name: t.clone() for name, t in inputs.items()}
    for name, (head, pos) in POISONED.items():
        t = inputs[name]
        t.view(t.shape[1], -1, t.shape[-1])[head, pos, 3] = value
    return inputs


def _na_results(case: str, inputs: dict) -> dict:
    """out, lse and the gradients of q, k and v, as [heads, positions, ...] (one batch)."""
    spatial, ks, dil, st, causal, window, _, _, _ = WINDOW_CASES[case]
    q, k, v = (inputs[n].detach().requires_grad_() for n in "qkv")
    out, lse = fusedops.neighborhood_attention(q, k, v, ks, dil, st, causal, window=window, return_lse=True)
    loss = (out * inputs["grad_out"]).sum() + (lse * inputs["grad_lse"]).sum()
    grads = torch.autograd.grad(loss, (q, k, v))
    results = dict(out=out.detach(), lse=lse.detach(), dq=grads[0], dk=grads[1], dv=grads[2])
    return {name: t.reshape(t.shape[1], math.prod(spatial), -1) for name, t in results.items()}


def _touched(case: str) -> dict:
    """Per result, the rows ([heads, positions]) that depend on a poisoned entry through their windows: a
    query's out, lse and dq on its own q (and grad_out for dq) and its window's k and v; a key's dk and dv on
    the queries whose windows hold it."""
    spatial, ks, dil, st, causal, window, heads, kv_heads, _ = WINDOW_CASES[case]
    window_of = dense_mask(spatial, ks, dil, st, causal, window)  # [query, key]
    tokens = math.prod(spatial)
    bad = {name: torch.zeros(heads if name in ("q", "grad_out") else kv_heads, tokens, dtype=torch.bool)
           for name in POISONED}
    for name, (head, pos) in POISONED.items():
        bad[name][head, pos] = True
    group = heads // kv_heads
    keys = (bad["k"] | bad["v"]).repeat_interleave(group, 0)
    forward = bad["q"] | (window_of[None] & keys[:, None, :]).any(-1)
    backward = forward | bad["grad_out"]
    seen = (window_of[None] & backward[:, :, None]).any(1).reshape(kv_heads, group, tokens).any(1)
    return dict(out=forward, lse=forward, dq=backward, dk=seen, dv=seen)


@NON_FINITE_ARITHMETIC
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("value", [math.inf, math.nan], ids=["inf", "nan"])
@pytest.mark.parametrize("case", WINDOW_CASE_PARAMS)
def test_non_finite_values_stay_in_their_windows(path, value, case):
    """An inf or NaN in q, k, v or grad_out changes only the results whose window holds it: out, lse and dq of
    the queries that see it, dk and dv of the keys those queries see. On the kernel paths a key outside a
    query's window got weight 0, and 0 * inf = NaN inside P @ V (and dS @ K, dS^T @ Q, P^T @ dO in the
    backward) turned every query of the tile NaN."""
    inputs = _window_inputs(case, torch.Generator().manual_seed(3))
    with execution_path(path, WINDOW_CASES[case][-1]):
        clean = _na_results(case, inputs)
        dirty = _na_results(case, _poison(inputs, value))
    touched = _touched(case)
    assert not torch.isfinite(dirty["out"][touched["out"]]).all()
    for name, rows in touched.items():
        assert rows.any() and not rows.all(), name
        torch.testing.assert_close(dirty[name][~rows], clean[name][~rows], rtol=1e-5, atol=1e-6, msg=name)


@NON_FINITE_ARITHMETIC
def test_issue_reproduction_inf_outside_the_window():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 1, 12, 8) for _ in range(3))
    v[0, 0, 4, 2] = float("inf")
    for path in ("reference", "cuda", "ascend"):
        with execution_path(path):
            assert torch.isfinite(fusedops.neighborhood_attention(q, k, v, 3)[0, 0, :3, 2]).all(), path


# ---- non-finite logits give IEEE results, as in the reference ------------------------------------------------

NON_FINITE_LOGITS = {"-inf": -math.inf, "+inf": math.inf, "nan": math.nan}


def _extreme_query(kind: str) -> tuple:
    """q, k, v with query 3's logits all -inf, holding +inf, or NaN (q[3] . k = q[3, 0] * k[:, 0], k[:, 0] > 0)."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 1, 12, 8, generator=gen) for _ in range(3))
    k[..., 0] = k[..., 0].abs() + 0.5
    q[0, 0, 3] = 0.0
    q[0, 0, 3, 0] = NON_FINITE_LOGITS[kind]
    return q, k, v


@NON_FINITE_ARITHMETIC
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", sorted(NON_FINITE_LOGITS))
def test_non_finite_logits_give_ieee_results(path, kind):
    """lse is torch.logsumexp's: -inf where every logit is -inf, +inf where one is +inf, NaN with a NaN; out is
    softmax's NaN. The kernels' finite -1e30 for "masked" gave out 0 and lse -6.9e29 for the first, and a NaN
    query a finite lse. The other queries' results stay finite."""
    q, k, v = _extreme_query(kind)
    with execution_path(path):
        out, lse = fusedops.neighborhood_attention(q, k, v, 3, return_lse=True)
    torch.testing.assert_close(lse[0, 0, 3], torch.tensor(NON_FINITE_LOGITS[kind]), equal_nan=True)
    assert out[0, 0, 3].isnan().all()
    others = torch.arange(12) != 3
    assert torch.isfinite(out[0, 0, others]).all() and torch.isfinite(lse[0, 0, others]).all()


@NON_FINITE_ARITHMETIC
@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("case", [c for c in WINDOW_CASE_PARAMS if c.values[0] in ("1d", "2d_strided_causal_gqa")])
@pytest.mark.parametrize("kind", ["inf_inputs", "nan_inputs", *(f"logits{k}" for k in sorted(NON_FINITE_LOGITS))])
def test_non_finite_inputs_match_the_reference(path, case, kind):
    """With an inf or NaN in every input (or a query's logits all -inf, holding +inf or NaN), the kernels give
    the reference's results and gradients, NaN for NaN and inf for inf."""
    inputs = _window_inputs(case, torch.Generator().manual_seed(4))
    if kind.startswith("logits"):
        inputs["k"][..., 0] = inputs["k"][..., 0].abs() + 0.5
        row = inputs["q"].view(inputs["q"].shape[1], -1, 8)[0, 3]
        row.zero_()
        row[0] = NON_FINITE_LOGITS[kind[len("logits"):]]
    else:
        inputs = _poison(inputs, math.inf if kind == "inf_inputs" else math.nan)
    with execution_path("reference"):
        expected = _na_results(case, inputs)
    with execution_path(path, WINDOW_CASES[case][-1]):
        results = _na_results(case, inputs)
    for name, ref in expected.items():
        assert not torch.isfinite(ref).all(), name
        torch.testing.assert_close(results[name], ref, rtol=1e-5, atol=1e-5, equal_nan=True, msg=name)


@NON_FINITE_ARITHMETIC
@pytest.mark.parametrize("path", PATHS)
def test_logits_below_the_former_masking_sentinel(path):
    """scale is capped at MAX_SCALE (~1.8e19), q . k is not: logits near -8e31 lie below the -1e30 the kernels
    took for "masked", and every query came back as a zero row (lse -6.9e29). Against the float64 oracle."""
    gen = torch.Generator().manual_seed(6)
    q = torch.full((1, 1, 9, 8), -1e6)
    k = 1e6 * (1 + 0.01 * torch.rand(1, 1, 9, 8, generator=gen))
    v = torch.randn(1, 1, 9, 8, generator=gen)
    with execution_path(path):
        out, lse = fusedops.neighborhood_attention(q, k, v, 3, scale=1e19, return_lse=True)
    ref_out, ref_lse = oracle(q, k, v, [3], [1], [1], [False], 1e19, "shifted")
    assert ref_lse.max() < -1e31
    torch.testing.assert_close(out, ref_out.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, ref_lse.float(), rtol=1e-5, atol=0.0)


# ---- attn_res: infinite logits give torch.logsumexp's lse ----------------------------------------------------

AR_BUDGETS = [None, 400, 256]  # depth tiles; a row on chip (online forward, one-pass backward); D in tiles


def _ar_extreme(kind: str) -> tuple:
    """values [3, 4, 16], query and norm_weight with non-finite logits. "logits": u = -inf e0, so token t's
    logits are -inf * v[:, t, 0]: token 1 all -inf, token 2 one +inf, token 3 one NaN (a zero), token 0 all
    -inf. "norm_weight": an inf gain, +-inf logits by the signs of v[:, t, 5]. Anything else: finite."""
    gen = torch.Generator().manual_seed(8)
    values, query, weight = torch.randn(3, 4, 16, generator=gen), torch.randn(16, generator=gen), torch.rand(16) + 0.5
    if kind == "logits":
        values[:, :, 0] = values[:, :, 0].abs() + 0.5
        values[0, 2, 0], values[1, 3, 0] = -1.0, 0.0
        query = torch.zeros(16)
        query[0] = -math.inf
    elif kind == "norm_weight":
        weight[5] = math.inf
    return values, query, weight


def _ar_oracle(values, query, weight, eps=1e-6) -> tuple:
    """(out, lse) in float64, written out: logits rstd_i <u, v_i>, torch.logsumexp and torch.softmax over depth."""
    v, u = values.double(), query.double() * weight.double()
    logits = (v * u).sum(-1) * torch.rsqrt(v.square().mean(-1) + eps)
    return torch.einsum("nt,ntd->td", torch.softmax(logits, 0), v), torch.logsumexp(logits, 0)


def _ar_budget_paths():
    return [pytest.param(p.values[0], budget, id=f"{p.id}-{budget or 'planned'}", marks=p.marks)
            for p in PATHS for budget in AR_BUDGETS if budget is None or p.values[0] != "reference"]


@NON_FINITE_ARITHMETIC
@pytest.mark.parametrize("path, onchip_bytes", _ar_budget_paths())
@pytest.mark.parametrize("kind", ["logits", "norm_weight"])
def test_attn_res_infinite_logits_give_ieee_lse(path, onchip_bytes, kind):
    """lse is -inf where every logit is -inf, +inf where one is +inf, NaN where one is NaN (torch.logsumexp),
    and out softmax's NaN: the kernels gave NaN for every lse (exp(-inf - -inf), exp(inf - inf))."""
    values, query, weight = _ar_extreme(kind)
    ref_out, ref_lse = _ar_oracle(values, query, weight)
    assert ref_lse.isinf().any()
    with execution_path(path, onchip_bytes):
        out, lse = fusedops.attn_res(values, query, weight, return_lse=True)
    torch.testing.assert_close(lse, ref_lse.float(), equal_nan=True)
    assert torch.equal(out.isnan(), ref_out.isnan())


@NON_FINITE_ARITHMETIC
@pytest.mark.parametrize("path, onchip_bytes", [p for p in _ar_budget_paths() if p.values[0] != "reference"])
@pytest.mark.parametrize("kind", ["logits", "norm_weight", "nan_value", "inf_value"])
@pytest.mark.parametrize("with_lse", [True, False], ids=["with_lse", "out_only"])
def test_attn_res_non_finite_inputs_match_the_reference(path, onchip_bytes, kind, with_lse):
    """Outputs and every gradient (each backward kernel: with and without the forward's out and lse) agree
    with the reference, NaN for NaN and inf for inf."""
    if kind in ("logits", "norm_weight"):
        values, query, weight = _ar_extreme(kind)
    else:
        values, query, weight = _ar_extreme("none")
        values[1, 2, 3] = math.nan if kind == "nan_value" else math.inf
    gen = torch.Generator().manual_seed(9)
    grad_out, grad_lse = torch.randn(4, 16, generator=gen), torch.randn(4, generator=gen)

    def run(run_path, budget=None):
        leaves = [t.clone().requires_grad_() for t in (values, query, weight)]
        with execution_path(run_path, budget):
            if with_lse:
                out, lse = torch.ops.fusedops.attn_res_with_lse(*leaves, 1e-6)
                loss = (out * grad_out).sum() + (lse * grad_lse).sum()
            else:
                out = lse = torch.ops.fusedops.attn_res(*leaves, 1e-6)
                loss = (out * grad_out).sum()
            return [out.detach(), lse.detach(), *torch.autograd.grad(loss, leaves)]

    for got, ref in zip(run(path, onchip_bytes), run("reference"), strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5, equal_nan=True)


@NON_FINITE_ARITHMETIC
@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("kind", ["logits", "norm_weight", "nan_value", "inf_value"])
def test_attn_res_split_forward_non_finite_matches_the_reference(path, kind):
    """The forward split over programs (a source row each, one segment left empty) and merged gives the
    reference's out and lse: -inf, +inf and NaN logits, NaN and inf values."""
    if kind in ("logits", "norm_weight"):
        values, query, weight = _ar_extreme(kind)
    else:
        values, query, weight = _ar_extreme("none")
        values[1, 2, 3] = math.nan if kind == "nan_value" else math.inf
    with execution_path(path), fusedops.plan_override("attn_res", "forward", variant="depth_tile", block_n=1,
                                                      split=4):
        out, lse = torch.ops.fusedops.attn_res_with_lse(values, query, weight, 1e-6)
    with execution_path("reference"):
        ref = torch.ops.fusedops.attn_res_with_lse(values, query, weight, 1e-6)
    for got, want in zip((out, lse), ref, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)


@NON_FINITE_ARITHMETIC
@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("kind", ["logits", "norm_weight", "nan_value", "inf_value"])
@pytest.mark.parametrize("wrt", ["values", "all"])
def test_attn_res_16_bit_one_pass_backward_non_finite_matches_the_reference(path, dtype, kind, wrt, monkeypatch):
    """The one-pass backward of 16-bit values defers its heavy rows (alpha >= 1/8) to waiting slots and writes
    the others at once. A NaN alpha is neither: its row's gradient must still be written (it was left as
    grad_values' uninitialised memory where no parameter gradient was asked for: with one, the reduction
    rewrites the stashed rows). Gradients agree with the reference's, NaN for NaN."""
    if kind in ("logits", "norm_weight"):
        values, query, weight = _ar_extreme(kind)
    else:
        values, query, weight = _ar_extreme("none")
        values[1, 2, 3] = math.nan if kind == "nan_value" else math.inf
    values = values.to(dtype)
    grad_out = torch.randn(4, 16, generator=torch.Generator().manual_seed(9)).to(dtype)

    def run(run_path):
        leaves = [t.clone().requires_grad_(wrt == "all" or i == 0) for i, t in enumerate((values, query, weight))]
        with execution_path(run_path), fusedops.plan_override("attn_res", "backward", variant="one_pass"):
            out, _ = torch.ops.fusedops.attn_res_with_lse(*leaves, 1e-6)  # the one-pass kernel reads out and lse
            return [out.detach(), *torch.autograd.grad(out, [t for t in leaves if t.requires_grad], grad_out)]

    # Uninitialised memory made visible: what empty_like hands the op holds a finite sentinel, not whatever
    # the allocator's block held before (often NaN here, which would hide a row left unwritten).
    empty_like = torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda *args, **kw: empty_like(*args, **kw).fill_(-1234.0))

    for got, ref in zip(run(path), run("reference"), strict=True):
        assert torch.equal(got.isnan(), ref.isnan())
        torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2, equal_nan=True)


# ---- float64: every op computes in float64, and gradcheck runs on every path ---------------------------------

F64 = torch.float64


def _gradcheck(path: str, fn, inputs) -> None:
    """torch.autograd.gradcheck; on the interpreter's paths in fast mode (a random projection u^T J v of the
    Jacobian against finite differences, instead of every entry: 2 evaluations per input, not 2 per element)."""
    torch.autograd.gradcheck(fn, inputs, fast_mode=path != "reference")


def _f64(*shape, seed: int = 0, positive: bool = False) -> torch.Tensor:
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)
    return (t.abs() + 0.5 if positive else t).requires_grad_()


def _attn_res_backward_op(saved: bool):
    """attn_res_with_lse whose backward is the registered op fusedops::attn_res_backward (with the forward's out
    and lse, the one-pass kernels; without, the kernels that re-derive the softmax), so that gradcheck holds
    that op itself against finite differences."""

    class Via(torch.autograd.Function):
        @staticmethod
        def forward(ctx, values, query, weight):
            out, lse = torch.ops.fusedops.attn_res_with_lse(values, query, weight, 1e-6)
            ctx.save_for_backward(values, query, weight, out, lse)
            return out, lse

        @staticmethod
        def backward(ctx, grad_out, grad_lse):
            values, query, weight, out, lse = ctx.saved_tensors
            stats = (out, lse) if saved else (None, None)
            return torch.ops.fusedops.attn_res_backward(grad_out, values, query, weight, 1e-6, True, True, True,
                                                        *stats, grad_lse)

    return Via.apply


@pytest.mark.parametrize("path, onchip_bytes", _ar_budget_paths())
def test_attn_res_gradcheck_float64(path, onchip_bytes):
    """float64 was refused; it now runs in float64 (logits, softmax, lse and sums), so torch.autograd.gradcheck
    holds every attn_res op and the backward op (each of its kernels: depth tiles, one pass, two phases) to
    finite differences, on every path and plan."""
    values, query, weight = _f64(3, 2, 16, seed=1), _f64(16, seed=2), _f64(16, seed=3, positive=True)
    with execution_path(path, onchip_bytes):
        out, lse = fusedops.attn_res(values, query, weight, return_lse=True)
        assert out.dtype == lse.dtype == F64
        _gradcheck(path, lambda v, q, w: fusedops.attn_res(v, q, w, return_lse=True), (values, query, weight))
        _gradcheck(path, lambda v, q: torch.ops.fusedops.attn_res(v, q, None, 1e-6), (values, query))
        for saved in (True, False):
            _gradcheck(path, _attn_res_backward_op(saved), (values, query, weight))


# (spatial, kernel_size, dilation, stride, is_causal, window, query heads, kv heads, on-chip budget)
NA_GRADCHECK_CASES = {
    "1d_truncated_gqa": ([6], [3], [1], [1], [False], "truncated", 2, 1, None),
    "1d_dilated_causal_two_kernels": ([7], [2], [2], [1], [True], "shifted", 1, 1, 4096),
    "2d_strided": ([3, 4], [2, 3], [1, 1], [1, 2], [False, False], "shifted", 1, 1, None),
}


def _na_backward_op(args: tuple):
    """neighborhood_attention whose backward is the registered op fusedops::neighborhood_attention_backward."""

    class Via(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            out, lse = torch.ops.fusedops.neighborhood_attention(q, k, v, *args)
            ctx.save_for_backward(q, k, v, out, lse)
            return out, lse

        @staticmethod
        def backward(ctx, grad_out, grad_lse):
            return torch.ops.fusedops.neighborhood_attention_backward(grad_out, grad_lse, *ctx.saved_tensors, *args)

    return Via.apply


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", sorted(NA_GRADCHECK_CASES))
def test_neighborhood_attention_gradcheck_float64(path, case):
    """gradcheck of the op (out and lse) and of its backward op in float64, on every path: 1-D with GQA and a
    truncated window, dilated and causal through the two-kernel backward, 2-D strided."""
    spatial, ks, dil, st, causal, window, heads, kv_heads, budget = NA_GRADCHECK_CASES[case]
    q, k, v = (_f64(1, h, *spatial, 8, seed=i) for i, h in enumerate((heads, kv_heads, kv_heads)))
    args = (ks, dil, st, causal, None, window)
    with execution_path(path, budget):
        out, lse = fusedops.neighborhood_attention(q, k, v, *args[:4], window=window, return_lse=True)
        assert out.dtype == lse.dtype == F64
        _gradcheck(path, lambda q, k, v: fusedops.neighborhood_attention(q, k, v, *args[:4], window=window,
                                                                           return_lse=True), (q, k, v))
        _gradcheck(path, _na_backward_op(args), (q, k, v))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("padding_idx", [None, 1])
def test_embedding_gradcheck_float64(path, padding_idx):
    """gradcheck in float64 on every path of embedding (without padding_idx: a padding row's zero gradient is
    torch's semantics, not the derivative, as is scale_grad_by_freq's scaling) and of embedding_backward, which
    is linear in grad_out and differentiable (its backward is the gather again) with padding_idx and
    scale_grad_by_freq. 20 tokens of one index make the backward split the run (16-token chunks under the
    interpreter's plans)."""
    indices = torch.tensor([3] * 20 + [0, 1, 1, 4])
    weight, grad_out = _f64(5, 4, seed=1), _f64(24, 4, seed=2)
    with execution_path(path):
        assert fusedops.embedding(indices, weight).dtype == F64
        if padding_idx is None:
            _gradcheck(path, lambda w: fusedops.embedding(indices, w), (weight,))
        for scale in (False, True):
            _gradcheck(path, lambda g: torch.ops.fusedops.embedding_backward(g, indices, 5, padding_idx, scale),
                       (grad_out,))


def test_split_float32_carries_a_float64_scalar_to_2_to_the_minus_48():
    """A Python float reaches a kernel as float32 (Triton's typing; Inductor's code passes float64): kernel scalar
    arguments travel as hi + lo, both exact in float32, hi being x rounded to float32 (to 2^-48 of x where lo is a
    normal float32 number, |x| >= 2^-102)."""
    gen = torch.Generator().manual_seed(3)
    for x in [0.3, 1e-6, 1 / 3, 8 ** -0.5, 1.4426950408889634 * 0.1, 1.8e19, 1e-30, 2.0] + \
            (torch.rand(200, generator=gen, dtype=F64) * 10).tolist():
        hi, lo = split_float32(x)
        assert hi == torch.tensor(x, dtype=torch.float32).item()
        assert lo == torch.tensor(lo, dtype=torch.float32).item()
        assert abs(hi + lo - x) <= 2 ** -48 * abs(x)
    assert split_float32(1e300) == (1e300, 0.0) and split_float32(3) == (3, 0.0)
    assert float_args(eps=0.3, scale=2.0) == {"eps": split_float32(0.3)[0], "eps_lo": split_float32(0.3)[1],
                                              "scale": 2.0, "scale_lo": 0.0}


def _f64_results(fn, leaves) -> list:
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    outs = fn(*leaves)
    loss = sum((o * torch.linspace(-1, 1, o.numel(), dtype=F64).reshape(o.shape)).sum() for o in outs)
    return [o.detach() for o in outs] + list(torch.autograd.grad(loss, leaves))


F64_OPS = {  # op (results as a tuple) and its inputs; eps, norm_eps and scale not exact in float32
    "attn_res": (lambda v, q, w: fusedops.attn_res(v, q, w, eps=0.3, return_lse=True),
                 lambda: (0.3 * _f64(3, 4, 16, seed=1), _f64(16, seed=2), _f64(16, seed=3, positive=True))),
    "attn_res_multi": (lambda v, q: fusedops.attn_res_multi(v, q, eps=0.3),
                       lambda: (0.3 * _f64(3, 4, 16, seed=1), _f64(3, 16, seed=2))),
    "attn_res_merge": (lambda o, lse, p, q, a, g: fusedops.attn_res_merge(o, lse, p, q, a, g, eps=0.3, norm_eps=0.7),
                       lambda: (_f64(4, 16, seed=1), _f64(4, seed=2), 0.3 * _f64(4, 16, seed=3), _f64(16, seed=4),
                                0.1 * _f64(4, 16, seed=5), _f64(16, seed=6, positive=True))),
    "na_1d_fused_backward": (lambda q, k, v: fusedops.neighborhood_attention(q, k, v, 5, scale=0.3, return_lse=True),
                             lambda: (4 * _f64(1, 2, 16, 8, seed=1), _f64(1, 2, 16, 8, seed=2),
                                      _f64(1, 2, 16, 8, seed=3))),
    "na_2d": (lambda q, k, v: fusedops.neighborhood_attention(q, k, v, 3, scale=0.3, return_lse=True),
              lambda: (4 * _f64(1, 1, 6, 7, 8, seed=1), _f64(1, 1, 6, 7, 8, seed=2), _f64(1, 1, 6, 7, 8, seed=3))),
}


@pytest.mark.parametrize("op, onchip_bytes", [
    pytest.param(op, b, id=f"{op}-{b or 'planned'}", marks=pytest.mark.interpreter)
    for op in sorted(F64_OPS) for b in (AR_BUDGETS if op.startswith("attn_res") else [None])])
def test_float64_kernels_match_the_reference_to_float64_precision(op, onchip_bytes):
    """The float64 kernels (CUDA plan; attn_res's at three budgets: each of its kernels) compute in float64, their
    float scalars (eps, norm_eps, the softmax scale) included: results and gradients within 1e-12 of the
    reference's. Those scalars reached the kernels rounded to float32, which put float64 results off by 1e-8 to
    1e-7 (gradcheck passed: forward and backward used the same rounded value). On the Ascend plan float64 runs
    the reference."""
    fn, make = F64_OPS[op]
    inputs = make()
    with execution_path("reference"):
        want = _f64_results(fn, inputs)
    with execution_path("cuda", onchip_bytes):
        got = _f64_results(fn, inputs)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)


@pytest.mark.interpreter
@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_float64_values_with_lower_precision_parameters(param_dtype):
    """float64 values with a 16- or 32-bit query and norm weight (the CUDA plan, every kernel budget): each
    gradient in its parameter's dtype within that dtype's rounding of the float64 reference. The float64 sums went
    to a bfloat16 gradient through Triton 3.7's interpreter cast, an integer truncation (zeros and NaN)."""
    values = _f64(3, 4, 16, seed=1)
    query, weight = (0.3 * _f64(16, seed=2)).to(param_dtype), (_f64(16, seed=3).abs() + 0.5).to(param_dtype)
    grad = _f64(4, 16, seed=4)
    tol = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-6}[param_dtype]
    want = None
    for path, budget in [("reference", None)] + [("cuda", b) for b in AR_BUDGETS]:
        leaves = [t.clone().requires_grad_() for t in (values, query, weight)]
        with execution_path(path, budget):
            out = fusedops.attn_res(*leaves)
            got = torch.autograd.grad(out, leaves, grad)
        assert [g.dtype for g in got] == [torch.float64, param_dtype, param_dtype]
        if want is None:
            want = [g.double() for g in got]
            continue
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g.double(), w, rtol=tol, atol=tol * w.abs().max().item())


@pytest.mark.parametrize("path", KERNEL_PATHS[:1])
def test_opcheck_float64(path):
    """torch.library.opcheck of every op on float64 arguments (schema, fake kernel, autograd registration)."""
    values, query, weight = _f64(3, 2, 16, seed=1), _f64(16, seed=2), _f64(16, seed=3)
    q, k, v = (_f64(1, 2, 6, 8, seed=i) for i in range(3))
    na_args = ([3], [1], [1], [False], None, "shifted")
    weight_e, indices = _f64(5, 4, seed=4), torch.tensor([0, 3, 3, 1])
    with execution_path(path), opaque_triton_ops():
        torch.library.opcheck(torch.ops.fusedops.attn_res.default, (values, query, weight, 1e-6))
        torch.library.opcheck(torch.ops.fusedops.attn_res_with_lse.default, (values, query, weight, 1e-6))
        out, lse = torch.ops.fusedops.attn_res_with_lse(values.detach(), query.detach(), weight.detach(), 1e-6)
        plain = (values.detach(), query.detach(), weight.detach(), 1e-6, True, True, True)
        torch.library.opcheck(torch.ops.fusedops.attn_res_backward.default,
                              (torch.randn_like(out), *plain, out, lse, torch.randn_like(lse)))
        torch.library.opcheck(torch.ops.fusedops.neighborhood_attention.default, (q, k, v, *na_args))
        out, lse = torch.ops.fusedops.neighborhood_attention(q.detach(), k.detach(), v.detach(), *na_args)
        torch.library.opcheck(torch.ops.fusedops.neighborhood_attention_backward.default,
                              (torch.randn_like(out), torch.randn_like(lse), q.detach(), k.detach(), v.detach(), out,
                               lse, *na_args))
        torch.library.opcheck(torch.ops.fusedops.embedding.default, (weight_e, indices, None, False))
        torch.library.opcheck(torch.ops.fusedops.embedding_backward.default,
                              (_f64(4, 4, seed=5), indices, 5, 0, True))


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_float64_runs_the_reference_under_the_ascend_plan(path):
    """triton-ascend has no float64: under the Ascend plan a float64 call (forward and backward) launches no
    kernel and gives the reference's result bitwise; under the CUDA plan the kernels run in float64."""
    from fusedops.attn_res import op as ar_op
    from fusedops.embedding import op as emb_op

    values, query = _f64(3, 2, 16, seed=1), _f64(16, seed=2)
    q, k, v = (_f64(1, 2, 6, 8, seed=i) for i in range(3))
    weight, indices = _f64(5, 4, seed=4), torch.tensor([0, 3, 3, 1])

    def run():
        outs = [fusedops.attn_res(values, query), fusedops.neighborhood_attention(q, k, v, 3),
                fusedops.embedding(indices, weight)]
        grads = torch.autograd.grad(sum(o.sum() for o in outs), (values, query, q, k, v, weight))
        return [o.detach() for o in outs] + list(grads)

    with execution_path("reference"):
        want = run()
    with execution_path(path), recorded_launches(ar_op) as ar, recorded_launches(na_op) as na, \
            recorded_launches(emb_op) as emb:
        got = run()
    assert (len(ar + na + emb) == 0) == (path == "ascend"), [name for name, *_ in ar + na + emb]
    if path == "ascend":
        for g, w in zip(got, want):
            assert torch.equal(g, w)
