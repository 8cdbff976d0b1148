"""Every private torch and Triton internal the library relies on, in one place, probed once at import.

The eager fast path has two parts, each built on internals that a torch or Triton release may change:
  direct calls     an eager call runs an op's implementation without the dispatcher (~0.1-0.2 ms of host
                   time saved a call; fusedops.registry). Needs torch._library.triton's wrap_triton switch
                   and torch._C's dispatch-mode, torch-function-mode and functorch-interpreter queries.
  cached launches  a CUDA launch with an earlier launch's specialisation goes straight to the compiled
                   kernel's launcher (fusedops.launch). Needs triton.knobs (Triton >= 3.4), the compiled
                   kernel's run / function / packed_metadata, torch._C._cuda_getCurrentRawStream and
                   torch._C._cuda_getDevice.
Each part is on only where every internal it needs is found with the expected kind (a callable, an
attribute); otherwise it is off, and the public path runs: torch.ops through the dispatcher, kernel[grid]
through Triton's runner. A changed internal thus costs speed, never a crash or a wrong launch.

FUSEDOPS_FAST_PATH=0 (read at import) turns both parts off; CI runs the fast tier that way. `fast_path()`
says what is on and, for a part that is off, why.

Other internals, used with a public fallback where one exists:
  torch._functorch.config.decompose_custom_triton_ops   opaque_triton_ops() (no-op without it)
  torch._C._get_privateuse1_backend_name                 register_npu_kernels() (the Ascend backend's name)
  torch._subclasses.fake_tensor.is_fake                  fake_tensor(): tracing with fake tensors
"""

from __future__ import annotations

import os

import torch

FAST_PATH_ENV = "FUSEDOPS_FAST_PATH"
_REASONS: dict[str, str] = {}


def _switched_off() -> bool:
    raw = os.environ.get(FAST_PATH_ENV, "1").strip()
    if raw not in ("0", "1", ""):
        raise ValueError(f"{FAST_PATH_ENV} must be 0 or 1, got {raw!r}")
    return raw == "0"


def _lookup(path: str):
    """The object at a dotted path below torch or triton, or None."""
    root, *names = path.split(".")
    try:
        obj = __import__(root)
        for name in names:
            obj = getattr(obj, name)
        return obj
    except (ImportError, AttributeError):
        return None


def _probe(part: str, paths: tuple[str, ...]) -> bool:
    if _switched_off():
        _REASONS[part] = f"{FAST_PATH_ENV}=0"
        return False
    missing = [p for p in paths if not callable(_lookup(p))]
    if missing:
        _REASONS[part] = "not found: " + ", ".join(missing)
        return False
    return True


try:  # torch >= 2.6
    from torch._library.triton import is_wrap_triton_enabled, set_wrap_triton_enabled
except ImportError:  # pragma: no cover - older torch always traces through wrap_triton
    set_wrap_triton_enabled = None

    def is_wrap_triton_enabled() -> bool:
        return True

DIRECT_CALLS = set_wrap_triton_enabled is not None and _probe("direct calls", (
    "torch._C._len_torch_dispatch_stack", "torch._C._is_torch_function_mode_enabled",
    "torch._C._functorch.peek_interpreter_stack"))
if set_wrap_triton_enabled is None:
    _REASONS["direct calls"] = "not found: torch._library.triton.set_wrap_triton_enabled"

try:  # Triton >= 3.4; older ones (triton-ascend 3.2) launch through the runner
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover
    _knobs = None

CACHED_LAUNCHES = _knobs is not None and _probe("cached launches", (
    "torch._C._cuda_getCurrentRawStream", "torch._C._cuda_getDevice"))
if _knobs is None:
    _REASONS["cached launches"] = "not found: triton.knobs (Triton < 3.4)"


def fast_path() -> dict:
    """{"direct calls": True or the reason it is off, "cached launches": ...}."""
    return {"direct calls": DIRECT_CALLS or _REASONS.get("direct calls", "off"),
            "cached launches": CACHED_LAUNCHES or _REASONS.get("cached launches", "off")}


def modes_active() -> bool:
    """A torch dispatch mode, torch function mode or functorch transform is active (fake tensors, make_fx,
    FunctionalTensorMode, vmap, grad): an op must go through the dispatcher."""
    return bool(torch._C._len_torch_dispatch_stack() or torch._C._is_torch_function_mode_enabled()
                or torch._C._functorch.peek_interpreter_stack() is not None)


def launcher_of(compiled):
    """(run, function, packed metadata) of a compiled Triton kernel for a direct launch, or None where this
    Triton's compiled kernel does not have them (then launches go through its runner)."""
    if not CACHED_LAUNCHES or not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
        return None
    return compiled.run, compiled.function, compiled.packed_metadata


def launch_hooks_set() -> bool:
    """A Triton launch hook (a profiler such as proton) is set: launches must go through the runner."""
    runtime = _knobs.runtime
    return any(getattr(h, "calls", h) for h in (runtime.launch_enter_hook, runtime.launch_exit_hook))


def raw_stream(device: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device)


def current_cuda_device() -> int:
    return torch._C._cuda_getDevice()


def privateuse1_backend_name() -> str:
    return torch._C._get_privateuse1_backend_name()


def functorch_config():
    import torch._functorch.config as config

    return config


def fake_tensor(t) -> bool:
    """t is a FakeTensor (torch.compile / export tracing with fake tensors)."""
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)
