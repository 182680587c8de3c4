"""The vLLM adapter's tests run against a real vLLM package of a supported
version (0.26.0 or 0.33.0; `make test` runs them against both).

Where vLLM is not importable, or is another version, every test in this folder
is skipped with the reason (the adapter refuses other versions at runtime too),
unless FRMPS_EXPECT_VLLM names the version that must be there: then a missing
or different vLLM fails the run instead of skipping it (CI sets it).
"""

from __future__ import annotations

import fcntl
import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from frmps_engine.vllm.version import SUPPORTED_VLLM_VERSIONS  # noqa: E402  (never imports vLLM)

EXPECTED = os.environ.get("FRMPS_EXPECT_VLLM", "")
WANTED = EXPECTED or " or ".join(SUPPORTED_VLLM_VERSIONS)


def _installed_vllm() -> str:
    """The installed vLLM's version ("" where none is)."""
    from importlib import metadata

    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return ""


def _skip_reason() -> str | None:
    # vLLM picks its platform at import; on a machine without a GPU it must not
    # try to initialise CUDA for these scheduler-level tests.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # any import failure means: cannot test against vLLM here
        return f"vLLM adapter tests need vllm {WANTED} importable: import vllm failed: {exc!r}"
    found = _installed_vllm()
    if not found:  # `import vllm` found only this test folder (a namespace package)
        return f"vLLM adapter tests need vllm {WANTED} installed; it is not"
    public = found.split("+", 1)[0]
    if public not in SUPPORTED_VLLM_VERSIONS or (EXPECTED and public != EXPECTED):
        return f"vLLM adapter tests need vllm {WANTED}, found {found}"
    return None


SKIP_REASON = _skip_reason()
INSTALLED_VLLM = _installed_vllm().split("+", 1)[0]
if SKIP_REASON and EXPECTED:
    raise pytest.UsageError(f"FRMPS_EXPECT_VLLM={EXPECTED}: {SKIP_REASON}")


@pytest.fixture(scope="session", autouse=True)
def _vllm_model_info_cached():
    """vLLM inspects a model's class in a child process (it imports vLLM and the model:
    ~10 CPU-s) unless VLLM_CACHE_ROOT/modelinfos holds the result for this vLLM's source
    of the model. The engines and frontends these tests start would otherwise each do it,
    several at once, whenever the cache holds another version's: it is done here once,
    one worker at a time, so that they all find it."""
    if SKIP_REASON:
        return
    from vllm import envs
    from vllm.model_executor.models.registry import ModelRegistry

    root = Path(envs.VLLM_CACHE_ROOT)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "frmps-tests-modelinfo.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        ModelRegistry.models["Qwen2ForCausalLM"].inspect_model_cls()


def pytest_collection_modifyitems(config, items):
    """Every test here needs PyTorch and the supported vLLM (skipped with the reason
    otherwise). A test marked only_vllm(V) is deselected under another vLLM: `make
    test` runs this folder once per supported version, and such a test checks
    frmps's own code (a GPU proof's script, say) through the version the GPU runs;
    the adapter's surface on each version stays covered by every other test here."""
    skip = pytest.mark.skip(reason=SKIP_REASON) if SKIP_REASON else None
    keep, dropped = [], []
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.torch)  # vLLM needs PyTorch
            if skip is not None:
                item.add_marker(skip)
            only = item.get_closest_marker("only_vllm")
            if only is not None and skip is None and INSTALLED_VLLM not in only.args:
                dropped.append(item)
                continue
        keep.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


@pytest.fixture
def addrs(sockdir):
    """The engine-core protocol's two ipc:// addresses (input, output) in a
    private socket directory."""
    return f"ipc://{os.path.join(sockdir, 'in.sock')}", f"ipc://{os.path.join(sockdir, 'out.sock')}"
