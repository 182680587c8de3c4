"""The vLLM adapter's tests run against the real vLLM 0.33.0 package.

Where vLLM is not importable, or is another version, every test in this folder
is skipped with the reason (the adapter refuses other versions at runtime too).
Run them in the vLLM virtualenv built from requirements-vllm.lock (VLLM.md).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

REQUIRED = "0.33.0"


def _skip_reason() -> str | None:
    # vLLM picks its platform at import; on a machine without a GPU it must not
    # try to initialise CUDA for these scheduler-level tests.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # any import failure means: cannot test against vLLM here
        return f"vLLM adapter tests need vllm=={REQUIRED} importable: import vllm failed: {exc!r}"
    from importlib import metadata

    try:
        found = metadata.version("vllm")
    except metadata.PackageNotFoundError:
        # `import vllm` found only this test folder (a namespace package)
        return f"vLLM adapter tests need vllm=={REQUIRED} installed; it is not"
    if found.split("+", 1)[0] != REQUIRED:
        return f"vLLM adapter tests need vllm=={REQUIRED}, found {found}"
    return None


SKIP_REASON = _skip_reason()


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason=SKIP_REASON) if SKIP_REASON else None
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.torch)  # vLLM needs PyTorch
            if skip is not None:
                item.add_marker(skip)
