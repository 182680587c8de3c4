"""Engine side of frmps.

Subpackages:
- ``frmps_engine.ring``: the forward-state ring writer (format: ringbuf/FORMAT.md)
- ``frmps_engine.sdk``: control client, generation API server, memory backends
- ``frmps_engine.refengine``: the reference Qwen2 paged-KV engine
- ``frmps_engine._proto``: generated protobuf code (do not edit; ``make proto``)
"""

__version__ = "0.1.0"
