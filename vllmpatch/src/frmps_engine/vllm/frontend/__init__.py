"""vLLM's own API server as frmps's frontend for ``--engine vllm`` (design (a) of
``vllmpatch/OPENAI.md``): the API server survives an engine's death, and the
engine-core client it uses is re-pointed at the promoted standby.

``ledger`` (plain, no vLLM import): the resume ledger — per open request the
request as sent, the output tokens the frontend received, its ring key and seed.
``client`` (vLLM-facing): ``FrmpsAsyncMPClient``, vLLM's ``AsyncMPClient`` with
the ledger on its input and output paths and a failover hold.

``engine_server`` (vLLM-facing, engine side): ``EngineCoreServer``, frmps's
VllmCore behind vLLM's engine-core sockets, and ``adopt_entries``, a promoted
engine's adoption of the ledger's resume entries.

``server`` (vLLM-facing, frontend process): ``python -m frmps_engine.cli
frontend``, vLLM's own API server (``vllm serve``'s code and flags) with this
client, and the ``Frontend`` gRPC service (engine lost / back, with the drain of
the dead engine's outputs before the resume set is read).

``HANDOVER_FENCE_CALL_ID``: an engine that hands over (a planned handover, not a
death) sends, after its last outputs, a utility output with this call id; the
client keeps a future registered under it, so that the drain before the resume
set ends when the fence arrives instead of after a quiet period. vLLM's own
reserved ids are -1 and -2.

The engine process that runs the engine server is ``frmps serve --engine vllm``
in core mode (``sdk/runner.py``), and the supervisor's side is
``supervisor/vllmfront/`` (``OPENAI.md``, "Status"). Importing this package
never imports vLLM.
"""

HANDOVER_FENCE_CALL_ID = -0x66726D7073  # "frmps"
