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

Not built yet (``OPENAI.md``, "Status"): the launcher that runs vLLM's API server
with this client, the engine process that runs the server (``frmps serve``), the
supervisor's side. Importing this package never imports vLLM.
"""
