"""Launch plans as data: per-op tables of launch configurations, a resolver, and forced configurations.

Each op keeps its table in ``fusedops/<op>/plans.json``: ``{"op": name, "kernels": {kernel: [param names]},
"rows": [row, ...]}``, one row per line. A row is

    {"kernel": "fwd", "vendor": "cuda", "arch": "sm90", "when": {"dtype": "16", "dim": [1, 4096]},
     "params": {"tile_elements": 8192, "num_warps": 4}, "run": "h100-2026-11-26-attn-res-grid"}

- ``vendor``: "cuda" or "ascend" (a Target's vendor).
- ``arch``: "*" (any device of the vendor: the heuristic rows an unseen GPU falls back to) or a name from
  `fusedops.targets` (CUDA: "sm<major><minor>", "sm90-h200" for an H200, which also matches "sm90" rows).
- ``when``: features of the launch, each an exact value or an inclusive ``[lo, hi]`` range (``hi`` null: no
  upper bound). The planner says which features it passes (dtype class "16" / "32" / "64", interpreted,
  head-dim or feature-dim buckets, size regimes, ...); a row naming a feature the planner does not pass is an
  error.
- ``params``: what the planner takes from the table (block shapes, warps, stages, register caps, kernel
  variants); the planner's arithmetic (what fits on chip, grids) stays in code.
- ``run``: the benchmark run that chose the row (bench/NOTES.md tells its story).

The resolver (`resolve`) takes, among the rows of the kernel and vendor whose ``when`` all match, the one of the
most specific arch (the device's own, then its family, then "*"), then the one with the most ``when`` keys; a
remaining tie goes to the row that comes first. Rows never change at run time: nothing is timed to pick one, so
one process computes the same bits as the next (configurations with different reduction orders are chosen
offline, by `python -m fusedops.bench tune`).

Forcing a configuration: ``with fusedops.plan_override(op, kernel, **params):`` (see `plan_override`); tests,
the tuner and users all use it. It is read on the host when a launch is planned (in eager calls, and when
torch.compile traces: a compiled graph keeps what was forced while it was traced).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

PACKAGE = Path(__file__).resolve().parent

# The architecture names a device resolves through, most specific first ("*" last).
ARCH_FAMILY = {"sm90-h200": ("sm90-h200", "sm90")}


def arch_chain(arch: str) -> tuple[str, ...]:
    """The arch names whose rows apply to a device of `arch`, most specific first, ending with "*"."""
    if not arch or arch == "*":
        return ("*",)
    return ARCH_FAMILY.get(arch, (arch,)) + ("*",)


def table_path(op: str) -> Path:
    return PACKAGE / op / "plans.json"


@functools.lru_cache(maxsize=None)
def table(op: str) -> dict:
    """An op's plan table, read once (`reload` drops what was read, after the tuner writes a table)."""
    with open(table_path(op)) as f:
        data = json.load(f)
    validate(data)
    return data


def reload() -> None:
    table.cache_clear()
    _override_keys.cache_clear()
    for hook in _RELOAD_HOOKS:
        hook()


_RELOAD_HOOKS: list = []


def on_reload(hook) -> None:
    """Call `hook` (a planner's cache_clear) whenever tables are reloaded."""
    _RELOAD_HOOKS.append(hook)


def validate(data: Mapping) -> None:
    """Raise ValueError on a malformed table: unknown kernels, params outside the kernel's names, rows that
    repeat another's (kernel, vendor, arch, when)."""
    kernels = data["kernels"]
    seen = set()
    for i, row in enumerate(data["rows"]):
        missing = {"kernel", "vendor", "arch", "when", "params", "run"} - set(row)
        if missing:
            raise ValueError(f"{data['op']} plan row {i} lacks {sorted(missing)}")
        if row["kernel"] not in kernels:
            raise ValueError(f"{data['op']} plan row {i} names unknown kernel {row['kernel']!r}")
        unknown = set(row["params"]) - set(kernels[row["kernel"]])
        if unknown:
            raise ValueError(f"{data['op']} plan row {i} ({row['kernel']}) has unknown params {sorted(unknown)}")
        key = (row["kernel"], row["vendor"], row["arch"], json.dumps(row["when"], sort_keys=True))
        if key in seen:
            raise ValueError(f"{data['op']} plan row {i} repeats another row's kernel, vendor, arch and when: {key}")
        seen.add(key)


def _matches(cond: Any, value: Any) -> bool:
    if isinstance(cond, list):
        lo, hi = cond
        return (lo is None or value >= lo) and (hi is None or value <= hi)
    return value == cond


def resolve_row(op: str, kernel: str, vendor: str, arch: str, features: Mapping[str, Any]) -> dict:
    """The table row that plans `kernel` of `op` for a device of `vendor` and `arch` with these features."""
    chain = arch_chain(arch)
    best, best_key = None, None
    rows = table(op)["rows"]
    if _CANDIDATES:  # the tuner's candidate rows come first, so they win ties
        rows = [r for o, r in _CANDIDATES if o == op] + list(rows)
    for i, row in enumerate(rows):
        if row["kernel"] != kernel or row["vendor"] != vendor or row["arch"] not in chain:
            continue
        when = row["when"]
        for name in when:
            if name not in features:
                raise ValueError(f"{op} plan row {i} ({kernel}) asks for feature {name!r}, which the planner does "
                                 f"not pass (it passes {sorted(features)})")
        if all(_matches(cond, features[name]) for name, cond in when.items()):
            key = (-chain.index(row["arch"]), len(when), -i)
            if best_key is None or key > best_key:
                best, best_key = row, key
    if best is None:
        raise ValueError(f"{op}: no plan row for kernel {kernel!r} on {vendor} {arch or '*'} with {dict(features)}")
    if _RECORDS is not None:
        _RECORDS.append((op, kernel, dict(features), best))
    return best


