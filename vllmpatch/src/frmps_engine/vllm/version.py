"""The vLLM versions this adapter was written and verified against.

The adapter reaches into vLLM's scheduler, worker and KV-cache manager (see
VLLM.md), which have no stable API, so any version other than the tested ones
is refused instead of being half-working. What differs between the supported
versions lives in one module per version (``compat/``).
"""

from __future__ import annotations

from importlib import metadata

# Each has a module in compat/ and runs the tests in tests/vllm.
SUPPORTED_VLLM_VERSIONS = ("0.26.0", "0.33.0")


class VllmVersionError(RuntimeError):
    """The installed vLLM is not a version this adapter supports."""


def installed_vllm_version() -> str | None:
    """The installed vLLM distribution's version, or None when vLLM is not installed.

    Read from the package metadata so that checking never imports vLLM.
    """
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


def public_version(version: str) -> str:
    """``0.26.0+cu130`` -> ``0.26.0`` (local builds carry a suffix)."""
    return version.split("+", 1)[0]


def check_vllm_version(found: str | None = None) -> str:
    """Return the installed vLLM's public version, or raise VllmVersionError
    unless it is exactly one of SUPPORTED_VLLM_VERSIONS.

    ``found`` overrides the detected version (tests, and callers that already know it).
    """
    version = installed_vllm_version() if found is None else found
    wanted = " or ".join(f"vllm=={v}" for v in SUPPORTED_VLLM_VERSIONS)
    if version is None:
        raise VllmVersionError(f"frmps vLLM adapter: vLLM is not installed; it needs {wanted}")
    public = public_version(version)
    if public not in SUPPORTED_VLLM_VERSIONS:
        raise VllmVersionError(
            f"frmps vLLM adapter supports only {wanted}, found vllm {version}: "
            "it patches scheduler, worker and KV-cache internals that change between releases. "
            f"Install one of those or use --engine ref."
        )
    return public
