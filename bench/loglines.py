"""Engine log lines that harnesses read (standard library only): the patterns match
what sdk/runner.py and sdk/loop.py log, in one place for `frmps bench` and the
GPU failover proof (bench/gpu/failover_proof.py)."""

from __future__ import annotations

import os
import re

# runner.on_resume; the adoption/ring-attach tail and the adoption's CPU time are optional (engine logs kept
# in older result folders lack them).
TAKEOVER = re.compile(r"took over (\d+) requests in ([\d.]+) ms \((\d+) reused tokens, (\d+) to prefill; "
                      r"KV writable in ([\d.]+) ms(?:; adoption ([\d.]+) ms, ring attach ([\d.]+) ms)?"
                      r"(?:; adoption CPU ([\d.]+) ms[^)]*)?\)"
                      # runner._Takeover._gate_note: the first step's host work beside the KV flip (engine_api.DeviceGate)
                      r"(?:; loop started (beside|after) the KV flip(?:.*?reached the device gate ([\d.]+) ms "
                      r"into the takeover and waited ([\d.]+) ms)?)?"
                      # runner._Takeover.line: the reply waited for the first step's host work (since 2026-11-28)
                      r"(?:.*?; the reply waited ([\d.]+) ms for the first step's host work)?")
FIRST = re.compile(r"first resumed token: key=\d+ index=\d+ at ([\d.]+)")
# loop._trace: the loop's first step after a start or a takeover (a takeover's first step
# also does the engine's work for requests new to it)
FIRST_STEP = re.compile(r"step 1 after start: began [\d.]+ ms after the loop started, step ([\d.]+) ms, "
                        r"dispatch ([\d.]+) ms \(loop thread CPU ([\d.]+) ms")
# loop._trace with FRMPS_DEBUG_STEP_PHASES (vllm/phases.py): the vLLM calls of that first step,
# "name start+duration" in ms from the step's start, nested calls prefixed by '>'
FIRST_STEP_CALLS = re.compile(r"step 1 after start, vLLM calls \(ms from the step's start\): (.*?)(?:: pid=\d+)?$")
STEP_CALL = re.compile(r"(>*)([\w.]+) ([\d.]+)\+([\d.]+)")
# runner.on_handoff, with loop.HandoverTimes.line(): where a planned handover's time went on the
# engine that yielded (the client-visible pause starts after its in-flight step)
HANDOFF = re.compile(r"handed over (\d+) requests in ([\d.]+) ms \(loop stopped, state published and requests moved in "
                     r"[\d.]+ ms; waited ([\d.]+) ms for the loop, in-flight step ([\d.]+) ms, publish ([\d.]+) ms, "
                     r"move ([\d.]+) ms, reset ([\d.]+) ms, loop stop ([\d.]+) ms; pools read-only ([\d.]+) ms\)")
HANDOFF_FIELDS = ("requests", "handoff_ms", "wait_ms", "in_flight_ms", "publish_ms", "move_ms", "reset_ms", "stop_ms",
                  "read_only_ms")
SLEEP = re.compile(r"mapped read-only(?:, the KV cache read-write)? \(map ([\d.]+) ms, ready (\d+) ms after start\)")
INIT = re.compile(r"standby built \(init (\d+) ms\)")
ALLOC = re.compile(r"torch allocator: ([\d.]+) MiB reserved, ([\d.]+) MiB allocated")
# runner._standby_memory_note, after Sleep: "<kind> R MiB reserved (A allocated[, N pools])" per kind of pool
POOL_KIND = re.compile(r"(default|graphs|mempools) ([\d.]+) MiB reserved \(([\d.]+) allocated")


def standby_pools(path: str | None) -> dict[str, dict[str, float]] | None:
    """The standby's torch memory by kind of pool after Sleep, from its "standby asleep"
    line: {"default": {"reserved": MiB, "allocated": MiB}, "graphs": …, "mempools": …}."""
    if not path or not os.path.exists(path):
        return None
    with open(path, errors="replace") as f:
        for line in f:
            if "standby asleep" in line and "torch allocator by pool:" in line:
                return {k: {"reserved": float(r), "allocated": float(a)} for k, r, a in POOL_KIND.findall(line)}
    return None