# The tuner's hooks (fusedops.bench.tune): rows tried ahead of the table, and a log of what was resolved.
_CANDIDATES: list = []
_RECORDS: list | None = None


@contextlib.contextmanager
def candidate_rows(op: str, rows: list) -> Iterator[None]:
    """Resolve `op` with `rows` ahead of its table (they win ties), planner caches cleared on entry and exit.
    For offline tuning only: what the tuner measures it writes into the table."""
    _CANDIDATES.extend((op, r) for r in rows)
    _clear_caches()
    try:
        yield
    finally:
        del _CANDIDATES[len(_CANDIDATES) - len(rows):]
        _clear_caches()


@contextlib.contextmanager
def recorded_resolutions() -> Iterator[list]:
    """A list that collects (op, kernel, features, row) for every row resolved inside the block (planner caches
    cleared on entry, so that every plan is resolved again)."""
    global _RECORDS
    saved, _RECORDS = _RECORDS, []
    _clear_caches()
    try:
        yield _RECORDS
    finally:
        _RECORDS = saved


def _clear_caches() -> None:
    for hook in _RELOAD_HOOKS:
        hook()


def resolve(op: str, kernel: str, target, **features) -> dict:
    """The params of the row that plans `kernel` of `op` on `target` (a fusedops.targets.Target)."""
    return resolve_row(op, kernel, target.vendor, target.arch, features)["params"]


def dtype_class(elem_size: int) -> str:
    """The dtype class a table keys on: "16" (fp16/bf16), "32" or "64"."""
    return {2: "16", 4: "32", 8: "64"}.get(elem_size, str(8 * elem_size))


# --- forced configurations -----------------------------------------------------------------------------------

# Per op and kernel, the params of the forced configuration; a stack of immutable snapshots.
_OVERRIDES: contextvars.ContextVar[tuple] = contextvars.ContextVar("fusedops_plan_overrides", default=())


@functools.lru_cache(maxsize=None)
def _override_keys(op: str) -> dict:
    return table(op).get("overrides", {})


@contextlib.contextmanager
def plan_override(op: str, kernel: str, **params) -> Iterator[None]:
    """Force `kernel` of `op` to launch with `params`, inside the block:

        with fusedops.plan_override("neighborhood_attention", "fwd", bm=(1, 8, 8), bn=(1, 16, 2), num_warps=4):
            out = fusedops.neighborhood_attention(q, k, v, 7)

    The keys each kernel takes are its table's "overrides" (`override_keys(op)`); a key outside them raises
    ValueError naming it. A forced configuration is taken as given (no on-chip budget shrink, no register cap
    unless named); what is not named is planned as usual. Blocks nest (the inner one's keys win) and restore
    on exit; the setting is per thread and per asyncio task (a contextvar). The backward of a call made inside
    the block is forced too, wherever it runs (autograd runs a CUDA backward on a thread of its own; see
    `carry_overrides`)."""
    keys = override_keys(op)
    if kernel not in keys:
        raise ValueError(f"plan_override: {op} has no kernel {kernel!r} to force (known: {sorted(keys)})")
    for name in params:
        if name not in keys[kernel]:
            raise ValueError(f"plan_override: {op} kernel {kernel!r} takes no key {name!r} "
                             f"(known: {sorted(keys[kernel])})")
    frozen = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in params.items()))
    token = _OVERRIDES.set(_OVERRIDES.get() + ((op, kernel, frozen),))
    try:
        yield
    finally:
        _OVERRIDES.reset(token)


def carry_overrides(setup_context: Callable, backward: Callable) -> tuple[Callable, Callable]:
    """An op's (setup_context, backward rule) made to plan the backward under the plan_override blocks that
    were in force at its forward, those in force where the backward runs coming after them (so they win). The
    autograd engine runs a CUDA backward on a device thread of its own, which sees none of the caller's
    contextvars: without this, a forced backward configuration would silently not apply on GPUs."""

    def setup(ctx, inputs, output):
        setup_context(ctx, inputs, output)
        ctx.plan_overrides = _OVERRIDES.get()

    @functools.wraps(backward)
    def run_backward(ctx, *grads):
        saved, current = getattr(ctx, "plan_overrides", ()), _OVERRIDES.get()
        if current[:len(saved)] == saved:  # the forward's blocks are still in force here (or there were none)
            return backward(ctx, *grads)
        token = _OVERRIDES.set(saved + current)
        try:
            return backward(ctx, *grads)
        finally:
            _OVERRIDES.reset(token)

    return setup, run_backward


def override_keys(op: str) -> dict:
    """{kernel: [keys plan_override takes]} of `op`."""
    try:
        return _override_keys(op)
    except FileNotFoundError:
        raise ValueError(f"plan_override: unknown op {op!r}") from None


def forced(op: str, kernel: str) -> dict:
    """The params forced on `kernel` of `op` by the enclosing plan_override blocks ({} when none)."""
    stack = _OVERRIDES.get()
    if not stack:
        return {}
    out: dict = {}
    for o, k, params in stack:
        if o == op and k == kernel:
            out.update(params)
    return out


def forced_key(op: str) -> tuple:
    """A hashable snapshot of what is forced on `op`'s kernels: part of the planners' cache keys."""
    stack = _OVERRIDES.get()
    return tuple(entry for entry in stack if entry[0] == op) if stack else ()
