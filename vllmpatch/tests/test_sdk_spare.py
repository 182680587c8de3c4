"""The spare engine process (sdk/spare.py): what it accepts as an activation, what it
preloads, how it tells that the CUDA driver is still uninitialised, and the process
itself. The whole path (a spare becoming the engine after a failover, under the real
supervisor) is test_e2e_failback.py's."""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import types

import pytest

from frmps_engine.sdk import spare

from e2e import missing

ENV = {"PATH": "/usr/bin", "FRMPS_MODULES_FILE": "/run/m.txt"}


def line(argv, env) -> bytes:
    return json.dumps({"argv": argv, "env": env}).encode() + b"\n"


SERVE = ["serve", "--engine", "ref", "--role", "standby", "--model", "tiny"]


def test_activation_may_set_only_the_mps_variables():
    env = {**ENV, "CUDA_MPS_PIPE_DIRECTORY": "/mps/pipe", "CUDA_MPS_LOG_DIRECTORY": "/mps/log"}
    argv, got = spare.parse_activation(line(SERVE, env), ENV, "ref")
    assert argv == SERVE and got == env
    for bad_env, word in (({**ENV, "LD_PRELOAD": "/x.so"}, "LD_PRELOAD"),
                          ({"PATH": "/usr/bin"}, "FRMPS_MODULES_FILE"),
                          ({**ENV, "PATH": "/bin"}, "PATH")):
        with pytest.raises(spare.ActivationError, match=word):
            spare.parse_activation(line(SERVE, bad_env), ENV, "ref")


@pytest.mark.parametrize("raw, why", [
    (b"not json\n", "not JSON"),
    (b"[1, 2]\n", "JSON object"),
    (json.dumps({"argv": [], "env": {}}).encode(), "non-empty list"),
    (json.dumps({"argv": ["serve", 3], "env": {}}).encode(), "non-empty list"),
    (json.dumps({"argv": ["serve"], "env": {"A": 1}}).encode(), "map strings"),
    (line(["model-dir", "tiny"], ENV), "only serve"),
    (line(["serve", "--engine", "vllm"], ENV), "preloaded engine 'ref'"),
    (line(["serve", "--engine"], ENV), "preloaded engine 'ref'"),
])
def test_malformed_activations_are_refused(raw, why):
    with pytest.raises(spare.ActivationError, match=why):
        spare.parse_activation(raw, ENV, "ref")


def test_importable_keeps_modules_a_fresh_process_can_import(tmp_path):
    root = tmp_path / "site"
    (root / "pkg").mkdir(parents=True)
    elsewhere = tmp_path / "cache"
    elsewhere.mkdir()

    def mod(name, origin, spec_name=None):
        m = types.ModuleType(name)
        m.__spec__ = types.SimpleNamespace(name=spec_name or name, origin=origin)
        return m

    mods = {
        "pkg": mod("pkg", str(root / "pkg" / "__init__.py")),
        "pkg.sub": mod("pkg.sub", str(root / "pkg" / "sub.py")),
        "__main__": mod("__main__", str(root / "main.py")),
        "sys": mod("sys", "built-in"),
        "compiled_abc": mod("compiled_abc", str(elsewhere / "abc.py")),  # e.g. a compile cache
        "alias": mod("alias", str(root / "x.py"), spec_name="other"),  # loaded under another name
        "nospec": types.ModuleType("nospec"),
        "gone": None,
    }
    assert spare.importable(mods, [str(root)]) == ["pkg", "pkg.sub"]


def test_write_modules_first_writer_wins(tmp_path, monkeypatch):
    path = str(tmp_path / "engine-modules.txt")
    spare.write_modules(path)
    names = open(path).read().split()
    assert "frmps_engine.sdk.spare" in names and "json" in names
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    open(path, "w").write("kept\n")
    spare.write_modules(path)  # a second engine does not overwrite it
    assert open(path).read() == "kept\n"
    assert sorted(os.listdir(tmp_path)) == ["engine-modules.txt"]


@pytest.mark.parametrize("before", [None, "0"])
def test_import_modules_counts_and_stops(monkeypatch, before):
    if before is None:
        monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
    else:
        monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", before)
    ok, failed, culprit = spare.import_modules(["json", "no_such_module_xyz", "# comment", "", "os.path"])
    assert (ok, failed, culprit) == (2, 1, None)
    assert os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK") == before  # restored as it was
    calls = []
    ok, failed, culprit = spare.import_modules(["json", "os", "csv"], stop_if=lambda: calls.append(1) or len(calls) == 2)
    assert culprit == "os" and ok == 2


