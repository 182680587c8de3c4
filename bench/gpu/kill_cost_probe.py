"""What a SIGKILL costs its sender: the supervisor fences a dead active with one
before it sends the standby's Resume, so the time kill() takes is on the way to
the first resumed token.

Starts a process group (a leader with T idle threads and C children with 4
idle threads each), times os.kill(leader) and os.killpg(group) from this
process, 5 rounds per shape, and prints the times sorted, in microseconds. No
GPU needed; run it on the machine whose figures matter (a VM's wake-ups cost
more than bare metal's):

    python3 bench/gpu/kill_cost_probe.py
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

LEADER = """
import subprocess, sys, threading, time
for _ in range({threads}):
    threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
child = "import threading, time\\n[threading.Thread(target=time.sleep, args=(3600,), daemon=True).start() for _ in range(4)]\\ntime.sleep(3600)"
kids = [subprocess.Popen([sys.executable, "-c", child]) for _ in range({children})]
print("ready", flush=True)
time.sleep(3600)
"""


def spawn(children: int, threads: int) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", LEADER.format(children=children, threads=threads)],
                         stdout=subprocess.PIPE, start_new_session=True, text=True)
    p.stdout.readline()
    time.sleep(0.5)  # the children's threads started
    return p


def main() -> None:
    for children, threads in ((0, 8), (0, 128), (0, 256), (32, 8), (32, 128)):
        for mode in ("leader", "group"):
            took = []
            for _ in range(5):
                p = spawn(children, threads)
                t = time.perf_counter_ns()
                if mode == "leader":
                    os.kill(p.pid, signal.SIGKILL)
                else:
                    os.killpg(p.pid, signal.SIGKILL)
                took.append((time.perf_counter_ns() - t) / 1e3)
                try:
                    os.killpg(p.pid, signal.SIGKILL)  # the children, after a leader-only kill
                except ProcessLookupError:
                    pass
                p.wait()
                p.stdout.close()
            print(f"children={children} threads={threads} kill {mode}: "
                  + " ".join(f"{x:.0f}" for x in sorted(took)) + " us", flush=True)


if __name__ == "__main__":
    main()
