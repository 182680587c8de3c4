import os
import pathlib
import shutil
import subprocess
import tempfile

import pytest


@pytest.fixture
def sockdir():
    """A short private directory (0700) for unix sockets: pytest's tmp_path can exceed
    the 108-byte sun_path limit."""
    d = tempfile.mkdtemp(prefix="frmps-", dir="/tmp")
    os.chmod(d, 0o700)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def open_fds() -> set[int]:
    return {int(x) for x in os.listdir("/proc/self/fd")}


@pytest.fixture(scope="module")
def one_torch_thread():
    """Module-wide: torch on one intra-op thread. The CI machine's cores are shared, and
    for models this small more threads only add contention (results do not depend on
    the thread count). Torch is imported here only, so torch-free modules never load it."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def no_fd_leak():
    """Fails the test if it leaves file descriptors open."""
    before = open_fds()
    yield
    leaked = open_fds() - before
    # listdir itself opens one fd transiently; only fds that still resolve count.
    leaked = {fd for fd in leaked if os.path.exists(f"/proc/self/fd/{fd}")}
    assert not leaked, f"leaked fds: {sorted((fd, os.readlink(f'/proc/self/fd/{fd}')) for fd in leaked)}"


@pytest.fixture(scope="session")
def fake_libcuda():
    """The interceptor's fake libcuda (a TEST DOUBLE of the driver, built here): its path."""
    from e2e import missing

    interceptor = pathlib.Path(__file__).resolve().parents[2] / "interceptor"
    if not shutil.which(os.environ.get("CC", "cc")) or not shutil.which("make"):
        missing("needs a C compiler and make to build the fake driver")
    r = subprocess.run(["make", "-s", "-C", str(interceptor), "build/libcuda_fake.so"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    return str(interceptor / "build" / "libcuda_fake.so")
