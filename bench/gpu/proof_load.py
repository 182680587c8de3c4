"""The proofs' client side (failback_proof.py, tp_proof.py, openai_fault_proof.py):
the request bodies, one streamed request, the load of streams that repeat their
requests and compare every output with the no-fault one, the no-fault run, and
the gaps a client saw. Standard library only."""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from bench import proofcount, sse  # noqa: E402  (standard library only)


def now() -> float:
    return time.time()


def stream(base: str, model: str, body: dict, timeout: float = 900, live: list | None = None) -> dict:
    """One streaming completion: chunk arrival times with their token ids (each
    arrival time is also appended to ``live`` as it comes)."""
    req = sse.request(base + "/v1/completions", sse.stream_body({**body, "model": model}))
    out = {"chunks": [], "error": None, "finish": None, "t0": now(), "prompt_tokens": None}
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for ev in sse.events(r):
                if ev == sse.DONE:
                    break
                if "error" in ev:
                    out["error"] = ev["error"]
                    continue
                if ev.get("usage"):
                    out["prompt_tokens"] = ev["usage"].get("prompt_tokens")
                for ch in ev.get("choices") or []:
                    if ch.get("token_ids"):
                        t = now()
                        out["chunks"].append((t, list(ch["token_ids"])))
                        if live is not None:
                            live.append(t)
                    if ch.get("finish_reason"):
                        out["finish"] = ch["finish_reason"]
    except (urllib.error.URLError, OSError, ValueError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
    out["t1"] = now()
    out["ids"] = [t for _, ids in out["chunks"] for t in ids]
    return out


def wait_endpoint(base: str, timeout: float) -> None:
    """Until the OpenAI endpoint answers GET /v1/models (frmps's front door once an
    engine has served; vLLM's API server as the front door once its engine has connected)."""
    deadline = now() + timeout
    while True:
        try:
            with urllib.request.urlopen(base + "/v1/models", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if now() > deadline:
            raise TimeoutError(f"{base}/v1/models did not answer in {timeout:.0f} s")
        time.sleep(0.5)


def bodies(n: int, max_tokens: int) -> list[dict]:
    out = []
    for i in range(n):
        b = {"prompt": f"Request {i}: " + " ".join(f"w{(i * 7 + j) % 50}" for j in range(24 + 11 * i)),
             "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0}
        if i % 2:
            b.update(temperature=0.8, seed=1000 + i)
        out.append(b)
    return out


def burst_bodies(n: int, max_tokens: int, chunk: int) -> list[dict]:
    """The requests sent right before each fault (so that some are still queued or
    in their prefill when it lands): every other one with a prompt of 2/3 x chunk
    words (1.3-3 x chunk tokens: 2-4 tokens a word, so several prefill passes at
    --prefill-chunk), half seeded."""
    out = []
    for i in range(n):
        words = 2 * chunk // 3 if i % 2 == 0 and chunk else 16 + 3 * i
        b = {"prompt": f"Burst {i}: " + " ".join(f"w{(i * 11 + j) % 50}" for j in range(words)),
             "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0}
        if i % 4 >= 2:
            b.update(temperature=0.8, seed=2000 + i)
        out.append(b)
    return out


class Load:
    """--streams threads, each repeating its request and checking it against the
    reference; reqs past the first n_loop are the burst requests (burst())."""

    def __init__(self, dep: Any, model: str, reqs: list[dict], ref: list[list[int]], n_loop: int | None = None):
        self.dep, self.model, self.reqs, self.ref = dep, model, reqs, ref
        self.n_loop = len(reqs) if n_loop is None else n_loop
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.done: list[dict] = []  # finished streams: {i, t0, t1, times, exact, error, ...}
        self.live: dict[int, list[float]] = {}  # stream index -> chunk times of the running request
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(self.n_loop)]
        self.bursts: list[threading.Thread] = []

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def _one(self, i: int, burst: bool = False) -> None:
        live: list[float] = []
        key = i if not burst else -1 - i - 1000 * len(self.bursts)
        with self.lock:
            self.live[key] = live
        r = stream(self.dep.base, self.model, self.reqs[i], live=live)
        times = [t for t, _ in r["chunks"]]
        rec = {"i": i, "burst": burst, "t0": r["t0"], "t1": r["t1"], "times": times, "error": r["error"],
               "verdict": proofcount.verdict(self.ref[i], r["ids"], error=r["error"], finished=bool(r["finish"])),
               "tokens": len(r["ids"]), "finish": r["finish"]}
        rec["exact"] = rec["verdict"] == "exact"
        if not rec["exact"] and not r["error"]:
            n = next((k for k, (a, b) in enumerate(zip(r["ids"], self.ref[i])) if a != b), min(len(r["ids"]), len(self.ref[i])))
            rec["first_diff"] = n
        with self.lock:
            self.done.append(rec)
            self.live.pop(key, None)

    def _run(self, i: int) -> None:
        while not self.stop.is_set():
            self._one(i)

    def burst(self) -> int:
        """Sends every burst request once, each on a thread of its own (not waited for)."""
        for i in range(self.n_loop, len(self.reqs)):
            t = threading.Thread(target=self._one, args=(i, True), daemon=True)
            t.start()
            self.bursts.append(t)
        return len(self.reqs) - self.n_loop

    def finish(self, timeout: float = 600) -> None:
        self.stop.set()
        for t in self.threads + self.bursts:
            t.join(timeout)

    def chunk_times(self) -> list[list[float]]:
        """Chunk times of every stream so far, finished or running."""
        with self.lock:
            return [list(d["times"]) for d in self.done] + [list(v) for v in self.live.values()]

    def wait_all_streaming(self, min_chunks: int, timeout: float = 60) -> None:
        deadline = now() + timeout
        while now() < deadline:
            with self.lock:
                loop = [v for k, v in self.live.items() if k >= 0]  # the burst's streams are keyed < 0
                if len(loop) >= self.n_loop and all(len(v) >= min_chunks for v in loop):
                    return
            time.sleep(0.01)


def gaps_after(times_list: list[list[float]], t: float) -> float | None:
    """The longest wait from t to the next chunk, over streams that had a chunk before t and one after."""
    out = []
    for ts in times_list:
        before = [x for x in ts if x <= t]
        after = [x for x in ts if x > t]
        if before and after:
            out.append(after[0] - t)
    return max(out) if out else None


def max_gap_in(times_list: list[list[float]], lo: float, hi: float) -> float | None:
    """The longest inter-chunk gap of any stream whose chunks straddle [lo, hi]."""
    out = []
    for ts in times_list:
        inside = [x for x in ts if lo <= x <= hi]
        prev = [x for x in ts if x < lo]
        nxt = [x for x in ts if x > hi]
        seq = ([prev[-1]] if prev else []) + inside + ([nxt[0]] if nxt else [])
        if len(seq) >= 2 and prev and nxt:
            out.append(max(b - a for a, b in zip(seq, seq[1:])))
    return max(out) if out else None


def no_fault_run(dep, model: str, reqs: list[dict]) -> tuple[list[list[int]], dict]:
    """The requests once each, concurrently, before any fault: their token ids
    (what every later stream must equal) and the run's figures."""
    runs: list[dict] = [{}] * len(reqs)

    def one(i):
        runs[i] = stream(dep.base, model, reqs[i])

    ts = [threading.Thread(target=one, args=(i,)) for i in range(len(reqs))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    ref = [r["ids"] for r in runs]
    steps = [b - a for r in runs for (a, _), (b, _) in zip(r["chunks"], r["chunks"][1:])]
    return ref, {"errors": [r["error"] for r in runs if r["error"]], "tokens": [len(x) for x in ref],
                 "prompt_tokens": [r.get("prompt_tokens") for r in runs],
                 "decode_step_s_p50": statistics.median(steps) if steps else None,
                 "decode_step_s_p90": statistics.quantiles(steps, n=10)[8] if len(steps) >= 10 else None}
