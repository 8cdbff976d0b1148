"""embedding: a 2D-tiled row gather with a deterministic backward (no atomics; a sort, or one scan kernel
for small batches, with the same bits)."""

from .module import Embedding
from .op import embedding

__all__ = ["Embedding", "embedding"]
