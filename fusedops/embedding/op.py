"""Registration of fusedops::embedding and fusedops::embedding_backward, and the wrapper."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from fusedops import internals
from fusedops.launch import launch
from fusedops.numerics import accumulate_dtype
from fusedops.registry import fused_op
from fusedops.targets import Target, target_for
from fusedops.validation import as_int, check_float

from . import reference
from .kernels import (
    embedding_bwd_kernel,
    embedding_bwd_merge_kernel,
    embedding_bwd_scan_kernel,
    embedding_fwd_kernel,
    embedding_run_keys_kernel,
    embedding_run_offsets_kernel,
)
from .plan import MAX_LOG_TOKENS, OFFSETS_BLOCK, RUN_BLOCK, backward_plan, forced_plan, make_plan, run_key_dtype

INDEX_DTYPES = (torch.int32, torch.int64)
CHECK_BOUNDS = ("device", "host")


def check_bounds_mode(check_bounds) -> str:
    if not isinstance(check_bounds, str) or check_bounds not in CHECK_BOUNDS:
        raise ValueError(f"check_bounds must be 'device' (the default: the kernel asserts, no host sync) or 'host' "
                         f"(a synchronising check raising IndexError), got {check_bounds!r}")
    return check_bounds


def check_indices(indices: Tensor) -> None:
    if not isinstance(indices, torch.Tensor):
        raise ValueError(f"indices must be a tensor, got {type(indices).__name__}")
    if indices.dtype not in INDEX_DTYPES:
        raise ValueError(f"indices must be int32 or int64, got {indices.dtype}")


def normalize_padding_idx(padding_idx: Optional[int], num_weights: int) -> int:
    """padding_idx in [0, V), or -1 for none; negative values count from the end, as in torch."""
    if padding_idx is None:
        return -1
    padding_idx = as_int("padding_idx", padding_idx)
    if not -num_weights <= padding_idx < num_weights:
        raise ValueError(f"padding_idx must be within [-{num_weights}, {num_weights}) (num_embeddings), got {padding_idx}")
    return padding_idx + num_weights if padding_idx < 0 else padding_idx


def check_args(weight: Tensor, indices: Tensor, padding_idx: Optional[int]) -> int:
    """Validates the arguments (no data is read) and returns the normalised padding index."""
    check_float("weight", weight)
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [num_embeddings, embedding_dim], got shape {tuple(weight.shape)}")
    check_indices(indices)
    if indices.device != weight.device:
        raise ValueError(f"indices is on {indices.device} but weight is on {weight.device}")
    return normalize_padding_idx(padding_idx, weight.shape[0])


def first_out_of_range(indices: Tensor, num_weights: int) -> Optional[int]:
    """The first index outside [0, num_weights), or None. Reads the data (a sync on a GPU)."""
    if indices.numel() == 0:
        return None
    lo, hi = torch.stack(torch.aminmax(indices.reshape(-1))).tolist()  # one reduction, one sync
    if lo >= 0 and hi < num_weights:
        return None
    flat = indices.reshape(-1)
    return int(flat[(flat < 0) | (flat >= num_weights)][0])


def raise_if_out_of_range(indices: Tensor, num_weights: int) -> None:
    bad = first_out_of_range(indices, num_weights)
    if bad is not None:
        raise IndexError(f"indices holds {bad}, outside the weight's rows [0, {num_weights})")


def check_cpu_indices(indices: Tensor, num_weights: int) -> None:
    """The bounds check of CPU indices, which costs no synchronisation there (on a GPU or NPU the
    kernels assert on the device): IndexError naming the first bad value; traced by torch.compile or
    export, an assert inside the graph, so the compiled graph refuses a bad index too."""
    if indices.device.type != "cpu":
        return
    if internals.fake_tensor(indices):
        in_range = ((indices >= 0) & (indices < num_weights)).all()
        torch._assert_async(in_range, f"fusedops.embedding: indices outside the weight's rows [0, {num_weights})")
    else:
        raise_if_out_of_range(indices, num_weights)


def flat_indices(indices: Tensor) -> tuple[Tensor, int]:
    """indices as one dim and its stride: a view where one stride walks them all (a step slice, an
    expanded scalar), else a copy. The kernels read index t at t * stride."""
    flat = indices.reshape(-1)
    return flat, flat.stride(0)


def _forward(weight: Tensor, indices: Tensor, target: Target) -> Tensor:
    num_weights, dim = weight.shape
    out = weight.new_empty((*indices.shape, dim))
    tokens = indices.numel()
    if tokens == 0 or dim == 0:
        return out
    plan = forced_plan(make_plan(target, tokens, dim, weight.element_size(), backward=False), "fwd")
    flat, stride = flat_indices(indices)
    launch(
        embedding_fwd_kernel, (plan.grid,),
        dict(idx_ptr=flat, w_ptr=weight, out_ptr=out, N=tokens, V=num_weights, D=dim, IDX_S=stride,
             W_S0=weight.stride(0), W_S1=weight.stride(1)),
        dict(BLOCK_T=plan.block_rows, BLOCK_D=plan.block_d, num_warps=plan.num_warps),
    )
    return out


def _search_steps(tokens: int) -> int:
    """Halvings of the run offsets' binary search: exactly enough for a known batch size; for a symbolic
    one (a dynamic-shape graph serves every batch) enough for any: the steps longer than the batch load
    nothing but still cost time (the kernel took 6.7 us with 31 halvings at 16K tokens on the H100)."""
    return tokens.bit_length() if isinstance(tokens, int) else MAX_LOG_TOKENS


def _sorted_runs(indices: Tensor, num_weights: int, target: Target) -> tuple[Tensor, Tensor, Tensor]:
    """(keys, perm, offsets): the indices sorted stably, the token positions in that order, and where
    each index's run starts in it ([V + 1]). Out-of-range indices become -1 first, so they sort before
    every run, and the keys take the narrowest integer type the plan allows (a radix sort of 16-bit
    keys makes half the passes of 32-bit ones). All sizes are known on the host: nothing here syncs."""
    flat, stride = flat_indices(indices)
    tokens = flat.numel()
    if isinstance(tokens, int) and tokens >= 2**MAX_LOG_TOKENS:
        raise ValueError(f"indices: the backward sorts at most 2**{MAX_LOG_TOKENS} - 1 indices, got {tokens}")
    key_dtype = run_key_dtype(target, num_weights)
    if tokens == 0:
        return flat.new_zeros(1, dtype=key_dtype), flat.new_zeros(1), flat.new_zeros(num_weights + 1)
    keys = flat.new_empty(tokens, dtype=key_dtype)
    launch(embedding_run_keys_kernel, (target.grid_size(-(-tokens // RUN_BLOCK)),),
           dict(idx_ptr=flat, keys_ptr=keys, N=tokens, V=num_weights, IDX_S=stride), dict(BLOCK=RUN_BLOCK))
    keys, perm = torch.sort(keys, stable=True)
    offsets = flat.new_empty(num_weights + 1, dtype=torch.int64)
    launch(embedding_run_offsets_kernel, (target.grid_size(-(-(num_weights + 1) // OFFSETS_BLOCK)),),
           dict(keys_ptr=keys, offs_ptr=offsets, N=tokens, V=num_weights),
           dict(LOG_N=_search_steps(tokens), BLOCK=OFFSETS_BLOCK))
    return keys, perm, offsets


def _backward(
    grad_out: Tensor, indices: Tensor, num_weights: int, padding_idx: int, scale_grad_by_freq: bool, target: Target
) -> Tensor:
    """grad_weight on the plan's path: the scan kernel (a small batch, outside a CUDA graph capture) or the
    sort path, the same bits."""
    dim = grad_out.shape[-1]
    if num_weights == 0 or dim == 0:
        return grad_out.new_empty((num_weights, dim))
    tokens = indices.numel()
    capturing = grad_out.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    plan = backward_plan(target, num_weights, dim, grad_out.element_size(), tokens, capturing)
    run = _scan_backward if plan.scans(tokens) else _sort_backward
    return run(grad_out, indices, num_weights, padding_idx, scale_grad_by_freq, target, plan)


def _scan_backward(grad_out, indices, num_weights, padding_idx, scale_grad_by_freq, target, plan) -> Tensor:
    """A zeroed grad_weight, then embedding_bwd_scan_kernel: no sort, one launch."""
    dim = grad_out.shape[-1]
    grad_weight = grad_out.new_zeros((num_weights, dim))
    tokens = indices.numel()
    if tokens == 0:
        return grad_weight
    flat, stride = flat_indices(indices)
    grad2d = grad_out.reshape(-1, dim)
    launch(
        embedding_bwd_scan_kernel, (plan.grid,),
        dict(idx_ptr=flat, g_ptr=grad2d, gw_ptr=grad_weight, N=tokens, V=num_weights, D=dim, IDX_S=stride,
             G_S0=grad2d.stride(0), G_S1=grad2d.stride(1), PAD=padding_idx),
        dict(SCALE=scale_grad_by_freq, BLOCK_D=plan.block_d, SCAN_BLOCK=plan.scan_block, CHUNK=plan.run_chunk,
             F64=grad_out.dtype == torch.float64, num_warps=plan.num_warps),
    )
    return grad_weight


def _sort_backward(grad_out, indices, num_weights, padding_idx, scale_grad_by_freq, target, plan) -> Tensor:
    """The sorted runs, then embedding_bwd_kernel (and embedding_bwd_merge_kernel for runs longer than a
    chunk), which write every row of grad_weight exactly once."""
    dim = grad_out.shape[-1]
    grad_weight = grad_out.new_empty((num_weights, dim))
    tokens = indices.numel()
    keys, perm, offsets = _sorted_runs(indices, num_weights, target)
    grad2d = grad_out.reshape(-1, dim)
    chunk = plan.run_chunk
    # Partial sums of the chunks of runs longer than one chunk (see embedding_bwd_merge_kernel); a batch
    # of at most one chunk has no such run, and skips the buffer and the merge.
    split = not isinstance(tokens, int) or tokens > chunk
    part = grad_out.new_empty((2 * -(-tokens // chunk), dim) if split else (1, 1),
                              dtype=accumulate_dtype(grad_out.dtype))
    launch(
        embedding_bwd_kernel, (plan.grid,),
        dict(g_ptr=grad2d, keys_ptr=keys, perm_ptr=perm, offs_ptr=offsets, gw_ptr=grad_weight, part_ptr=part,
             V=num_weights, D=dim, N=tokens, G_S0=grad2d.stride(0), G_S1=grad2d.stride(1), PAD=padding_idx,
             ZEROS_PER_RUN=plan.zeros_per_run(num_weights, tokens)),
        dict(SCALE=scale_grad_by_freq, BLOCK_R=plan.block_rows, BLOCK_D=plan.block_d, EVICT=plan.evict, CHUNK=chunk,
             F64=grad_out.dtype == torch.float64, num_warps=plan.num_warps,
             **({"maxnreg": plan.max_registers} if plan.max_registers else {})),
    )
    if split:
        merge_items = -(-tokens // chunk) * -(-dim // plan.block_d)
        launch(embedding_bwd_merge_kernel, (target.grid_size(merge_items),),
               dict(part_ptr=part, keys_ptr=keys, offs_ptr=offsets, gw_ptr=grad_weight, V=num_weights, D=dim,
                    N=tokens, PAD=padding_idx),
               dict(SCALE=scale_grad_by_freq, BLOCK_D=plan.block_d, CHUNK=chunk, num_warps=plan.num_warps))
    return grad_weight


def _run_checked(
    weight: Tensor, indices: Tensor, padding_idx: Optional[int], scale_grad_by_freq: bool = False
) -> Tensor:
    """The op on checked arguments, CPU indices bounds-checked here: kernels under the device's plan, or
    the reference. scale_grad_by_freq only matters to the backward."""
    check_cpu_indices(indices, weight.shape[0])
    target = target_for(weight.device, weight.dtype)
    if target is None:
        return reference.embedding(weight, indices, normalize_padding_idx(padding_idx, weight.shape[0]))
    return _forward(weight, indices, target)


def _run_backward(grad_out, indices, num_weights, padding_idx, scale_grad_by_freq):
    """The backward op on checked arguments."""
    pad = normalize_padding_idx(padding_idx, num_weights)
    target = target_for(grad_out.device, grad_out.dtype)
    if target is None:
        return reference.embedding_backward(grad_out, indices, num_weights, pad, scale_grad_by_freq)
    return _backward(grad_out, indices, num_weights, pad, scale_grad_by_freq, target)


def check_backward_args(grad_out: Tensor, indices: Tensor, num_weights: int, padding_idx: Optional[int]) -> None:
    check_float("grad_out", grad_out)
    check_indices(indices)
    if grad_out.dim() != indices.dim() + 1 or grad_out.shape[:-1] != indices.shape:
        raise ValueError(
            f"grad_out must have shape [*indices.shape, D] = [{', '.join(map(str, indices.shape))}, D], "
            f"got {tuple(grad_out.shape)}"
        )
    if indices.device != grad_out.device:
        raise ValueError(f"indices is on {indices.device} but grad_out is on {grad_out.device}")
    if num_weights < 0:
        raise ValueError(f"num_weights must be >= 0, got {num_weights}")
    normalize_padding_idx(padding_idx, num_weights)  # raises naming it


def _backward_fake(grad_out, indices, num_weights, padding_idx, scale_grad_by_freq):
    check_backward_args(grad_out, indices, num_weights, padding_idx)
    return grad_out.new_empty((num_weights, grad_out.shape[-1]))


def _setup_backward_context(ctx, inputs, output):
    grad_out, indices, num_weights, padding_idx, scale_grad_by_freq = inputs
    ctx.save_for_backward(indices)
    ctx.num_weights, ctx.padding_idx, ctx.scale_grad_by_freq = num_weights, padding_idx, scale_grad_by_freq


def _double_backward_rule(ctx, grad_grad_weight):
    """embedding_backward is linear in grad_out: d<G, backward(g)>/dg_t = G[indices_t], zero where
    indices_t is padding_idx (or out of range), divided by the count of indices_t in the batch with
    scale_grad_by_freq. A gather, so the forward op again (and the counts are a backward of ones):
    double backward (Hessian-vector products, gradient penalties on the weight) works as with
    torch.nn.Embedding, deterministic and differentiable once more."""
    if not ctx.needs_input_grad[0]:
        return None, None, None, None, None
    (indices,) = ctx.saved_tensors
    gg = grad_grad_weight if grad_grad_weight.stride(-1) == 1 else grad_grad_weight.contiguous()
    grad = embedding_op(gg, indices, None, False)
    pad = normalize_padding_idx(ctx.padding_idx, ctx.num_weights)
    if pad >= 0:
        grad = grad * (indices != pad).unsqueeze(-1).to(grad.dtype)
    if ctx.scale_grad_by_freq:
        ones = torch.ones((*indices.shape, 1), dtype=torch.float32, device=indices.device)
        counts = embedding_backward_op(ones, indices, ctx.num_weights, None, False)
        per_token = embedding_op(counts, indices, None, False).clamp_min(1)
        grad = (grad.to(accumulate_dtype(grad.dtype)) / per_token).to(grad.dtype)
    return grad, None, None, None, None


@fused_op("embedding_backward", fake=_backward_fake, run=_run_backward, setup_context=_setup_backward_context,
          backward=_double_backward_rule)
def embedding_backward_op(
    grad_out: Tensor, indices: Tensor, num_weights: int, padding_idx: Optional[int], scale_grad_by_freq: bool
) -> Tensor:
    """The weight gradient of embedding, [num_weights, D] in grad_out's dtype. Deterministic, no
    atomics: each run of equal indices is summed in fp32 (fp64 for float64) in token order, by chunks of
    the plan's run_chunk tokens added in chunk order, and its row stored once. Two paths give the same
    bits: a stable sort of the indices, then one launch that stores each run's row and zeros to the rows
    no index names (a second one merges runs longer than a chunk); or, for a batch of at most the plan's
    scan_tokens, a zeroed grad_weight and one launch in which the first token of each index scans the
    batch for its run (no sort). An index outside [0, num_weights) is refused as by the forward op."""
    check_backward_args(grad_out, indices, num_weights, padding_idx)
    check_cpu_indices(indices, num_weights)
    return _run_backward(grad_out, indices, num_weights, padding_idx, scale_grad_by_freq)


def _fake(weight, indices, padding_idx, scale_grad_by_freq):
    check_args(weight, indices, padding_idx)
    return weight.new_empty((*indices.shape, weight.shape[1]))


def _setup_context(ctx, inputs, output):
    weight, indices, padding_idx, scale_grad_by_freq = inputs
    ctx.save_for_backward(indices)
    ctx.num_weights = weight.shape[0]
    ctx.padding_idx = padding_idx
    ctx.scale_grad_by_freq = scale_grad_by_freq


def _backward_rule(ctx, grad_out):
    if not ctx.needs_input_grad[0]:
        return None, None, None, None
    (indices,) = ctx.saved_tensors
    grad_weight = embedding_backward_op(grad_out, indices, ctx.num_weights, ctx.padding_idx, ctx.scale_grad_by_freq)
    return grad_weight, None, None, None


@fused_op("embedding", fake=_fake, run=_run_checked, setup_context=_setup_context, backward=_backward_rule)
def embedding_op(weight: Tensor, indices: Tensor, padding_idx: Optional[int], scale_grad_by_freq: bool) -> Tensor:
    """Row gather out = weight[indices]. See `fusedops.embedding` for shapes and semantics. An
    out-of-range index raises IndexError on CPU tensors (RuntimeError from the in-graph assert when
    traced) and fails a device-side assert in the kernel on a GPU."""
    check_args(weight, indices, padding_idx)
    return _run_checked(weight, indices, padding_idx)


def embedding(
    indices: Tensor,
    weight: Tensor,
    padding_idx: Optional[int] = None,
    scale_grad_by_freq: bool = False,
    *,
    max_norm: Optional[float] = None,
    norm_type: float = 2.0,
    sparse: bool = False,
    check_bounds: str = "device",
) -> Tensor:
    """Embedding lookup with `torch.nn.functional.embedding` semantics: ``out = weight[indices]``.

    Args:
        indices: int32 or int64 tensor of any shape (empty included), on weight's device.
        weight: [V, D] float32/float16/bfloat16/float64. Rows may be strided (e.g. a column slice of a
            larger matrix); nothing is copied.
        padding_idx: that row's gradient is zero (its forward value is returned as stored).
            Negative values count from the end, as in torch.
        scale_grad_by_freq: divide each row's gradient by how often its index occurs in the batch.
        max_norm, sparse: not supported; passing max_norm or sparse=True raises ValueError (norm_type,
            which only max_norm uses, is accepted for torch's keyword signature).
        check_bounds: how an index outside [0, V) is refused; it is never ignored. "device" (the
            default) never synchronises the host and is CUDA-graph capturable: on a GPU the kernel
            fails a device-side assert, as torch.nn.functional.embedding does (the CUDA error
            surfaces at the next synchronisation and leaves the CUDA context unusable). "host" reads
            the indices before the launch (one reduction and a host sync) and raises IndexError
            naming the first offending value: for debugging. On CPU tensors both raise that
            IndexError (in a torch.compile'd CPU graph, an in-graph assert raising RuntimeError).

    Returns:
        [*indices.shape, D] in weight's dtype.

    Differentiable in weight; the backward is the op ``fusedops::embedding_backward``
    (deterministic, bitwise reproducible, no atomics, fp32 accumulation, fp64 for float64), itself
    differentiable in its output gradient, so double backward (Hessian-vector products) works.
    Raises ValueError naming the argument on bad input.
    """
    if max_norm is not None:
        raise ValueError("max_norm is not supported by fusedops.embedding (renormalise the weight yourself)")
    if sparse:
        raise ValueError("sparse=True is not supported by fusedops.embedding; the gradient is dense")
    if not isinstance(scale_grad_by_freq, bool):
        raise ValueError(f"scale_grad_by_freq must be a bool, got {scale_grad_by_freq!r} (it is the 4th positional "
                         "argument here, where torch.nn.functional.embedding has max_norm)")
    if padding_idx is not None:
        padding_idx = as_int("padding_idx", padding_idx)
    check_bounds_mode(check_bounds)
    check_args(weight, indices, padding_idx)
    if type(weight) is not Tensor and type(weight) is not torch.nn.Parameter:
        check_vocab_parallel_indices(indices, weight, check_bounds)
    if check_bounds == "host" and indices.device.type not in ("cpu", "meta") and not torch.compiler.is_compiling():
        raise_if_out_of_range(indices, weight.shape[0])
    return embedding_op(weight, indices, padding_idx, scale_grad_by_freq)


def check_vocab_parallel_indices(indices, weight, check_bounds: str) -> None:
    """A DTensor weight sharded on its rows (vocabulary parallel): DTensor hands each rank's op only the indices of
    that rank's rows (the rule's _MaskPartial turns the others into a zero row), so an index outside [0, V) would
    reach no rank's bounds check and come back as a zero row. Each rank checks its local indices here instead: an
    IndexError naming the value on CPU or with check_bounds="host", else an assert on the device (no host sync)."""
    if not any(p.is_shard(0) for p in getattr(weight, "placements", ())):
        return
    local = indices.to_local() if hasattr(indices, "to_local") else indices
    num_weights = weight.shape[0]
    if (local.device.type == "cpu" or check_bounds == "host") and not torch.compiler.is_compiling():
        raise_if_out_of_range(local, num_weights)
    elif local.numel():
        torch._assert_async(((local >= 0) & (local < num_weights)).all(),
                            f"fusedops.embedding: indices outside the weight's rows [0, {num_weights})")
