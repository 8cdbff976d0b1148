"""neighborhood_attention: flash-style sparse neighborhood attention over 1, 2 or 3 spatial axes."""

from .module import NeighborhoodAttention1d, NeighborhoodAttention2d, NeighborhoodAttention3d
from .op import neighborhood_attention

__all__ = ["NeighborhoodAttention1d", "NeighborhoodAttention2d", "NeighborhoodAttention3d", "neighborhood_attention"]
