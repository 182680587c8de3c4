"""frmps adapter for vLLM 0.26.0 and 0.33.0 (exactly those; see ``version.py``; what
differs between them is in ``compat/``).

Loaded by vLLM through the ``vllm.general_plugins`` entry point
(``frmps = frmps_engine.vllm.plugin:register``), in every process vLLM starts.

Layout: the vLLM-facing classes are thin (``scheduler``, ``sleep_backend``,
``engine``, ``patches``); the logic they call lives in plain modules that do
not import vLLM (``version``, ``compat``, ``state``, ``adoption``, ``pools``,
and ``allocation``, which needs torch only) so it can be tested without it.

Importing this package never imports vLLM.
"""

from __future__ import annotations

from .version import SUPPORTED_VLLM_VERSIONS, VllmVersionError, check_vllm_version

SLEEP_BACKEND_NAME = "frmps"
SCHEDULER_CLS = "frmps_engine.vllm.scheduler.FrmpsScheduler"
ASYNC_SCHEDULER_CLS = "frmps_engine.vllm.scheduler.FrmpsAsyncScheduler"

__all__ = [
    "SUPPORTED_VLLM_VERSIONS",
    "VllmVersionError",
    "check_vllm_version",
    "SLEEP_BACKEND_NAME",
    "SCHEDULER_CLS",
    "ASYNC_SCHEDULER_CLS",
]
