"""DTensor sharding rules for every fusedops op, forward and backward.

With these, the ops take `torch.distributed.tensor.DTensor` arguments as torch's own ops do, and
`parallelize_module` / `fully_shard` work on the `fusedops.nn` modules: DTensor runs the op on each
rank's local shards and this module only says which placements compose (one mesh dimension at a
time; DTensor expands them over a whole mesh and redistributes inputs that arrive otherwise).

- attn_res: values sharded on any batch dim (tokens are independent), parameters replicated; the
  parameters' gradients come back `Partial` (a sum over the shards' tokens).
- embedding: column-wise (weight sharded on D), row-wise / vocabulary-parallel (weight sharded on V:
  indices outside a rank's rows contribute zero and the output is summed across ranks, torch's
  `aten.embedding` semantics through its `_MaskPartial` placement; without padding_idx, else the
  weight is gathered first), or indices sharded on any dim.
  The weight gradient of token-sharded indices is `Partial`, except under scale_grad_by_freq, whose
  counts need every token: there the indices are gathered first.
- Block AttnRes: attn_res_multi sharded on any batch dim of values, or on its queries (out and lse
  sharded on M; values replicated, their gradient `Partial`); attn_res_merge sharded on any batch dim,
  query and gain replicated (their gradients `Partial`). attn_res_merge_into writes in place and has no
  rule: DTensor arguments are refused there.
- neighborhood attention: sharded on batch, or on heads when both q's and k/v's head counts divide
  evenly over the mesh (GQA groups stay on one rank). A spatial axis needs the halo of its neighbours
  and is not a placement rule (context parallelism is its own function).

Registered when `fusedops` is imported, if torch.distributed is available.
"""

from __future__ import annotations

import math

import torch

try:
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.experimental import register_sharding
except ImportError:  # pragma: no cover - torch built without distributed
    register_sharding = None

try:  # vocabulary-parallel embedding uses torch's own masked-partial placement (private)
    from torch.distributed.tensor.placement_types import _MaskPartial
except ImportError:  # pragma: no cover
    _MaskPartial = None

R = None if register_sharding is None else Replicate()


def _ndim(spec) -> int:
    return len(spec.shape)


def _mesh_size(spec) -> int:
    return math.prod(spec.mesh.shape)


def _attn_res_batch_dims(values) -> range:
    """values' batch dims (between the source dim and the feature dim), as out's dims."""
    return range(_ndim(values) - 2)


def _optional(spec, placement):
    return None if spec is None else placement


def _attn_res_forward(values, query, norm_weight, eps, with_lse: bool):
    weight = None if norm_weight is None else R
    rules = [([R, R] if with_lse else [R], [R, R, weight, None])]
    for d in _attn_res_batch_dims(values):
        outs = [Shard(d), Shard(d)] if with_lse else [Shard(d)]
        rules.append((outs, [Shard(d + 1), R, weight, None]))
    return rules


def _attn_res_backward(grad_out, values, query, norm_weight, eps, need_values, need_query, need_norm_weight,
                       out=None, lse=None, grad_lse=None):
    weight = _optional(norm_weight, R)
    rules = [([R, R, R], [R, R, R, weight, None, None, None, None, _optional(out, R), _optional(lse, R),
                          _optional(grad_lse, R)])]
    need_weight = need_norm_weight and norm_weight is not None
    for d in _attn_res_batch_dims(values):
        # A gradient that is not asked for is an empty [0] tensor: replicated.
        outs = [Shard(d + 1) if need_values else R, Partial() if need_query else R, Partial() if need_weight else R]
        rules.append((outs, [Shard(d), Shard(d + 1), R, weight, None, None, None, None, _optional(out, Shard(d)),
                             _optional(lse, Shard(d)), _optional(grad_lse, Shard(d))]))
    return rules


def _attn_res_multi(values, queries, eps):
    rules = [([R, R], [R, R, None]), ([Shard(0), Shard(0)], [R, Shard(0), None])]  # replicated; queries split
    rules += [([Shard(d + 1), Shard(d + 1)], [Shard(d + 1), R, None]) for d in _attn_res_batch_dims(values)]
    return rules


def _attn_res_multi_backward(grad_out, grad_lse, values, queries, eps, need_values, need_queries):
    def grads(values_pl, queries_pl):  # a gradient not asked for is an empty [0] tensor: replicated
        return [values_pl if need_values else R, queries_pl if need_queries else R]

    rules = [(grads(R, R), [_optional(grad_out, R), _optional(grad_lse, R), R, R, None, None, None]),
             (grads(Partial(), Shard(0)),
              [_optional(grad_out, Shard(0)), _optional(grad_lse, Shard(0)), R, Shard(0), None, None, None])]
    for d in _attn_res_batch_dims(values):
        s = Shard(d + 1)
        rules.append((grads(s, Partial()), [_optional(grad_out, s), _optional(grad_lse, s), s, R, None, None, None]))
    return rules


