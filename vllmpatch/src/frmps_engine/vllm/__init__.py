"""frmps adapter for vLLM 0.33.0 (exactly; see ``version.py``).

Loaded by vLLM through the ``vllm.general_plugins`` entry point
(``frmps = frmps_engine.vllm.plugin:register``), in every process vLLM starts.

Layout: the vLLM-facing classes are thin (``scheduler``, ``sleep_backend``,
``engine``, ``patches``); the logic they call lives in plain modules that do
not import vLLM (``version``, ``state``, ``seeds``, ``adoption``, ``pools``,
and ``allocation``, which needs torch only) so it can be tested without it.

Importing this package never imports vLLM.
"""

from __future__ import annotations

from .version import REQUIRED_VLLM_VERSION, VllmVersionError, check_vllm_version

SLEEP_BACKEND_NAME = "frmps"
SCHEDULER_CLS = "frmps_engine.vllm.scheduler.FrmpsScheduler"
ASYNC_SCHEDULER_CLS = "frmps_engine.vllm.scheduler.FrmpsAsyncScheduler"

__all__ = [
    "REQUIRED_VLLM_VERSION",
    "VllmVersionError",
    "check_vllm_version",
    "SLEEP_BACKEND_NAME",
    "SCHEDULER_CLS",
    "ASYNC_SCHEDULER_CLS",
]
