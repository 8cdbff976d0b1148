"""fusedops.nn.NeighborhoodAttention1d/2d/3d: qkv projection, neighborhood attention, output projection."""

from __future__ import annotations

from typing import Sequence, Union

from torch import Tensor, nn

from fusedops.validation import check_bool, check_positive_int

from .op import MAX_HEAD_DIM, MIN_HEAD_DIM, check_window_args, neighborhood_attention


class _NeighborhoodAttentionNd(nn.Module):
    """Multi-head neighborhood self-attention over channels-last input x [B, *spatial, dim].

    qkv = Linear(dim, 3 dim, bias=qkv_bias) split into num_heads heads of dim // num_heads (8 to 256),
    `fusedops.neighborhood_attention` over the spatial axes (kernel_size, dilation, stride, is_causal,
    window as there: an int/bool or one per axis), then Linear(dim, dim, bias=proj_bias). Returns
    [B, *spatial, dim] in the Linear layers' dtype (float32, float16, bfloat16 or float64; under autocast, the
    autocast dtype). The heads are read from the projection in place, without a copy. Bad arguments (sizes that are
    not positive ints, flags that are not bools) raise ValueError naming the argument at construction; an
    input of the wrong shape, or with window="shifted" axes shorter than kernel_size * dilation, at the call.
    """

    spatial_dims = 0

    def __init__(
        self, dim: int, num_heads: int, kernel_size: Union[int, Sequence[int]],
        dilation: Union[int, Sequence[int]] = 1, stride: Union[int, Sequence[int]] = 1,
        is_causal: Union[bool, Sequence[bool]] = False, window: str = "shifted", qkv_bias: bool = True,
        proj_bias: bool = True, device=None, dtype=None,
    ) -> None:
        super().__init__()
        dim, num_heads = check_positive_int("dim", dim), check_positive_int("num_heads", num_heads)
        check_bool("qkv_bias", qkv_bias)
        check_bool("proj_bias", proj_bias)
        if dim % num_heads != 0:
            raise ValueError(f"dim ({dim}) must be a positive multiple of num_heads ({num_heads})")
        if not MIN_HEAD_DIM <= dim // num_heads <= MAX_HEAD_DIM:
            raise ValueError(f"dim // num_heads (the head dim, {dim} // {num_heads}) must be in "
                             f"[{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]")
        # Fail here, not at the first forward; the axis lengths are checked per input.
        check_window_args(self.spatial_dims, kernel_size, dilation, stride, is_causal, window)
        factory = {"device": device, "dtype": dtype}
        self.dim, self.num_heads, self.head_dim = dim, num_heads, dim // num_heads
        self.kernel_size, self.dilation, self.stride = kernel_size, dilation, stride
        self.is_causal, self.window = is_causal, window
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias, **factory)
        self.proj = nn.Linear(dim, dim, bias=proj_bias, **factory)

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != self.spatial_dims + 2 or x.shape[-1] != self.dim:
            raise ValueError(
                f"x must be [B, {', '.join(['L'] * self.spatial_dims)}, {self.dim}], got shape {tuple(x.shape)}"
            )
        spatial = x.shape[1:-1]
        qkv = self.qkv(x).unflatten(-1, (3, self.num_heads, self.head_dim))  # [B, *sp, 3, H, d]
        # heads-first views of the heads-last projection: the kernels read them without a copy
        perm = (0, self.spatial_dims + 1, *range(1, self.spatial_dims + 1), self.spatial_dims + 2)
        q, k, v = (qkv.select(-3, i).permute(perm) for i in range(3))
        out = neighborhood_attention(q, k, v, self.kernel_size, self.dilation, self.stride, self.is_causal,
                                     window=self.window)
        out = out.permute(0, *range(2, self.spatial_dims + 2), 1, self.spatial_dims + 2).reshape(
            x.shape[0], *spatial, self.dim)
        return self.proj(out)

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, num_heads={self.num_heads}, kernel_size={self.kernel_size}, "
                f"dilation={self.dilation}, stride={self.stride}, is_causal={self.is_causal}, window={self.window!r}")


class NeighborhoodAttention1d(_NeighborhoodAttentionNd):
    """Neighborhood self-attention over x [B, L, dim] (sequences)."""

    spatial_dims = 1


class NeighborhoodAttention2d(_NeighborhoodAttentionNd):
    """Neighborhood self-attention over x [B, H, W, dim] (images)."""

    spatial_dims = 2


class NeighborhoodAttention3d(_NeighborhoodAttentionNd):
    """Neighborhood self-attention over x [B, T, H, W, dim] (videos, volumes)."""

    spatial_dims = 3


for _cls in (NeighborhoodAttention1d, NeighborhoodAttention2d, NeighborhoodAttention3d):
    _cls.__doc__ += "\n\n    " + _NeighborhoodAttentionNd.__doc__  # the shared arguments, in help() too

__all__ = ["NeighborhoodAttention1d", "NeighborhoodAttention2d", "NeighborhoodAttention3d"]

