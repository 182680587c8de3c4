"""How the fault proofs and soaks count streams (standard library only).

One definition, used by bench/gpu/failback_proof.py (and the soaks it drives),
tp_proof.py, openai_fault_proof.py, the correctness experiment's K sweep and the
CPU chaos soak:

* An **event** is a fault or a handover, as a window of time [lo, hi]: a fault
  from the moment it was injected to the moment frmps detected the engine's
  death; a handover (failback) from its start to its end.
* A stream is **in flight** at an event when its request was sent no later than
  the event's end (``t_start <= hi``) and it was still running after the event's
  start: its last token came after ``lo`` (or, for a stream that failed or
  delivered nothing, its end came after ``lo``). A stream that ended before the
  event, or was sent after it, is not in flight and is counted apart.
* Its **phase** at the event (taken at ``lo``): ``decoding`` when its first token
  had arrived; otherwise ``mid-prefill`` when its prompt is longer than the
  engine's prefill chunk (max_num_batched_tokens: the prompt needs several
  passes), else ``waiting`` (queued, or a prompt that fits one pass; the client
  cannot tell those apart). Unknown prompt length: ``waiting/prefill``; a
  request answered in one piece (not streamed): ``unknown``.
* Its **verdict** against the no-fault reference: ``exact``, ``margin-bounded``,
  ``inexact`` (see :func:`verdict`); a request sampled without a seed has no
  reference and is ``completed`` or ``failed``, never exact.

The headline a proof prints and writes: "X/Y streams in flight at a fault or
handover exact (Z margin-bounded, W inexact); U completed unseeded; plus N not
in flight", and the same per phase.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from frmps_engine.sdk.takeover_fault import CASES as CONTROL_CASES
from frmps_engine.sdk.takeover_fault import ENV as CONTROL_ENV
from . import exactness

PHASES = ("decoding", "mid-prefill", "waiting", "waiting/prefill", "unknown")
VERDICTS = ("exact", "margin-bounded", "inexact")

# The negative controls (CONTROL_CASES, sdk/takeover_fault.py): FRMPS_TEST_TAKEOVER_FAULT=<case>
# (with FRMPS_TEST_MODE=1) makes the engine that takes over corrupt what it adopts in one way
# each; a proof that compares its outputs must see every one of them.
# The control run without a switch: the same short deployment, fault and comparison. It
# must compare exact, or the comparison cannot tell a broken takeover from a good one
# (a control "detected" then says nothing).
POSITIVE = "positive"


def _verdict(reference_tokens: Sequence[int], observed_tokens: Sequence[int],
             reference_top2_margins: Sequence[float] | None = None) -> str:
    """exactness.compare's verdict ("exact", "margin-bounded" or "inexact"). No
    proof sets a margin bound yet, so a difference is "inexact" whatever its
    margin (bench/README.md, "What exact means")."""
    return exactness.compare(list(reference_tokens), list(observed_tokens), reference_top2_margins).kind


def verdict(reference_tokens: Sequence[int] | None, observed_tokens: Sequence[int] | None, *,
            unseeded: bool = False, error: str | None = None, finished: bool = True,
            reference_top2_margins: Sequence[float] | None = None) -> str:
    """A stream's verdict: "completed"/"failed" for an unseeded request (sampled
    with a random seed: nothing to compare with), "inexact" for a stream that
    failed or has no reference, else _verdict's."""
    if unseeded:
        return "completed" if not error and finished else "failed"
    if error or reference_tokens is None or observed_tokens is None:
        return "inexact"
    return _verdict(reference_tokens, observed_tokens, reference_top2_margins)


def in_flight(t_start: float, token_times: Sequence[float], t_end: float, lo: float, hi: float,
              failed: bool = False) -> bool:
    """Whether a stream was in flight at the event [lo, hi] (see the module's text)."""
    if t_start > hi:
        return False
    last = t_end if failed or not token_times else token_times[-1]
    return last > lo


def phase_at(token_times: Sequence[float], t: float, prompt_tokens: int | None = None,
             prefill_chunk: int | None = None) -> str:
    """A stream's phase at time t (see the module's text)."""
    if token_times and token_times[0] <= t:
        return "decoding"
    if prompt_tokens is None or not prefill_chunk:
        return "waiting/prefill"
    return "mid-prefill" if prompt_tokens > prefill_chunk else "waiting"


