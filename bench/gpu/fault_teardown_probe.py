"""How long a GPU fault of an MPS client keeps the GPU from other contexts — without frmps.

Every frmps soak so far saw one fault (mostly the first of a deployment, not always) whose MPS
teardown took ~285 ms where the others took 3-30 ms; a standby outside MPS waits that long in
its KV flip or its first step. This probe asks whether that is the GPU's (driver's, MPS
server's) own behaviour, with no engine involved:

- a private MPS control daemon (0700 folders, quit at the end);
- an *observer* outside MPS: a tiny kernel and a synchronize in a loop, recording every gap
  above --gap-ms (what a sleeping standby would feel);
- with --nvml, a thread of this process waiting for NVML's Xid events on every GPU (the
  earlier signal issue 15 asks about: what it gains over the server's log and the victim's
  own error);
- per round: a *victim* MPS client (torch, --victim-gib allocated, matmuls in a loop), then a
  fault trigger of bench/faults as a second MPS client of the same server; the victim's error
  and exit, the server's "to be torn down" -> "exiting" lines and the observer's longest gap
  after the fault are recorded.

    python3 bench/gpu/fault_teardown_probe.py --faults-dir bench/build/faults --rounds 4 --out probe.json

Run it first on a machine whose GPU has not faulted since it started if the question is
whether the first fault is the slow one. Needs torch (CUDA) and nvidia-cuda-mps-control.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "vllmpatch", "src"))
sys.path.insert(0, os.path.join(HERE, "..", ".."))  # the bench package
from bench import loglines  # noqa: E402

OBSERVER = r"""
import json, signal, sys, time, torch
gap_s = float(sys.argv[1])
x = torch.zeros(1, device="cuda")
torch.cuda.synchronize()
gaps, stop = [], []
signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
print("ready", flush=True)
last = time.time()
while not stop:
    x.add_(1)
    torch.cuda.synchronize()
    now = time.time()
    if now - last > gap_s:
        gaps.append([round(last, 4), round((now - last) * 1000, 2)])
    last = now
    time.sleep(0.0005)
print(json.dumps(gaps), flush=True)
"""

VICTIM = r"""
import os, sys, time, torch
gib = float(sys.argv[1])
hold = torch.empty(int(gib * (1 << 30)), dtype=torch.uint8, device="cuda") if gib > 0 else None
a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
torch.cuda.synchronize()
print("ready %d" % os.getpid(), flush=True)
try:
    while True:
        for _ in range(8):
            a = (a @ b).clamp_(-1, 1)
        torch.cuda.synchronize()
except Exception as e:
    print("error %.6f %s" % (time.time(), str(e).splitlines()[0][:160]), flush=True)
    os._exit(1)
