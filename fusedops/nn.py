"""nn.Module front ends of the fusedops ops."""

from fusedops.attn_res.module import AttnRes
from fusedops.block_attn_res.module import BlockAttnRes
from fusedops.embedding.module import Embedding
from fusedops.neighborhood_attention.module import (  # noqa: F401
    NeighborhoodAttention1d,
    NeighborhoodAttention2d,
    NeighborhoodAttention3d,
)

__all__ = ["AttnRes", "BlockAttnRes", "Embedding", "NeighborhoodAttention1d", "NeighborhoodAttention2d",
           "NeighborhoodAttention3d"]
