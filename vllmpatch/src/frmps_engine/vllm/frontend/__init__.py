"""vLLM's own API server as frmps's frontend for ``--engine vllm`` (design (a) of
``vllmpatch/OPENAI.md``): the API server survives an engine's death, and the
engine-core client it uses is re-pointed at the promoted standby.

``ledger`` (plain, no vLLM import): the resume ledger — per open request the
request as sent, the output tokens the frontend received, its ring key and seed.
``client`` (vLLM-facing): ``FrmpsAsyncMPClient``, vLLM's ``AsyncMPClient`` with
the ledger on its input and output paths and a failover hold.

Not built yet (``OPENAI.md``, "Status"): the launcher that runs vLLM's API server
with this client, the engine process speaking vLLM's engine-core protocol, the
supervisor's side. Importing this package never imports vLLM.
"""
