#!/usr/bin/env python3
"""Do a thread's kernel launches wait while another thread flips a large pool's access
(GPU machine)?

A takeover's KV flip (cuMemSetAccess over the whole KV pool, on a thread of its own)
runs beside the first step's host work, which launches kernels before it reaches the
device gate. On an H200 at 14B (a 32 GiB KV pool) that host work took 4.8-5.1 ms when
the flip was short and busy and 2.2-3.6 ms when the flip only waited on the MPS
server (bench/results/2026-11-28-h200-vllm-standby-stack/ §2): the launches may queue
behind the flip in the driver. This probe measures it without an engine: one pool of
the given size from frmps's cuda-vmm backend, flipped read-only / read-write in a loop
on one thread while another launches small kernels, against the same launches alone
and the flips alone.

    python3 bench/gpu/flip_contention.py --gib 32 --gib 1.4 --rounds 15 [--out FILE]

Prints one JSON object (and writes it to --out): per pool size, the median and the
max over rounds of one flip's time, of a burst of --launches launches' host time and
(on a GPU) of 10 replays of a 50-kernel CUDA graph (how a decode step launches),
alone and while flips run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time


def launches(x, n: int) -> float:
    """Host time (ms) of n small kernel launches, without waiting for the device."""
    t = time.perf_counter_ns()
    for _ in range(n):
        x.add_(1)
    return (time.perf_counter_ns() - t) / 1e6


def replays(graph, n: int) -> float:
    """Host time (ms) of n CUDA graph launches (a decode step's launch), without waiting."""
    t = time.perf_counter_ns()
    for _ in range(n):
        graph.replay()
    return (time.perf_counter_ns() - t) / 1e6


def measure(backend, gib: float, rounds: int, n: int, device: str = "cuda") -> dict:
    import torch

    from frmps_engine.sdk.memory.base import PoolSpec

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    size = int(gib * 2**30) // (2 << 20) * (2 << 20)
    backend.allocate([PoolSpec("kv_cache", 0, size)])
    x = torch.zeros(256, device=device)
    launches(x, n)
    sync()
    graph = None
    if device.startswith("cuda"):  # a graph of 50 small kernels, replayed as a decode step is
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            launches(x, 3)
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            launches(x, 50)
        replays(graph, 3)
        sync()

    def flip_once() -> float:
        t = time.perf_counter_ns()
        backend.make_readonly("kv_cache")
        backend.make_writable("kv_cache")
        return (time.perf_counter_ns() - t) / 2e6  # one flip: half of the pair

    alone_flip = [flip_once() for _ in range(rounds)]
    alone_launch = []
    for _ in range(rounds):
        alone_launch.append(launches(x, n))
        sync()
    alone_replay, during_replay = [], []
    if graph is not None:
        for _ in range(rounds):
            alone_replay.append(replays(graph, 10))
            sync()
    during, flips = [], []
    for _ in range(rounds):
        stop = threading.Event()

        def flipper() -> None:
            while not stop.is_set():
                flips.append(flip_once())

        th = threading.Thread(target=flipper)
        th.start()
        time.sleep(0.002)  # the flipper is inside its loop
        during.append(launches(x, n))
        if graph is not None:
            during_replay.append(replays(graph, 10))
        stop.set()
        th.join()
        sync()

    def stats(v: list[float]) -> dict:
        return {"median_ms": round(statistics.median(v), 3), "max_ms": round(max(v), 3), "n": len(v)}

    backend.close()
    out = {"pool_gib": round(size / 2**30, 2), "flip_alone": stats(alone_flip), "flip_beside_launches": stats(flips),
           f"{n}_launches_alone": stats(alone_launch), f"{n}_launches_during_flips": stats(during)}
    if graph is not None:
        out["10_graph_replays_alone"] = stats(alone_replay)
        out["10_graph_replays_during_flips"] = stats(during_replay)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, action="append", help="pool size in GiB (repeatable; default 32 and 1.4)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--launches", type=int, default=200)
    ap.add_argument("--out", default="")
    ap.add_argument("--device", default="cuda", help="cpu with --memory host-shm: a smoke check of the probe itself")
    ap.add_argument("--memory", default="cuda-vmm")
    a = ap.parse_args()
    import torch

    from frmps_engine.sdk.memory import get_backend

    gpu = a.device.startswith("cuda")
    out = {"device": torch.cuda.get_device_name() if gpu else a.device, "memory": a.memory, "torch": torch.__version__,
           "sizes": []}
    for gib in a.gib or [32.0, 1.4]:
        out["sizes"].append(measure(get_backend(a.memory, device=a.device), gib, a.rounds, a.launches, a.device))
    text = json.dumps(out, indent=1)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
