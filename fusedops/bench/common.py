"""What every op benchmark shares: the run context, timing, memory, rows.

An op benchmark is a module `fusedops/bench/<op>.py` with `CASES` (the accelerator cases), `CPU_CASES`,
`QUICK` ({"cpu": [...], "gpu": [...]}) and `run(ctx: Context) -> list[dict]`, which times
`ctx.cases_of(module)`. Each row has the keys op, case (str), provider, mode ("fwd" | "bwd" | "fwd+bwd"),
ms, and where meaningful tbps, pct_ceiling (accelerators only), tflops, peak_mb, error (str: the provider
failed). `measure` builds such a row from a callable and never raises; `ctx.failed` turns a provider that
could not be set up into rows (a baseline that is not installed into one row per op, `missing: True`).

An op module may also define `parity_case(device, dtype) -> (fn, inputs)` for the CPU parity check;
see fusedops/bench/parity.py for the built-in tiny cases.
"""

from __future__ import annotations

import importlib
import statistics
import sys
import time as _time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

MODES = ("fwd", "bwd", "fwd+bwd")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def detect_device(requested: Optional[str] = None) -> torch.device:
    """cuda if present, else npu if torch_npu imports and sees a device, else cpu."""
    if requested:
        if requested == "npu":
            import torch_npu  # noqa: F401
        return torch.device(requested)
    if torch.cuda.is_available():
        return torch.device("cuda")
    try:
        import torch_npu  # noqa: F401

        if torch.npu.is_available():
            return torch.device("npu")
    except Exception:
        pass
    return torch.device("cpu")


def _accel(device: torch.device):
    """torch.cuda or torch.npu for an accelerator device, None on CPU."""
    if device.type == "cuda":
        return torch.cuda
    if device.type == "npu":
        return torch.npu
    return None


def synchronize(device: torch.device) -> None:
    mod = _accel(device)
    if mod is not None:
        mod.synchronize()


def device_name(device: torch.device) -> str:
    mod = _accel(device)
    if mod is not None:
        try:
            return str(mod.get_device_name(device))
        except Exception:
            return device.type
    import platform

    return platform.processor() or platform.machine() or "cpu"


@dataclass
class Context:
    device: torch.device
    dtype: torch.dtype = torch.bfloat16
    quick: bool = False
    sizes: Optional[list[str]] = None  # user selection: case strings (see `select`), or None for all
    ceiling_tbps: float = float("nan")  # device-to-device copy bandwidth, bytes read + written
    verbose: bool = True
    started: float = field(default_factory=_time.perf_counter)
    missing: set = field(default_factory=set)  # (op, provider) of the optional baselines that did not import

    # ---- timing ------------------------------------------------------------------------------------
    def time(self, fn: Callable[[], Any]) -> float:
        """Median milliseconds of one call of fn."""
        if self.device.type == "cuda":
            import triton.testing

            warmup, rep = (10, 30) if self.quick else (25, 100)
            return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
        if self.device.type == "npu":
            return _event_median(torch.npu, fn, reps=10 if self.quick else 50)
        return _wall_median(fn, reps=3 if self.quick else 5)

    def peak_mb(self, fn: Callable[[], Any]) -> Optional[float]:
        """Peak allocated memory (MiB) above what was allocated before fn ran; None on CPU."""
        mod = _accel(self.device)
        if mod is None:
            return None
        mod.synchronize()
        base = mod.memory_allocated(self.device)
        mod.reset_peak_memory_stats(self.device)
        fn()
        mod.synchronize()
        return (mod.max_memory_allocated(self.device) - base) / 2**20

    def progress(self, msg: str) -> None:
        if self.verbose:
            print(f"[bench {_time.perf_counter() - self.started:6.1f}s] {msg}", file=sys.stderr, flush=True)

    # ---- helpers for op modules -------------------------------------------------------------------
    def cases_of(self, mod: Any) -> list:
        """The cases of op benchmark module `mod` this run times: from its CPU_CASES on a CPU, else from its
        CASES (accelerator sizes), narrowed by --sizes or --quick (`select`)."""
        cpu = self.device.type == "cpu"
        return self.select(mod.CPU_CASES if cpu else mod.CASES, quick=mod.QUICK["cpu" if cpu else "gpu"])

    def failed(self, op: str, case: Any, provider: str, modes: Sequence[str], error: BaseException) -> list[dict]:
        """Rows for a provider that could not be set up for a case: one error row per mode, except for an
        optional baseline that does not import (`MissingBaseline`), which gets one row (mode "-", case "-",
        `missing: True`) the first time per op and none after."""
        if isinstance(error, MissingBaseline):
            key = (op, provider)
            if key in self.missing:
                return []
            self.missing.add(key)
            cause = error.__cause__
            reason = f"{type(cause).__name__}: {cause}" if cause is not None else str(error)
            return [row(op, "-", provider, "-", error=str(error), reason=reason, missing=True)]
        return [error_row(op, case, provider, mode, error) for mode in modes]

    def select(self, cases: Sequence[Any], quick: Optional[Sequence[Any]] = None) -> list:
        """The cases to run: those matching --sizes when given (a case matches a selection string when
        its `case_name` equals it or contains it), else `quick` (or the first case) in quick mode,
        else all of them."""
        if self.sizes:
            wanted = [s.replace(" ", "") for s in self.sizes]
            return [c for c in cases if any(w == case_name(c) or w in case_name(c) for w in wanted)]
        if self.quick:
            return list(quick) if quick is not None else list(cases[:1])
        return list(cases)

    def empty_cache(self) -> None:
        mod = _accel(self.device)
        if mod is not None:
            try:
                mod.empty_cache()
            except Exception:
                pass