def classify(t_start: float, token_times: Sequence[float], t_end: float,
             events: Iterable[tuple[str, float, float]], *, failed: bool = False,
             prompt_tokens: int | None = None, prefill_chunk: int | None = None, streamed: bool = True) -> dict:
    """Against events (label, lo, hi) in time order: {"in_flight", "event" (the
    first one it was in flight at), "events" (every one), "phase" (at that first
    one)}. Not in flight: {"in_flight": False, "event": None, "events": [], "phase": None}."""
    hits = [(label, lo, hi) for label, lo, hi in events if in_flight(t_start, token_times, t_end, lo, hi, failed)]
    if not hits:
        return {"in_flight": False, "event": None, "events": [], "phase": None}
    label, lo, _ = hits[0]
    return {"in_flight": True, "event": label, "events": [h[0] for h in hits],
            "phase": phase_at(token_times, lo, prompt_tokens, prefill_chunk) if streamed else "unknown"}


def _blank() -> dict:
    return {"streams": 0, "exact": 0, "margin-bounded": 0, "inexact": 0, "completed": 0, "failed": 0}


def tally(streams: Iterable[dict]) -> dict:
    """Counts over classified streams (each with "in_flight", "phase", "verdict" and,
    where known, "max_abs_dlogprob"): in flight (compared streams: "streams" and one
    count per verdict; unseeded ones: "completed"/"failed"), per phase the same, and
    the streams not in flight."""
    out = {"in_flight": _blank(), "by_phase": {}, "not_in_flight": 0, "not_in_flight_not_exact": 0,
           "max_abs_dlogprob": None}
    for s in streams:
        v = s["verdict"]
        if not s.get("in_flight"):
            out["not_in_flight"] += 1
            out["not_in_flight_not_exact"] += v not in ("exact", "completed")
            continue
        ph = out["by_phase"].setdefault(s.get("phase") or "waiting/prefill", _blank())
        for c in (out["in_flight"], ph):
            if v in ("completed", "failed"):
                c[v] += 1
            else:
                c["streams"] += 1
                c[v] += 1
        d = s.get("max_abs_dlogprob")
        if d is not None:
            out["max_abs_dlogprob"] = max(out["max_abs_dlogprob"] or 0.0, float(d))
    return out


def headline(t: dict) -> str:
    """The headline of a tally, and its per-phase figures."""
    f = t["in_flight"]
    s = (f"{f['exact']}/{f['streams']} streams in flight at a fault or handover exact "
         f"({f['margin-bounded']} margin-bounded, {f['inexact']} inexact); {f['completed']} completed unseeded")
    if f["failed"]:
        s += f" ({f['failed']} unseeded failed)"
    s += f"; plus {t['not_in_flight']} not in flight"
    if t.get("not_in_flight_not_exact"):
        s += f" ({t['not_in_flight_not_exact']} of them not exact)"
    phases = [p for p in PHASES if p in t["by_phase"]]
    if phases:
        s += " | by phase: " + ", ".join(
            f"{p} {t['by_phase'][p]['exact']}/{t['by_phase'][p]['streams']} exact"
            + (f" +{t['by_phase'][p]['completed']} unseeded completed" if t['by_phase'][p]['completed'] else "")
            for p in phases)
    if t.get("max_abs_dlogprob") is not None:
        s += f" | max |Δlogprob| {t['max_abs_dlogprob']:.5g}"
    return s


def max_abs_dlogprob(reference: Sequence[float | None] | None, observed: Sequence[float | None] | None) -> float | None:
    """The largest |Δ logprob| over the positions both have (None when neither has any)."""
    pairs = [(a, b) for a, b in zip(reference or [], observed or []) if a is not None and b is not None]
    return round(max(abs(float(a) - float(b)) for a, b in pairs), 6) if pairs else None


# ----------------------------------------------------------------------------- negative controls


class ControlPassedUnnoticed(RuntimeError):
    """A negative control compared exact: the proof cannot see that kind of corruption."""


def control_env(case: str) -> dict[str, str]:
    """The engines' environment for one negative-control case."""
    if case == POSITIVE:
        return {}
    if case not in CONTROL_CASES:
        raise ValueError(f"unknown control case {case!r} (one of {', '.join(CONTROL_CASES)})")
    return exactness.control_env(case)


# The controls' deployments sync every this many steps at least: the position case
# needs a request two tokens past its last sync at the fault, which syncing every
# step seldom leaves.
CONTROL_SYNC_EVERY = 16


