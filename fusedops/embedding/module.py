"""fusedops.nn.Embedding: a drop-in for torch.nn.Embedding backed by fusedops.embedding."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from fusedops.validation import check_bool

from .op import check_bounds_mode, embedding, normalize_padding_idx


def _check_unsupported(max_norm: Optional[float], sparse: bool) -> None:
    if max_norm is not None:
        raise ValueError("max_norm is not supported by fusedops.nn.Embedding (renormalise the weight yourself)")
    if sparse:
        raise ValueError("sparse=True is not supported by fusedops.nn.Embedding; the gradient is dense")


class Embedding(nn.Embedding):
    """A lookup table with torch.nn.Embedding's constructor, parameters and state_dict ("weight"),
    so checkpoints load both ways and `isinstance(m, torch.nn.Embedding)` holds.

    Supported: num_embeddings, embedding_dim, padding_idx (negative counts from the end),
    scale_grad_by_freq, _weight, _freeze, device, dtype. Not supported: max_norm and sparse=True
    (ValueError). Extra keyword: check_bounds (see `fusedops.embedding`).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: Optional[int] = None,
        max_norm: Optional[float] = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        _weight: Optional[Tensor] = None,
        _freeze: bool = False,
        device=None,
        dtype=None,
        *,
        check_bounds: str = "device",
    ) -> None:
        _check_unsupported(max_norm, sparse)
        check_bool("scale_grad_by_freq", scale_grad_by_freq)
        if padding_idx is not None:  # the op's own check (an int in range), then nn.Embedding's storage
            padding_idx = normalize_padding_idx(padding_idx, num_embeddings)
        super().__init__(
            num_embeddings, embedding_dim, padding_idx, None, norm_type, scale_grad_by_freq, False,
            _weight, _freeze, device, dtype,
        )
        self.check_bounds = check_bounds_mode(check_bounds)

    def forward(self, input: Tensor) -> Tensor:
        return embedding(input, self.weight, self.padding_idx, self.scale_grad_by_freq, check_bounds=self.check_bounds)

    @classmethod
    def from_pretrained(
        cls,
        embeddings: Tensor,
        freeze: bool = True,
        padding_idx: Optional[int] = None,
        max_norm: Optional[float] = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        *,
        check_bounds: str = "device",
    ) -> "Embedding":
        if not isinstance(embeddings, torch.Tensor) or embeddings.dim() != 2:
            raise ValueError("embeddings must be a 2-D tensor [num_embeddings, embedding_dim]")
        rows, cols = embeddings.shape
        return cls(
            rows, cols, padding_idx=padding_idx, max_norm=max_norm, norm_type=norm_type,
            scale_grad_by_freq=scale_grad_by_freq, sparse=sparse, _weight=embeddings, _freeze=freeze,
            check_bounds=check_bounds,
        )

    def extra_repr(self) -> str:
        return super().extra_repr() + ("" if self.check_bounds == "device" else f", check_bounds={self.check_bounds!r}")