# sdk/stack.py's note on the standby's "asleep" line: the per-thread stack it had at sleep
STACK = re.compile(r"standby asleep.*; per-thread stack (\d+) B")


def standby_stack_bytes(path: str | None) -> int | None:
    """The standby's per-thread stack when it went to sleep (the CUDA driver's limit, before
    any give-back), from its "standby asleep" line; None without one."""
    g = grep_first(path, STACK)
    return int(g[0]) if g else None


# sdk/memphase.py (FRMPS_DEBUG_MEMORY_PHASES=1): "memory at <phase>: NVML <n> MiB for this process; torch …"
MEMORY_PHASE = re.compile(r"memory at (.+?): (?:NVML (\d+) MiB for this process|NVML: [^;]*); "
                          r"(?:torch ([\d.]+) MiB reserved, ([\d.]+) MiB allocated)?")


def memory_phases(path: str | None) -> list[dict]:
    """The engine's memory-phase lines, in order: {"phase", "nvml_mib", "torch_reserved_mib",
    "torch_allocated_mib"} (None where the line had no figure); [] without any."""
    out: list[dict] = []
    for g in grep_every(path, MEMORY_PHASE):
        num = [None if x is None else float(x) for x in g[1:]]
        out.append({"phase": g[0], "nvml_mib": num[0], "torch_reserved_mib": num[1], "torch_allocated_mib": num[2]})
    return out


# The MPS server's log (nvidia-cuda-mps-server, server.log): "[<local date time.ms> Server <pid>] <text>".
MPS_LINE = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+) Server\s+\d+\] (.*)$")


def mps_client_teardown(path: str | None, pid: int, after: float = 0.0) -> dict | None:
    """When the MPS server began tearing client ``pid``'s context down after a fatal
    error ("… to be torn down"; absent when the client was killed without a fault)
    and when it saw the client exit ("Client {PID: pid, Context ID: n} exiting"), as
    unix times read from the log's local clock, from ``after`` (unix time) on; with
    ``teardown_ms`` between the two. A standby's KV flip waits for that exit
    (bench/results/2026-11-27-h100-vllm-restore/). None: no log or no exit line."""
    import datetime

    if not path or not os.path.exists(path):
        return None
    tag = f"Client {{PID: {pid}, Context ID: "
    torn = exited = None
    with open(path, errors="replace") as f:
        for line in f:
            m = MPS_LINE.match(line.strip())
            if not m or tag not in m.group(2):
                continue
            t = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S.%f").timestamp()
            if t < after:
                continue
            text = m.group(2)
            if torn is None and "to be torn down" in text:
                torn = t
            elif "exiting" in text:
                exited = t
                break
    if exited is None:
        return None
    out = {"torn_down_at": torn, "exited_at": exited}
    out["teardown_ms"] = round((exited - torn) * 1000, 1) if torn is not None else None
    return out


# bench/faults/fault_common.h: "pid N triggering <fault> (<variant>) at <unix time>" on the
# trigger's stderr, right before its faulting launch, the time from its own clock.
TRIGGERING = re.compile(r"triggering .* at (\d+\.\d+)\s*$")


def trigger_time(line: str) -> float | None:
    """When a trigger's "triggering" line says its fault came (None: a line without
    the time, as the triggers printed before 2026-11-27)."""
    m = TRIGGERING.search(line)
    return float(m.group(1)) if m else None


def grep_first(path: str | None, rx: re.Pattern) -> list[str] | None:
    """The groups of rx's first match in the file at path (None: no file or no match)."""
    if not path or not os.path.exists(path):
        return None
    with open(path, errors="replace") as f:
        for line in f:
            m = rx.search(line)
            if m:
                return list(m.groups())
    return None


def grep_every(path: str | None, rx: re.Pattern) -> list[list[str]]:
    """The groups of every match of rx in the file at path, in order ([]: no file or no match)."""
    if not path or not os.path.exists(path):
        return []
    with open(path, errors="replace") as f:
        return [list(m.groups()) for m in map(rx.search, f) if m]