"""


class XidWatch:
    """NVML's Xid events (nvmlDeviceRegisterEvents, XidCriticalError) on every GPU, through
    ctypes, on a thread: [unix time, device index, Xid] per event. NVML sees every GPU
    whatever CUDA_VISIBLE_DEVICES says; its events carry no pid."""

    XID_CRITICAL = 0x8  # nvmlEventTypeXidCriticalError
    TIMEOUT = 10  # NVML_ERROR_TIMEOUT

    class _Data(ctypes.Structure):
        _fields_ = [("device", ctypes.c_void_p), ("eventType", ctypes.c_ulonglong), ("eventData", ctypes.c_ulonglong),
                    ("gpuInstanceId", ctypes.c_uint), ("computeInstanceId", ctypes.c_uint)]

    def __init__(self, library: str = "libnvidia-ml.so.1"):
        self.events: list[list] = []
        self.error = ""
        self._stop = threading.Event()
        nv = self.nv = ctypes.CDLL(library)
        self._check("nvmlInit_v2", nv.nvmlInit_v2())
        n = ctypes.c_uint()
        self._check("nvmlDeviceGetCount_v2", nv.nvmlDeviceGetCount_v2(ctypes.byref(n)))
        self.set = ctypes.c_void_p()
        self._check("nvmlEventSetCreate", nv.nvmlEventSetCreate(ctypes.byref(self.set)))
        for i in range(n.value):
            h = ctypes.c_void_p()
            self._check("nvmlDeviceGetHandleByIndex_v2", nv.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(h)))
            self._check("nvmlDeviceRegisterEvents", nv.nvmlDeviceRegisterEvents(h, ctypes.c_ulonglong(self.XID_CRITICAL), self.set))
        self.thread = threading.Thread(target=self._run, name="xid-watch", daemon=True)
        self.thread.start()

    def _check(self, what: str, rc: int) -> None:
        if rc != 0:
            raise RuntimeError(f"{what}: NVML error {rc}")

    def _run(self) -> None:
        data = self._Data()
        while not self._stop.is_set():
            rc = self.nv.nvmlEventSetWait_v2(self.set, ctypes.byref(data), 100)
            t = time.time()
            if rc == self.TIMEOUT:
                continue
            if rc != 0:
                self.error = f"nvmlEventSetWait_v2: NVML error {rc}"
                return
            idx = ctypes.c_uint()
            self.nv.nvmlDeviceGetIndex(ctypes.c_void_p(data.device), ctypes.byref(idx))
            self.events.append([round(t, 4), idx.value, int(data.eventData)])

    def close(self) -> None:
        self._stop.set()
        self.thread.join(timeout=2)
        self.nv.nvmlEventSetFree(self.set)
        self.nv.nvmlShutdown()


def ctl(env: dict, cmd: str) -> str:
    r = subprocess.run(["nvidia-cuda-mps-control"], input=cmd + "\n", env=env, capture_output=True,
                       text=True, timeout=20)
    return (r.stdout + r.stderr).strip()


def read_line(p: subprocess.Popen, prefix: str, timeout: float) -> str:
    end = time.time() + timeout
    while time.time() < end:
        line = p.stdout.readline()
        if not line:
            if p.poll() is not None:
                break
            continue
        if line.startswith(prefix):
            return line.strip()
    raise RuntimeError(f"no {prefix!r} line from pid {p.pid} within {timeout} s (rc {p.poll()})")


def one_round(n: int, a, mps_env: dict, trigger: str, server_log: str) -> dict:
    rec: dict = {"round": n, "trigger": trigger}
    victim = subprocess.Popen([sys.executable, "-c", VICTIM, str(a.victim_gib)], env=mps_env,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        read_line(victim, "ready", 120)
        rec["victim_pid"] = victim.pid
        time.sleep(a.settle)
        prog, _, variant = trigger.partition(":")
        trig = subprocess.Popen([os.path.join(a.faults_dir, prog), variant, "-1"], env=mps_env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = ""
        while "ready" not in line:
            line = trig.stderr.readline()
            if not line:
                raise RuntimeError(f"trigger {trigger} did not start (rc {trig.poll()})")
        trig.stdin.write("x")
        trig.stdin.close()
        t_fault = None
        for line in trig.stderr:
            t_fault = loglines.trigger_time(line) or t_fault
        out = trig.stdout.read()
        rec["trigger_out"], rec["trigger_rc"] = out.strip(), trig.wait(timeout=30)
        rec["fault_at"] = t_fault
        err = read_line(victim, "error", 30)
        t_err = float(err.split()[1])
        rec["victim_error"] = err.split(" ", 2)[2]
        victim.wait(timeout=30)
        t_exit = time.time()
        rec["fault_to_victim_error_ms"] = round((t_err - t_fault) * 1000, 1) if t_fault else None
        rec["fault_to_victim_reaped_ms"] = round((t_exit - t_fault) * 1000, 1) if t_fault else None
        time.sleep(0.5)  # the server logs the exits
        td = loglines.mps_client_teardown(server_log, victim.pid, (t_fault or t_exit) - 2)
        rec["server_teardown_victim"] = td
        if td and td.get("torn_down_at") and t_fault:
            rec["fault_to_torn_down_ms"] = round((td["torn_down_at"] - t_fault) * 1000, 1)
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait()
    return rec


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--faults-dir", default="bench/build/faults")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--triggers", default="misaligned:load,illegal_instruction:jump-far,shared_oob:shared,oob_write:write",
                   help="program:variant, one per round in turn")
    p.add_argument("--victim-gib", type=float, default=8.0)
    p.add_argument("--settle", type=float, default=1.0, help="seconds of victim work before the fault")
    p.add_argument("--gap-ms", type=float, default=3.0, help="observer gaps longer than this are recorded")
    p.add_argument("--pause", type=float, default=2.0, help="seconds between rounds")
    p.add_argument("--nvml", action="store_true", help="also record NVML's Xid events (time after the fault, Xid)")
    p.add_argument("--prime", action="store_true",
                   help="first run `frmps_engine.cli prime-fault` alone as a client of the daemon (what "
                        "frmps serve --prime-fault-path does), then the rounds")
    p.add_argument("--out", required=True)
    a = p.parse_args()

    base = tempfile.mkdtemp(prefix="frmps-fault-probe-")
    os.chmod(base, 0o700)
    pipe, logd, empty = (os.path.join(base, d) for d in ("pipe", "log", "nompsd"))
    for d in (pipe, logd, empty):
        os.makedirs(d, mode=0o700)
    mps_env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": pipe, "CUDA_MPS_LOG_DIRECTORY": logd}
    out_env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": empty, "CUDA_MPS_LOG_DIRECTORY": empty}  # no daemon: outside MPS
    result: dict = {"started_at": time.time(), "victim_gib": a.victim_gib, "rounds": []}
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,uuid,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True)
        result["gpus"] = smi.stdout.strip().splitlines()
    except OSError as e:
        result["gpus"] = [f"nvidia-smi: {e}"]
    r = subprocess.run(["nvidia-cuda-mps-control", "-d"], env=mps_env, capture_output=True, text=True)
    if r.returncode != 0:
        print(f"MPS daemon did not start: {r.stdout}{r.stderr}", file=sys.stderr)
        return 2
    xids = None
    if a.nvml:
        try:
            xids = XidWatch()
        except (OSError, RuntimeError) as e:
            result["nvml_error"] = str(e)
            print(f"NVML Xid events not watched: {e}", file=sys.stderr)
    observer = subprocess.Popen([sys.executable, "-c", OBSERVER, str(a.gap_ms / 1000)], env=out_env,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    rc = 0
    try:
        read_line(observer, "ready", 120)
        if a.prime:
            t0 = time.time()
            r = subprocess.run([sys.executable, "-m", "frmps_engine.cli", "prime-fault"], capture_output=True, text=True,
                               timeout=120, env={**mps_env, "PYTHONPATH": os.path.join(HERE, "..", "..", "vllmpatch", "src")})
            result["prime"] = {"rc": r.returncode, "out": (r.stdout + r.stderr).strip()[-400:],
                               "seconds": round(time.time() - t0, 3)}
            print(f"prime: rc {r.returncode} in {result['prime']['seconds']} s: {result['prime']['out']}", flush=True)
            time.sleep(a.pause)
        triggers = a.triggers.split(",")
        for n in range(1, a.rounds + 1):
            try:
                rec = one_round(n, a, mps_env, triggers[(n - 1) % len(triggers)], os.path.join(logd, "server.log"))
            except Exception as e:  # a round that failed is recorded, the next one still runs
                rec, rc = {"round": n, "error": str(e)}, 1
            result["rounds"].append(rec)
            time.sleep(a.pause)
    finally:
        observer.send_signal(signal.SIGTERM)
        try:
            gaps = json.loads(observer.communicate(timeout=30)[0].strip().splitlines()[-1])
        except Exception as e:
            gaps = []
            result["observer_error"] = str(e)
        print(ctl(mps_env, "quit"))
        if xids is not None:
            xids.close()
            result["xid_events"], result["nvml_error"] = xids.events, xids.error
            for rec in result["rounds"]:
                t = rec.get("fault_at")
                if t:
                    rec["xids_after_fault"] = [[round((e[0] - t) * 1000, 1), e[1], e[2]] for e in xids.events
                                               if t - 0.05 <= e[0] <= t + 2.0]
        for rec in result["rounds"]:
            t = rec.get("fault_at")
            if t:
                after = [g for g in gaps if t - 0.05 <= g[0] <= t + 2.0]
                rec["observer_gaps_after_fault_ms"] = [g[1] for g in after]
                rec["observer_longest_gap_ms"] = max((g[1] for g in after), default=0.0)
        result["observer_gaps"] = gaps
        for name in ("control.log", "server.log"):
            f = os.path.join(logd, name)
            if os.path.exists(f):
                shutil.copy(f, os.path.splitext(a.out)[0] + "-mps-" + name)
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
        shutil.rmtree(base, ignore_errors=True)
    for rec in result["rounds"]:
        td = rec.get("server_teardown_victim") or {}
        print(f"round {rec['round']} {rec.get('trigger')}: fault->victim error {rec.get('fault_to_victim_error_ms')} ms, "
              f"fault->torn down {rec.get('fault_to_torn_down_ms')} ms, teardown {td.get('teardown_ms')} ms, "
              f"victim reaped {rec.get('fault_to_victim_reaped_ms')} ms, observer longest gap "
              f"{rec.get('observer_longest_gap_ms')} ms; Xid events [ms after the fault, GPU, Xid] "
              f"{rec.get('xids_after_fault', '(not watched)')} {rec.get('error', '')}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
