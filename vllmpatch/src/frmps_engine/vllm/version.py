"""The one vLLM version this adapter was written and verified against.

The adapter reaches into vLLM's scheduler and KV-cache manager (see VLLM.md),
which have no stable API, so any other version is refused instead of being
half-working.
"""

from __future__ import annotations

from importlib import metadata

REQUIRED_VLLM_VERSION = "0.33.0"


class VllmVersionError(RuntimeError):
    """The installed vLLM is not the version this adapter supports."""


def installed_vllm_version() -> str | None:
    """The installed vLLM distribution's version, or None when vLLM is not installed.

    Read from the package metadata so that checking never imports vLLM.
    """
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


def check_vllm_version(found: str | None = None) -> str:
    """Return the vLLM version, or raise VllmVersionError unless it is exactly REQUIRED_VLLM_VERSION.

    ``found`` overrides the detected version (tests, and callers that already know it).
    """
    version = installed_vllm_version() if found is None else found
    if version is None:
        raise VllmVersionError(
            f"frmps vLLM adapter: vLLM is not installed; it needs vllm=={REQUIRED_VLLM_VERSION} "
            f"(pip install vllm=={REQUIRED_VLLM_VERSION})"
        )
    # Local builds carry a suffix ("0.33.0+cu130"); the public part must match exactly.
    public = version.split("+", 1)[0]
    if public != REQUIRED_VLLM_VERSION:
        raise VllmVersionError(
            f"frmps vLLM adapter supports only vllm=={REQUIRED_VLLM_VERSION}, found vllm {version}: "
            "it patches scheduler and KV-cache internals that change between releases. "
            f"Install vllm=={REQUIRED_VLLM_VERSION} or use --engine ref."
        )
    return version