def grep_last(path: str | None, rx: re.Pattern) -> list[str] | None:
    """The groups of rx's last match in the file at path (None: no file or no match):
    an engine that took over, went back to sleep (failback) and took over again
    logs one takeover per time."""
    return grep_last_each(path, rx)[0]


def grep_last_each(path: str | None, *rxs: re.Pattern) -> list[list[str] | None]:
    """grep_last of each pattern, in one read of the file."""
    last: list[list[str] | None] = [None] * len(rxs)
    if not path or not os.path.exists(path):
        return last
    with open(path, errors="replace") as f:
        for line in f:
            for i, rx in enumerate(rxs):
                m = rx.search(line)
                if m:
                    last[i] = list(m.groups())
    return last


def first_time_after(path: str | None, rx: re.Pattern, after: float) -> float | None:
    """The earliest time (rx's first group, unix seconds) at or after `after`."""
    if not path or not os.path.exists(path):
        return None
    ts = [t for t in (float(g[0]) for g in grep_every(path, rx)) if t >= after]
    return min(ts) if ts else None


def takeover_fields(groups: list[str]) -> dict:
    """TAKEOVER's groups as a record."""
    out = {"requests": int(groups[0]), "resume_ms": float(groups[1]), "reused_tokens": int(groups[2]),
           "prefilled_tokens": int(groups[3]), "kv_writable_ms": float(groups[4])}
    if groups[5] is not None:
        out.update(adoption_ms=float(groups[5]), ring_attach_ms=float(groups[6]))
    if groups[7] is not None:
        out.update(adoption_cpu_ms=float(groups[7]))
    if groups[8] is not None:
        out["device_gate"] = groups[8] == "beside"
    if groups[9] is not None:
        out.update(gate_at_ms=float(groups[9]), gate_wait_ms=float(groups[10]))
    if groups[11] is not None:
        out["reply_wait_ms"] = float(groups[11])
    return out


def step_calls_fields(calls: str) -> dict:
    """FIRST_STEP_CALLS's list as a record: when the forward pass was launched (the
    runner's ``kv_connector.pre_forward``, right before it: the step's host work until
    then) and how long vLLM took to register the step's new requests
    (``add_requests``), in ms; {} where the list lacks them."""
    out: dict = {}
    for _, name, start, dur in STEP_CALL.findall(calls):
        if name == "kv_connector.pre_forward" and "forward_launch_ms" not in out:
            out["forward_launch_ms"] = float(start)
        elif name == "add_requests" and "add_requests_ms" not in out:
            out["add_requests_ms"] = float(dur)
    return out


def first_step_fields(groups: list[str]) -> dict:
    """FIRST_STEP's groups as a record."""
    return {"step_ms": float(groups[0]), "dispatch_ms": float(groups[1]), "loop_cpu_ms": float(groups[2])}


def takeover_breakdown(path: str | None) -> dict | None:
    """The latest takeover in an engine's log and the first step after it (an engine
    that took over, yielded and took over again logs each time): None if none."""
    tk, fs, calls = grep_last_each(path, TAKEOVER, FIRST_STEP, FIRST_STEP_CALLS)
    out = takeover_fields(tk) if tk else {}
    if tk and fs:
        out["first_step"] = first_step_fields(fs)
        if calls:
            out["first_step"].update(step_calls_fields(calls[0]))
    return out or None


def handoff_breakdown(path: str | None) -> dict | None:
    """The latest planned handover an engine's log records, from the side that yielded:
    {"requests", "handoff_ms", "wait_ms", "in_flight_ms", "publish_ms", "move_ms",
    "reset_ms", "stop_ms", "read_only_ms"}; None if none (or logged before the breakdown)."""
    g = grep_last(path, HANDOFF)
    if g is None:
        return None
    return {k: (int(v) if k == "requests" else float(v)) for k, v in zip(HANDOFF_FIELDS, g)}
