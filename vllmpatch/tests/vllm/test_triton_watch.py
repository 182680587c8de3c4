"""triton_watch: Triton's compilation listener that counts cache hits and misses and
splits a compile's cache key into its parts. Triton compiles nothing without a GPU,
so the listener is called here as Triton's compile() calls it, with a real
ASTSource, backend and options (only the compile itself is left out)."""

from __future__ import annotations

import hashlib
import json
import logging
from types import SimpleNamespace

import pytest

from e2e import require

triton = require("triton")
tl = require("triton.language")

from frmps_engine.vllm import triton_watch  # noqa: E402
from frmps_engine.vllm.triton_watch import TritonCompileWatch, key_parts, watch_from_env  # noqa: E402


@triton.jit
def _kernel(X, N, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    tl.store(X + pid, pid)


def _compile_record(num_warps: int = 4, cache_dir: str = "/cache"):
    """src and metadata as triton.compiler.compiler.compile hands them to a listener."""
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource, make_backend
    from triton.runtime.cache import get_cache_key

    src = ASTSource(fn=_kernel, signature={"X": "*fp32", "N": "i32"}, constexprs={"BLOCK": 4}, attrs={})
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    options = backend.parse_options({"num_warps": num_warps})
    key = hashlib.sha256(get_cache_key(src, backend, options, get_cache_invalidating_env_vars()).encode()).hexdigest()
    metadata = {"hash": key, "target": target, **options.__dict__}
    group = {"_kernel.json": f"{cache_dir}/{key}/_kernel.json"}
    return src, metadata, group


def _times(us: int):
    return SimpleNamespace(total=us)


def test_the_parts_give_the_key_the_compile_was_stored_under():
    src, metadata, _ = _compile_record()
    parts = key_parts(src, metadata)
    assert parts["same_key"] == "yes" and parts["key"] == metadata["hash"][:12]
    assert "?" not in parts.values()
    # A hit reads its metadata from the cache's JSON (tuples became lists): still the same key.
    assert key_parts(src, json.loads(json.dumps(metadata, default=vars)))["same_key"] == "yes"
    # Options other than the stored key's: the parts no longer give it, and the options part differs.
    _, other, _ = _compile_record(num_warps=8)
    mixed = dict(other, hash=metadata["hash"])
    p2 = key_parts(src, mixed)
    assert p2["same_key"] == "no" and p2["options"] != parts["options"] and p2["src"] == parts["src"]


def test_counts_hits_and_misses_and_sums_up_the_start(caplog):
    src, metadata, group = _compile_record(cache_dir="/c/triton_cache")
    w = TritonCompileWatch()
    with caplog.at_level(logging.INFO, logger=triton_watch.__name__):
        w(src=src, metadata=metadata, metadata_group=group, times=_times(1000), cache_hit=True)
        w(src=src, metadata=metadata, metadata_group=group, times=_times(2_500_000), cache_hit=False)
        assert not caplog.records  # during the start only the summary speaks
        line = w.start_summary()
        assert line == ("Triton during the start: 1 kernels from the cache, 1 compiled (2.50 s of compiling) in "
                        "/c/triton_cache; compiled: _kernel")
        w(src=src, metadata=metadata, metadata_group=group, times=_times(10), cache_hit=True)
        assert not caplog.records
        w(src=src, metadata=metadata, metadata_group=group, times=_times(3_000_000), cache_hit=False)
    backend, miss = (r.getMessage() for r in caplog.records)
    # The first line with a backend hash says what the hash is made of: ptxas's version and the arch.
    assert backend.startswith(f"triton backend {key_parts(src, metadata)['backend']}: ") and backend.endswith("-90")
    assert "compiled (cache miss): _kernel in 3.000 s" in miss and "parts give the key: yes" in miss
    assert miss.endswith("in /c/triton_cache")
    assert (w.hits, w.misses) == (2, 2)


def test_detail_logs_hits_too(caplog):
    src, metadata, group = _compile_record()
    w = TritonCompileWatch(detail=True)
    with caplog.at_level(logging.INFO, logger=triton_watch.__name__):
        w(src=src, metadata=metadata, metadata_group=group, times=_times(5), cache_hit=True)
        w(src=src, metadata=metadata, metadata_group=group, times=_times(5), cache_hit=True)
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 3 and msgs[0].startswith("triton backend ")  # the backend's text once
    assert all("cache hit: _kernel" in m for m in msgs[1:])


def test_installs_as_the_listener_chains_and_uninstalls(monkeypatch):
    from triton import knobs

    seen = []

    def before(**kw):
        seen.append(kw["cache_hit"])

    monkeypatch.setattr(knobs.compilation, "listener", before)
    monkeypatch.setenv(triton_watch.DEBUG_ENV, "0")
    w = watch_from_env()
    assert w is not None and knobs.compilation.listener is w and not w.detail
    src, metadata, group = _compile_record()
    knobs.compilation.listener(src=src, metadata=metadata, metadata_group=group, times=_times(1), cache_hit=False)
    assert seen == [False] and w.misses == 1
    w.uninstall()
    assert knobs.compilation.listener is before
