"""Describing strided batch dims to a kernel without copying the tensor."""

from __future__ import annotations

from typing import Sequence

MAX_BATCH_DIMS = 3


def unit_last_stride(t):
    """t itself when its last dim has stride 1 (or at most one element), else a contiguous copy: the
    kernels vectorise along the last dim and take every other stride as it is."""
    if t is None or t.dim() == 0 or t.shape[-1] <= 1 or t.stride(-1) == 1:
        return t
    return t.contiguous()


def collapse_dims(sizes: Sequence[int], strides: Sequence[int]) -> tuple[list[int], list[int]]:
    """Merge neighbouring dims that one stride can walk (stride[i] == stride[i+1] * size[i+1]) and
    drop size-1 dims. Returns (sizes, strides), outermost first, at least one dim."""
    out_sizes: list[int] = []
    out_strides: list[int] = []
    for size, stride in zip(sizes, strides):
        if size == 1:
            continue
        if out_sizes and out_strides[-1] == stride * size:
            out_sizes[-1] *= size
            out_strides[-1] = stride
        else:
            out_sizes.append(size)
            out_strides.append(stride)
    if not out_sizes:
        return [1], [0]
    return out_sizes, out_strides


def batch_walk(name: str, sizes: Sequence[int], strides: Sequence[int]) -> tuple[list[int], list[int]]:
    """Sizes and strides of exactly MAX_BATCH_DIMS dims (padded with size 1 in front) that index every
    token of a batch of any layout the kernels take: after merging, at most three strided dims."""
    out_sizes, out_strides = collapse_dims(sizes, strides)
    if len(out_sizes) > MAX_BATCH_DIMS:
        raise ValueError(
            f"{name}'s batch dims {tuple(sizes)} with strides {tuple(strides)} need "
            f"{len(out_sizes)} separate strides; at most {MAX_BATCH_DIMS} are supported "
            f"(call .contiguous() on {name} first)"
        )
    pad = MAX_BATCH_DIMS - len(out_sizes)
    return [1] * pad + out_sizes, [0] * pad + out_strides


def walkable_sources(values):
    """values [N, *batch, D] itself when its last dim has stride 1 and its batch dims merge into the kernels'
    MAX_BATCH_DIMS strided dims (read in place: a bank view), else a contiguous copy: a rarer layout costs one
    copy, not an error."""
    sizes, _ = collapse_dims(values.shape[1:-1], values.stride()[1:-1])
    walkable = len(sizes) <= MAX_BATCH_DIMS and unit_last_stride(values) is values
    return values if walkable else values.contiguous()


def sources_walk(values) -> tuple[int, int, int, int, int]:
    """(S1, S2, ST0, ST1, ST2) of the kernels' batch walk over dims 1..-2 of values [N, *batch, D]."""
    sizes, strides = batch_walk("values", values.shape[1:-1], values.stride()[1:-1])
    return sizes[1], sizes[2], strides[0], strides[1], strides[2]