FAKE_DRIVER = r"""
static int inited;
int cuInit(unsigned flags) { (void)flags; inited = 1; return 0; }
int cuCtxGetCurrent(void **ctx) { if (!inited) return 3; *ctx = 0; return 0; }
"""


@pytest.fixture
def fake_driver(tmp_path):
    """TEST DOUBLE of libcuda: cuCtxGetCurrent answers CUDA_ERROR_NOT_INITIALIZED until cuInit."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        missing("no C compiler for the fake CUDA driver")
    src = tmp_path / "fakecuda.c"
    src.write_text(FAKE_DRIVER)
    lib = tmp_path / "libfakecuda.so.1"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    return str(lib)


def test_driver_initialised_reads_the_loaded_driver(fake_driver):
    assert not spare.driver_initialised(fake_driver)  # not loaded: nothing to ask, nothing loaded
    assert not spare.driver_initialised("libfakecuda.so.1", thorough=False)
    drv = ctypes.CDLL(fake_driver)  # loaded (as a library that links libcuda would), not initialised
    assert not spare.driver_initialised(fake_driver)
    drv.cuInit(0)
    assert spare.driver_initialised(fake_driver)
    assert spare.driver_initialised("libfakecuda.so", thorough=True)  # found among the mappings by name


def _spare_proc(tmp_path, modules: str | None = None, engine: str = "ref"):
    cmd = [sys.executable, "-m", "frmps_engine.cli", "spare", "--engine", engine]
    if modules:
        cmd += ["--modules", modules]
    env = {k: v for k, v in os.environ.items()}
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            cwd=tmp_path)


def test_spare_process_exits_when_sent_away(tmp_path):
    """End of input before any activation: exit 0 (a torch-free engine factory, so no torch is imported)."""
    p = _spare_proc(tmp_path, engine="frmps_engine.sdk.testing.fake_engine:FakeAdapter")
    out, err = p.communicate(b"", timeout=120)
    assert p.returncode == 0, err.decode()
    assert out.decode().startswith(spare.READY_MARK), out
    # The preloaded heap is frozen before the spare says it is ready (its engine's
    # collections then walk only what the engine builds).
    frozen = int(re.search(r"; (\d+) objects frozen", out.decode()).group(1))
    assert frozen > 1000, out


def test_spare_process_refuses_a_bad_activation(tmp_path):
    p = _spare_proc(tmp_path, engine="frmps_engine.sdk.testing.fake_engine:FakeAdapter")
    bad = dict(os.environ, LD_PRELOAD="/nothing.so")
    out, err = p.communicate(line(["serve", "--engine", "frmps_engine.sdk.testing.fake_engine:FakeAdapter"], bad), timeout=120)
    assert p.returncode == spare.EXIT_BAD_ACTIVATION, (out, err)
    assert b"LD_PRELOAD" in err


def test_spare_process_refuses_an_unknown_engine(tmp_path):
    p = _spare_proc(tmp_path, engine="no.such.module:Factory")
    out, err = p.communicate(b"", timeout=120)
    assert p.returncode == spare.EXIT_BAD_ACTIVATION and b"cannot import" in err


@pytest.mark.torch
def test_reference_spare_preloads_the_listed_modules(tmp_path):
    mods = tmp_path / "engine-modules.txt"
    mods.write_text("json\ncsv\nno_such_module_xyz\n")
    p = _spare_proc(tmp_path, modules=str(mods))
    out, err = p.communicate(b"", timeout=300)
    assert p.returncode == 0, err.decode()
    assert "2 of 3 listed imported, 1 skipped" in out.decode()


def test_preload_hook_gets_the_model_when_it_takes_one(tmp_path, monkeypatch):
    (tmp_path / "frmps_test_factories.py").write_text(
        "CALLS = []\n"
        "def with_model(opts): pass\n"
        "def _pre(model=None): CALLS.append(('with', model))\n"
        "with_model.preload = _pre\n"
        "def without(opts): pass\n"
        "without.preload = lambda: CALLS.append(('without', None))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import frmps_test_factories as f

    spare.preload("frmps_test_factories:with_model", None, model="/models/q")
    spare.preload("frmps_test_factories:with_model", None)
    spare.preload("frmps_test_factories:without", None, model="/models/q")
    assert f.CALLS == [("with", "/models/q"), ("with", None), ("without", None)]
