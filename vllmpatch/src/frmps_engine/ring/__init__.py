"""The forward-state ring, engine side: the writer (see ringbuf/FORMAT.md)."""

from .tracker import DeltaTracker, RequestView, ViewParts
from .writer import RequestDelta, RingError, RingWriter, create_ring

__all__ = ["create_ring", "RingWriter", "RequestDelta", "DeltaTracker", "RequestView", "RingError", "ViewParts"]
