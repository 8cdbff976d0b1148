"""embedding: a 2D-tiled row gather with a deterministic, write-once backward."""

from .module import Embedding
from .op import embedding

__all__ = ["Embedding", "embedding"]