def control_sync_every(sync_every: int | None) -> int:
    """The --sync-every of a controls' deployment, from the run's own."""
    return max(int(sync_every or 1), CONTROL_SYNC_EVERY)


def control_unapplied(case: str, error: str | None, applied: int | None, not_applied: Sequence[str] | None) -> bool:
    """Whether a control's run found no adopted request its case fits, and so says
    nothing yet: a case, not the positive run, that ran without error, was applied
    nowhere, and the engines' logs said why (``takeover_fault.not_applied_line``).
    Which requests a takeover adopts, and how far past their last sync, depends on
    where the fault lands, so the proofs run such a case again across another fault,
    up to their --control-attempts; never applied after them, check_controls fails it."""
    return case != POSITIVE and not error and not applied and bool(not_applied)


def control_not_run(case: str, error: str | None, applied: int | None) -> str | None:
    """Why a control's record says nothing of its case, or None: a case, not the
    positive run, whose run failed (error) where the engines' logs show it applied
    nowhere (applied 0, or not read). control_result counts a failed run as
    detected, which holds where the case broke the takeover, not where the run
    failed for another reason before it (a deployment that did not start, the
    caller's time bound): such a record is "not run", and the proof stops."""
    if case == POSITIVE or not error or applied:
        return None
    return f"the run failed before the engines applied the case: {error}"


def switch_env(path: str) -> dict[str, str]:
    """The engines' environment for the controls in one deployment: test mode, the
    cases read from the file at ``path`` at each takeover (empty: none)."""
    return {**exactness.control_env(None), CONTROL_ENV: "@" + path}


def control_result(case: str, streams: Sequence[dict], failover_ok: bool | None, error: str | None = None) -> dict:
    """One control's record from its classified streams: detected when a stream in
    flight at the fault is not exact, or the failover (or the run) failed;
    streams_affected: the streams in flight that are not exact."""
    fl = [s for s in streams if s.get("in_flight")]
    affected = sum(1 for s in fl if s["verdict"] not in ("exact", "completed"))
    how = []
    if affected:
        how.append(f"{affected} stream(s) in flight not exact")
    if failover_ok is False:
        how.append("failover failed")
    if error:
        how.append(f"run failed: {error}")
    return {"case": case, "detected": bool(how), "how": "; ".join(how) or None, "streams": len(streams),
            "streams_in_flight": len(fl), "streams_affected": affected, "failover_ok": failover_ok, "error": error,
            "tally": tally(streams)}


def check_controls(results: Sequence[dict]) -> None:
    """Raises ControlPassedUnnoticed naming every case that was not detected, and
    when the positive run (no switch), where there is one, was not exact: any of its
    streams, in flight at the fault or not, not exact, or its failover failed. Then
    every "detected" is void: the comparison fails without a broken takeover too."""
    pos = [r for r in results if r["case"] == POSITIVE]
    for r in pos:
        t = r.get("tally") or {}
        if r["detected"] or t.get("not_in_flight_not_exact"):
            raise ControlPassedUnnoticed(
                f"the positive run (no control) is not exact ({r['how'] or ''}"
                f"{'; ' if r['how'] and t.get('not_in_flight_not_exact') else ''}"
                f"{str(t.get('not_in_flight_not_exact')) + ' stream(s) not in flight not exact' if t.get('not_in_flight_not_exact') else ''}): "
                "the comparison fails without a broken takeover, so no control can be told from it")
    missed = [r for r in results if r["case"] != POSITIVE and not r["detected"]]
    if missed:
        raise ControlPassedUnnoticed(", ".join(f"control {r['case']} {unnoticed(r)}" for r in missed))


def unnoticed(r: dict) -> str:
    """How a control that was not detected went: applied and unnoticed, or never
    applied (the engines' log said why), or not known (no log was read)."""
    applied = r.get("applied")
    if applied is None:
        return "passed unnoticed"
    if applied:
        return f"passed unnoticed (applied {applied} time(s))"
    why = "; ".join(dict.fromkeys(r.get("not_applied") or [])) or "the engines' logs say nothing of it"
    return f"was never applied ({why})"


def controls_arg(s: str) -> list[str]:
    """--controls: "on" (the positive run, then every case), "off", or a comma list
    of cases (``positive``: the run without a switch)."""
    if s == "on":
        return [POSITIVE, *CONTROL_CASES]
    if s == "off":
        return []
    cases = [c for c in s.split(",") if c]
    for c in cases:
        control_env(c)  # raises on an unknown case
    return cases
