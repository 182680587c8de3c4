"""Engine SDK shared by every frmps engine adapter (reference engine, vLLM).

- ``control``: the control-socket client (framing, fds, handshake, command dispatch)
- ``memory``: shareable pool backends (``host-shm`` on CPU, ``cuda-vmm`` on GPU)
- ``engine_api``: what the runner needs from an engine (adapters implement it)
- ``loop``: the engine loop thread (steps the core, streams outputs, publishes the ring)
- ``genapi``: the generation gRPC server on a unix socket
- ``runner``: the engine process lifecycle (active / standby)
"""
