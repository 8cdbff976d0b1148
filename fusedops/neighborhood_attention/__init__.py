"""neighborhood_attention: flash-style sparse neighborhood attention over 1, 2 or 3 spatial axes."""

from .context_parallel import context_parallel_neighborhood_attention
from .module import NeighborhoodAttention1d, NeighborhoodAttention2d, NeighborhoodAttention3d
from .op import neighborhood_attention

__all__ = ["context_parallel_neighborhood_attention", "NeighborhoodAttention1d", "NeighborhoodAttention2d", "NeighborhoodAttention3d", "neighborhood_attention"]
