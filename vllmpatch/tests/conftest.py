import os
import pathlib
import shutil
import subprocess
import tempfile

import pytest


def pytest_configure(config):
    import e2e

    e2e.MARK_EXPR = config.getoption("markexpr", "") or ""


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


def _shm_rings() -> set[str]:
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("frmps-") and n.endswith(".ring")}
    except OSError:
        return set()


def _mapped_paths() -> set[str]:
    """Files some process maps (a live supervisor maps its ring); processes this user
    cannot read are passed over."""
    out: set[str] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    parts = line.split(maxsplit=5)
                    if len(parts) == 6:
                        out.add(parts[5].strip().removesuffix(" (deleted)"))
        except OSError:
            continue
    return out


def leaked_rings(before: set[str]) -> list[str]:
    """frmps rings in /dev/shm that were not there at `before` and that no process maps:
    left behind by a supervisor (a test's, killed or not) that is gone."""
    new = _shm_rings() - before
    if not new:
        return []
    mapped = _mapped_paths()
    return sorted(n for n in new if os.path.join("/dev/shm", n) not in mapped)


@pytest.fixture(scope="session", autouse=True)
def no_ring_left_in_dev_shm():
    """The test session leaves no frmps ring in /dev/shm: every test that starts a
    supervisor gives it a ring directory of its own (a SIGKILLed supervisor cannot
    remove its 8 MiB ring, and nothing would remove one in /dev/shm)."""
    before = _shm_rings()
    yield
    left = leaked_rings(before)
    assert not left, f"tests left frmps rings in /dev/shm: {left}"


def pytest_collection_modifyitems(config, items):
    """On pytest-xdist's workers (make py-test: --dist loadfile, a test module to one
    worker, so a module-scoped fixture such as a `frmps serve` deployment starts once):
    the modules that hold a test marked slow go first, in their collection order, so no
    long test starts last while the other workers idle (with --no-loadscope-reorder the
    workers take the modules in this order). The order within a module stays. Without
    xdist it does nothing."""
    if not hasattr(config, "workerinput"):
        return
    slow = {item.nodeid.split("::", 1)[0] for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.nodeid.split("::", 1)[0] not in slow)  # a stable sort
