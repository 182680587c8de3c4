"""vLLM's worker extension for frmps's tensor-parallel engines (tp.py).

A tensor-parallel engine's ranks run in worker processes that vLLM's
MultiprocExecutor starts with ``spawn`` (tp.py says why not ``fork``). vLLM loads
its general plugins there through Python's entry points, which exist only where
frmps_engine is installed as a package — not where it runs from a source tree on
PYTHONPATH. The engine therefore names this class as vLLM's
``worker_extension_cls``: vLLM imports it in every worker before it builds the
worker (``WorkerWrapperBase.init_worker``), and the import registers frmps's
plugin, so the ``tp-worker-pools`` patch and the placement patches are in place
before ``Worker.init_device`` and the model load.
"""

from __future__ import annotations

import logging
import os
import sys

from ..cli import LOG_FORMAT
from .envpolicy import pin_inductor_deterministic
from .plugin import register
from .triton_watch import install_process_watch


def worker_logging() -> None:
    """frmps's lines of this rank (its pools, its placement digests) to stderr, which
    vLLM prefixes with the worker's name and the supervisor files in the engine's
    log: a spawned worker starts with logging unconfigured, and vLLM configures its
    own logger only. Only frmps's logger: vLLM's lines keep their own handler."""
    log = logging.getLogger("frmps_engine")
    if log.handlers:
        return
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(logging.Formatter(LOG_FORMAT))
    log.addHandler(h)
    log.setLevel(logging.INFO)
    log.propagate = False


worker_logging()
register()
install_process_watch()  # this rank's Triton compiles (rank 0 logs its start line: tp.rank_triton_summary)
pin_inductor_deterministic(os.environ)  # under --exact: this rank compiles as every other engine's does


class FrmpsTpWorker:
    """Mixed into vLLM's Worker; it adds no attribute (vLLM refuses an extension
    whose names clash with the worker's). The rank's work runs through
    ``collective_rpc`` callables (tp.py)."""