def _attn_res_merge(out, lse, partial, query, addend, addend2, gain, eps, norm_eps):
    summed = addend is not None or addend2 is not None  # else the updated sum is an empty [0] tensor

    def args(s):
        return [s, s, s, R, _optional(addend, s), _optional(addend2, s), _optional(gain, R), None, None]

    rules = [([R, R], args(R))]
    rules += [([Shard(d), Shard(d) if summed else R], args(Shard(d))) for d in range(_ndim(out) - 1)]
    return rules


def _attn_res_merge_backward(grad_h, grad_partial, out, lse, partial, query, gain, eps, norm_eps, need_out,
                             need_lse, need_partial, need_query, need_gain):
    def outs(s, total):
        return [s if need_out else R, s if need_lse else R, s if need_partial else R, total if need_query else R,
                total if need_gain and gain is not None else R]

    def args(s):
        return [s, _optional(grad_partial, s), s, s, s, R, _optional(gain, R), None, None, None, None, None, None,
                None]

    rules = [(outs(R, R), args(R))]
    rules += [(outs(Shard(d), Partial()), args(Shard(d))) for d in range(_ndim(out) - 1)]
    return rules


def _embedding(weight, indices, padding_idx, scale_grad_by_freq):
    out_dim = _ndim(indices)
    rules = [([R], [R, R, None, None]), ([Shard(out_dim)], [Shard(1), R, None, None])]
    if _MaskPartial is not None and padding_idx is None:
        # One placement object for the output and the indices: they share the mask of foreign rows. Not
        # with a padding_idx: the local op would see a global row number beside its shard of rows.
        masked = _MaskPartial(offset_shape=torch.Size(int(s) for s in weight.shape), offset_dim=0)
        rules.append(([masked], [Shard(0), masked, None, None]))
    rules += [([Shard(d)], [R, Shard(d), None, None]) for d in range(_ndim(indices))]
    return rules


def _embedding_backward(grad_out, indices, num_weights, padding_idx, scale_grad_by_freq):
    rules = [([R], [R, R, None, None, None]), ([Shard(1)], [Shard(_ndim(grad_out) - 1), R, None, None, None]),
             ([Partial()], [Partial(), R, None, None, None])]  # linear in grad_out
    if not scale_grad_by_freq:  # the per-row counts of a shard are not the batch's
        rules += [([Partial()], [Shard(d), Shard(d), None, None, None]) for d in range(_ndim(indices))]
    return rules


def _na_shardable_dims(q, k) -> list[int]:
    """Batch always; heads when q's and k's head counts both split evenly (GQA groups stay whole)."""
    dims = [0]
    size = _mesh_size(q)
    if q.shape[1] % size == 0 and k.shape[1] % size == 0:
        dims.append(1)
    return dims


def _na_forward(q, k, v, kernel_size, dilation, stride, is_causal, scale, window, query_offset=None):
    rest = [None] * 7
    return [([R, R], [R, R, R, *rest])] + [
        ([Shard(d), Shard(d)], [Shard(d), Shard(d), Shard(d), *rest]) for d in _na_shardable_dims(q, k)]


def _na_backward(grad_out, grad_lse, q, k, v, out, lse, kernel_size, dilation, stride, is_causal, scale, window,
                 query_offset=None):
    rest = [None] * 7
    glse = None if grad_lse is None else R
    rules = [([R, R, R], [R, glse, R, R, R, R, R, *rest])]
    for d in _na_shardable_dims(q, k):
        s = Shard(d)
        rules.append(([s, s, s], [s, None if grad_lse is None else s, s, s, s, s, s, *rest]))
    return rules


def register() -> bool:
    """Register the sharding rules of every op (idempotent). False where torch has no DTensor."""
    if register_sharding is None:
        return False
    ops = torch.ops.fusedops
    register_sharding(ops.attn_res.default)(lambda v, q, w, eps: _attn_res_forward(v, q, w, eps, False))
    register_sharding(ops.attn_res_with_lse.default)(lambda v, q, w, eps: _attn_res_forward(v, q, w, eps, True))
    register_sharding(ops.attn_res_backward.default)(_attn_res_backward)
    register_sharding(ops.attn_res_multi.default)(_attn_res_multi)
    register_sharding(ops.attn_res_multi_backward.default)(_attn_res_multi_backward)
    register_sharding(ops.attn_res_merge.default)(_attn_res_merge)
    register_sharding(ops.attn_res_merge_backward.default)(_attn_res_merge_backward)
    register_sharding(ops.embedding.default)(_embedding)
    register_sharding(ops.embedding_backward.default)(_embedding_backward)
    register_sharding(ops.neighborhood_attention.default)(_na_forward)
    register_sharding(ops.neighborhood_attention_backward.default)(_na_backward)
    return True