def _wall_median(fn: Callable[[], Any], reps: int, budget_s: float = 0.2, max_reps: int = 100) -> float:
    """Median wall-clock ms over at least `reps` runs, more (up to max_reps) while within budget_s."""
    fn()  # warm-up (compilation, allocator)
    fn()
    times: list[float] = []
    start = _time.perf_counter()
    while len(times) < reps or (_time.perf_counter() - start < budget_s and len(times) < max_reps):
        t0 = _time.perf_counter()
        fn()
        times.append((_time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _event_median(mod, fn: Callable[[], Any], reps: int) -> float:
    for _ in range(3):
        fn()
    mod.synchronize()
    times = []
    for _ in range(reps):
        start, end = mod.Event(enable_timing=True), mod.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        mod.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def case_name(case: Any) -> str:
    """"8,1,8192,4096" for a tuple of ints; str(case) otherwise."""
    if isinstance(case, (tuple, list)):
        return ",".join(case_name(c) if isinstance(c, (tuple, list)) else str(c) for c in case).replace(" ", "")
    return str(case).replace(" ", "")


def measure_ceiling(device: torch.device, quick: bool = False) -> float:
    """Device-to-device copy bandwidth in TB/s, counting bytes read plus bytes written."""
    nbytes = (256 if quick else 1024) * 2**20 if device.type != "cpu" else (32 if quick else 128) * 2**20
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    src.fill_(1)
    dst = torch.empty_like(src)
    dst.fill_(0)  # touch the pages first: on CPU a fresh clone's page faults would dominate its time
    if device.type == "cpu":
        ms = _wall_median(lambda: dst.copy_(src), reps=5)
    else:
        ms = Context(device=device, quick=quick, verbose=False).time(lambda: dst.copy_(src))
    del src, dst
    return 2 * nbytes / (ms * 1e-3) / 1e12


def row(op: str, case: Any, provider: str, mode: str, **extra: Any) -> dict:
    r = {"op": op, "case": case_name(case) if not isinstance(case, str) else case, "provider": provider, "mode": mode}
    r.setdefault("ms", None)
    r.update(extra)
    return r


def error_row(op: str, case: Any, provider: str, mode: str, error: Any) -> dict:
    msg = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    return row(op, case, provider, mode, ms=None, error=msg.strip().splitlines()[0][:300] if msg.strip() else msg)


def _with_rates(r: dict, nbytes: Optional[float], flops: Optional[float], ceiling_tbps: Optional[float] = None) -> dict:
    """r with the rates of its ms: tbps (and pct_ceiling, given a measured ceiling) from nbytes, tflops from flops."""
    ms = r["ms"]
    if nbytes is not None:
        r["tbps"] = nbytes / (ms * 1e-3) / 1e12
        if ceiling_tbps and ceiling_tbps == ceiling_tbps:
            r["pct_ceiling"] = 100.0 * r["tbps"] / ceiling_tbps
    if flops is not None:
        r["tflops"] = flops / (ms * 1e-3) / 1e12
    return r


def measure(
    ctx: Context,
    op: str,
    case: Any,
    provider: str,
    mode: str,
    fn: Callable[[], Any],
    nbytes: Optional[float] = None,
    flops: Optional[float] = None,
    memory: bool = True,
    gpu_time: bool = False,
) -> dict:
    """Time fn (and its peak memory) into a row; nbytes gives tbps and pct_ceiling, flops gives tflops.
    gpu_time: the row "<provider> (GPU time)" holds `gpu_time_ms` of fn instead (no memory column).
    Any exception (OOM included) becomes the row's error."""
    if gpu_time:
        provider, memory = f"{provider} (GPU time)", False
    ctx.progress(f"{op} {case_name(case)} {provider} {mode}")
    try:
        ms = gpu_time_ms(fn) if gpu_time else ctx.time(fn)
        r = _with_rates(row(op, case, provider, mode, ms=ms), nbytes, flops, ctx.ceiling_tbps)
        if memory:
            r["peak_mb"] = ctx.peak_mb(fn)
        # Report each row as it lands: a run cut short by a time limit still shows what it measured.
        pct = f" {r['pct_ceiling']:.1f}% of copy" if r.get("pct_ceiling") is not None else ""
        mem = f" peak {r['peak_mb']:.0f} MB" if r.get("peak_mb") is not None else ""
        ctx.progress(f"  {op} {case_name(case)} {provider} {mode}: {ms:.4g} ms{pct}{mem}")
        return r
    except Exception as e:  # noqa: BLE001 - one provider failing must not end the run
        ctx.empty_cache()
        return error_row(op, case, provider, mode, e)


def alternated_rows(ctx: Context, op: str, case: Any, mode: str, steps: dict, *, nbytes: Optional[float] = None,
                    flops: Optional[float] = None, rounds: int = 5) -> list[dict]:
    """Wall clock of the providers' steps timed in turn, `rounds` times, each row "<provider> (alternating)"
    the median of its rounds. Small eager steps are host-bound, and the host's speed drifts over a run by
    more than the providers' difference (bench/NOTES.md neighborhood_attention run 26), so timing one
    provider after the other can rank them either way; alternating puts them under the same conditions."""
    times: dict = {name: [] for name in steps}
    try:
        for _ in range(rounds):
            for name, step in steps.items():
                times[name].append(ctx.time(step))
    except Exception as e:  # noqa: BLE001
        return [error_row(op, case, f"{name} (alternating)", mode, e) for name in steps]
    out = []
    for name, ms in times.items():
        median = statistics.median(ms)
        out.append(_with_rates(row(op, case, f"{name} (alternating)", mode, ms=median), nbytes, flops))
        ctx.progress(f"  {op} {case_name(case)} {name} (alternating) {mode}: {median:.4g} ms "
                     f"(rounds {', '.join(f'{x:.3f}' for x in ms)})")
    return out


class MissingBaseline(ImportError):
    """An optional baseline (Liger, fla, ...) that does not import: reported once per op, not per row."""


def optional_import(name: str):
    """The module, or raise MissingBaseline with a short message (see Context.failed)."""
    try:
        return importlib.import_module(name)
    except Exception as e:  # noqa: BLE001
        raise MissingBaseline(f"{name} not importable ({type(e).__name__}: {e})") from e


def gpu_kernel_times_us(fn: Callable[[], Any], reps: int = 10) -> dict:
    """Microseconds of device work per call of fn, by kernel (every kernel, copy and memset the
    profiler records, keyed by its name), averaged over `reps` calls after one warm-up call."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    times: dict = {}
    for event in prof.key_averages():
        if event.device_type.name == "CUDA":
            total = getattr(event, "device_time_total", 0.0) or getattr(event, "cuda_time_total", 0.0)
            times[event.key] = times.get(event.key, 0.0) + total / reps
    return times


def gpu_time_ms(fn: Callable[[], Any], reps: int = 10) -> float:
    """Milliseconds of device work per call of fn: the sum of gpu_kernel_times_us. For steps whose
    eager launches are host-bound this is what the GPU does, without the host overhead (CUDA-graph
    capture would show the same, but a provider that syncs inside would poison the capture state of
    the rest of the run)."""
    return sum(gpu_kernel_times_us(fn, reps).values()) / 1e3


def cuda_graph_step(forward: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor],
                    warmup: int = 3) -> Callable[[], None]:
    """The fwd+bwd step of forward(*inputs) (gradients of all inputs) captured once in a CUDA graph, as
    a callable that replays it: the step's wall clock without the host's per-call cost, as a training
    loop under CUDA graphs runs it. Fresh leaves, warm-up (which compiles and caches every kernel) and
    capture all on one side stream, so that no autograd node is tied to another stream. Only for
    providers known not to sync the host."""
    stream = _side_stream()
    with torch.cuda.stream(stream):
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        grad_out = torch.randn_like(forward(*leaves))

    def step():
        return torch.autograd.grad(forward(*leaves), leaves, grad_out)

    return _capture(step, stream, warmup)


def cuda_graph(fn: Callable[[], Any], warmup: int = 3) -> Callable[[], None]:
    """fn (e.g. a forward under no_grad) captured once in a CUDA graph, warmed up and captured on one side
    stream, as a callable that replays it. Only for callables known not to sync the host."""
    return _capture(fn, _side_stream(), warmup)


def _side_stream():
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    return stream


def _capture(fn: Callable[[], Any], stream, warmup: int) -> Callable[[], None]:
    """fn warmed up (kernels compiled and cached) and captured on `stream`, as graph.replay."""
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    return graph.replay


def grads_of(out: torch.Tensor, inputs: Iterable[torch.Tensor], grad_out: torch.Tensor) -> tuple:
    """torch.autograd.grad of out against grad_out over the inputs that require grad."""
    req = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    return torch.autograd.grad(out, req, grad_out, retain_graph=True)


def fwd_bwd_fns(forward: Callable[[], torch.Tensor], inputs: Sequence[torch.Tensor]) -> dict:
    """The three timed callables of a differentiable forward: fwd, bwd (on a saved graph), fwd+bwd."""
    req = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    out = forward()
    grad_out = torch.randn_like(out)

    def fwd():
        with torch.no_grad():
            return forward()

    def bwd():
        return torch.autograd.grad(out, req, grad_out, retain_graph=True)

    def fwd_bwd():
        return torch.autograd.grad(forward(), req, grad_out)

    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd_bwd}


def save_figure(fig, title: str, path):
    """fig with its title, laid out and written to path (PNG), then closed; returns path."""
    import matplotlib.pyplot as plt

    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
