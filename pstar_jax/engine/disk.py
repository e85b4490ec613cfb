"""The disk tier's source of frozen chunks, as the engine sees it.

A disk-homed frozen chunk has no copy in host memory outside a staging buffer: the engine asks a
``ChunkReader`` for its bytes each time it fetches it. The bytes are the chunk's in every tier
(``pack_chunk(...).astype(compute dtype)``, padding zero), so stages, trace and numerics do not
change. The readers themselves read files, so they live in the io layer
(pstar_jax.io.frozen_disk: straight from safetensors, or from a cache of chunks); the run passes
one down to the engine.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np


class ChunkReader(Protocol):
    """Frozen chunks read from files into buffers the caller owns."""

    def nbytes(self, c: int) -> int:
        """Bytes of chunk ``c`` (its numel times the chunk dtype's itemsize)."""
        ...

    def read_into(self, c: int, out: np.ndarray) -> None:
        """Fill ``out`` (1-D, C-contiguous, the chunk's numel of the chunk dtype) with chunk ``c``."""
        ...

    def check_unchanged(self) -> None:
        """CheckpointError (one line) if a file read from changed since the reader was made."""
        ...
