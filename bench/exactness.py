"""What "exact" means for a resumed request, as code (bench/README.md, "What
exact means"), and the negative controls that show a comparison can fail.

A request is compared with the same request in a no-fault run:

- ``exact``: the same token ids, all of them.
- ``margin-bounded``: they differ, and at the first position where they do the
  no-fault run's top-1/top-2 logprob margin is below ``margin_bound``: a near tie
  that a recomputation in another pass shape (bf16 GEMMs are not batch-invariant)
  may flip. Counted and reported on its own, never as exact.
- ``inexact``: they differ anywhere else, or no margins are known there.
- ``completed``: an unseeded sampled request, which no run reproduces: it only
  has to finish (never counted as exact).

``margin_bound`` comes from no-fault runs that differ in batch composition only
(``margin_bound_from_runs``: one prompt run alone and the same prompt in a batch
of others), never from two identical runs, which agree bit for bit and would
excuse nothing that a takeover's other pass shapes can change.

``run_controls`` is the GPU proofs' driver of the negative controls
(``FRMPS_TEST_TAKEOVER_FAULT``, sdk/takeover_fault.py).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

from frmps_engine.sdk import takeover_fault
from frmps_engine.sdk.takeover_fault import CASES as CONTROL_CASES
from frmps_engine.sdk.takeover_fault import ENV as CONTROL_ENV
from frmps_engine.sdk.takeover_fault import TEST_MODE_ENV

EXACT, MARGIN_BOUNDED, INEXACT, COMPLETED = "exact", "margin-bounded", "inexact", "completed"
# The safety factor over the largest margin at which two no-fault runs were seen to disagree.
DEFAULT_SAFETY = 2.0


@dataclass(frozen=True)
class Verdict:
    kind: str  # EXACT, MARGIN_BOUNDED, INEXACT or COMPLETED
    first_divergence: int = -1  # index of the first output token that differs; -1 when none
    margin: float | None = None  # the no-fault run's top-1/top-2 margin there, when known
    detail: str = ""

    @property
    def ok(self) -> bool:
        """Exact, margin-bounded or completed: not a failure (margin-bounded is still
        reported on its own)."""
        return self.kind != INEXACT


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int:
    """Index of the first position where a and b differ (a length difference counts
    at the shorter one's end); -1 when they are equal."""
    n = min(len(a), len(b))
    for i in range(n):
        if int(a[i]) != int(b[i]):
            return i
    return -1 if len(a) == len(b) else n


def compare(reference_tokens: Sequence[int], observed_tokens: Sequence[int],
            reference_top2_margins: Sequence[float] | None = None, margin_bound: float = 0.0,
            deterministic: bool = True) -> Verdict:
    """The verdict on one request (module docstring). ``reference_top2_margins[i]``:
    the no-fault run's logprob of its token i minus that of the runner-up (>= 0).
    ``deterministic=False``: an unseeded sampled request (COMPLETED once it has
    tokens; no comparison)."""
    if margin_bound < 0 or math.isnan(margin_bound):
        raise ValueError(f"margin_bound must be >= 0, got {margin_bound!r}")
    if not deterministic:
        if not observed_tokens:
            return Verdict(INEXACT, 0, None, "an unseeded sampled request produced no tokens")
        return Verdict(COMPLETED, detail="unseeded sampled request: completed, not compared")
    i = first_divergence(reference_tokens, observed_tokens)
    if i < 0:
        return Verdict(EXACT)
    what = (f"token {i}: no-fault {reference_tokens[i] if i < len(reference_tokens) else '<end>'}, "
            f"observed {observed_tokens[i] if i < len(observed_tokens) else '<end>'}")
    margin = None
    if reference_top2_margins is not None and i < len(reference_top2_margins) and i < len(reference_tokens) \
            and i < len(observed_tokens):
        margin = float(reference_top2_margins[i])
    if margin is not None and margin < margin_bound:
        return Verdict(MARGIN_BOUNDED, i, margin, f"{what}; no-fault top-2 margin {margin:.4g} < bound {margin_bound:.4g}")
    why = "no margin known there" if margin is None else f"no-fault top-2 margin {margin:.4g} >= bound {margin_bound:.4g}"
    return Verdict(INEXACT, i, margin, f"{what}; {why}")


def top2_margin(top_logprobs: Mapping[object, float] | Sequence[float]) -> float:
    """The top-1/top-2 logprob margin of one position from its top logprobs (a
    mapping token -> logprob, as OpenAI's ``top_logprobs`` entry, or the logprobs
    alone); needs at least two."""
    vals = sorted((float(v) for v in (top_logprobs.values() if isinstance(top_logprobs, Mapping) else top_logprobs)),
                  reverse=True)
    if len(vals) < 2:
        raise ValueError("a top-2 margin needs at least two logprobs (ask for top_logprobs >= 2)")
    return vals[0] - vals[1]


@dataclass(frozen=True)
class Disagreement:
    index: int  # which pair
    position: int
    margin: float


def margin_bound_from_runs(alone_tokens: Sequence[Sequence[int]], alone_margins: Sequence[Sequence[float]],
                           batched_tokens: Sequence[Sequence[int]], safety: float = DEFAULT_SAFETY
                           ) -> tuple[float, list[Disagreement]]:
    """The margin bound from no-fault runs that differ in batch composition only:
    pair i is one prompt run alone (its tokens and top-2 margins) and the same
    prompt run in a batch of other prompts. The bound is the largest of the alone
    run's margins at the first position where a pair disagrees, times ``safety``;
    0.0 when no pair disagrees (then nothing is excused). Returns (bound, the
    disagreements)."""
    if not (len(alone_tokens) == len(alone_margins) == len(batched_tokens)):
        raise ValueError("margin_bound_from_runs: one alone run, its margins and one batched run per prompt")
    if safety < 1:
        raise ValueError(f"safety factor must be >= 1, got {safety!r}")
    seen: list[Disagreement] = []
    for k, (a, m, b) in enumerate(zip(alone_tokens, alone_margins, batched_tokens)):
        i = first_divergence(a, b)
        if i < 0 or i >= min(len(a), len(b)):
            continue  # equal, or one is a prefix of the other (a length limit): no token flipped
        if i >= len(m):
            raise ValueError(f"pair {k}: they disagree at token {i}, and the alone run has no margin there")
        seen.append(Disagreement(k, i, float(m[i])))
    return (max(d.margin for d in seen) * safety if seen else 0.0), seen


@dataclass
class Tally:
    """Verdicts counted by kind, with the non-exact ones listed."""

    counts: dict[str, int] = field(default_factory=lambda: {EXACT: 0, MARGIN_BOUNDED: 0, INEXACT: 0, COMPLETED: 0})
    notes: list[str] = field(default_factory=list)

    def add(self, name: str, v: Verdict) -> None:
        self.counts[v.kind] += 1
        if v.kind in (MARGIN_BOUNDED, INEXACT):
            self.notes.append(f"{name}: {v.kind}: {v.detail}")

    @property
    def ok(self) -> bool:
        return self.counts[INEXACT] == 0

    def line(self) -> str:
        c = self.counts
        return (f"{c[EXACT]} exact, {c[MARGIN_BOUNDED]} margin-bounded, {c[INEXACT]} inexact, "
                f"{c[COMPLETED]} completed (unseeded sampled)")


# ---- negative controls -----------------------------------------------------------

_APPLIED = re.compile(re.escape(takeover_fault.APPLIED) + r" (\S+) applied to request (\d+) \(prompt of (\d+) tokens\)")


def control_env(case: str | None) -> dict[str, str]:
    """The engines' environment for one control case (None: the positive run, in
    test mode with no control)."""
    env = {TEST_MODE_ENV: "1"}
    if case:
        env[CONTROL_ENV] = case
    return env


def applied_controls(log_text: str) -> list[tuple[str, int]]:
    """(case, request key) of every control the engines' log says they applied, once
    each (a line may be in the supervisor's log and in the engine's own)."""
    return list(dict.fromkeys((m.group(1), int(m.group(2))) for m in _APPLIED.finditer(log_text)))


_NOT_APPLIED = re.compile(re.escape(takeover_fault.APPLIED) + r" (\S+) NOT applied: (.*)")


def control_lines(log_text: str) -> dict[str, dict]:
    """Per case, what the engines' log says of it: how many times it was applied,
    and why not where it found no request (``takeover_fault.not_applied_line``)."""
    out: dict[str, dict] = {}
    for m in _APPLIED.finditer(log_text):
        out.setdefault(m.group(1), {"applied": 0, "not_applied": []})["applied"] += 1
    for m in _NOT_APPLIED.finditer(log_text):
        out.setdefault(m.group(1), {"applied": 0, "not_applied": []})["not_applied"].append(m.group(2).strip())
    return out


def engine_logs(log_dir: str) -> str:
    """Every engine's log of a deployment (its ``*.log`` files but the supervisor's
    ``frmps.log``), one text: where ``control_lines`` reads the controls' lines."""
    text = []
    for name in sorted(os.listdir(log_dir)):
        if name.endswith(".log") and name != "frmps.log":
            with open(os.path.join(log_dir, name), errors="replace") as f:
                text.append(f.read())
    return "\n".join(text)


def applied_prompt_lengths(log_text: str) -> list[tuple[str, int]]:
    """(case, prompt length in tokens) of every control applied: how a client that
    does not know the engine's request keys finds the request a control hit."""
    return list(dict.fromkeys((m.group(1), int(m.group(3))) for m in _APPLIED.finditer(log_text)))


@dataclass
class ControlRun:
    """One deployment's failover run under one case, as ``run_case`` reports it:
    the no-fault and the resumed tokens per request key (a request the failover
    lost or failed has no entry in ``observed``, or an empty list), the engines'
    log (for the controls' lines), and optionally the no-fault margins and which
    requests are unseeded sampled ones."""

    reference: Mapping[int, Sequence[int]]
    observed: Mapping[int, Sequence[int]]
    log_text: str
    margins: Mapping[int, Sequence[float]] = field(default_factory=dict)
    unseeded: Iterable[int] = ()


@dataclass
class ControlResult:
    case: str | None
    applied: list[tuple[str, int]]
    verdicts: dict[int, Verdict]

    @property
    def detected(self) -> bool:
        """The control was applied, and the comparison failed for a request it hit."""
        hit = {k for _, k in self.applied}
        return bool(hit) and any(not self.verdicts[k].ok for k in hit if k in self.verdicts)

    def line(self) -> str:
        bad = {k: v.kind for k, v in self.verdicts.items() if v.kind != EXACT}
        return f"control {self.case or 'none'}: applied to {self.applied or 'nothing'}; non-exact: {bad or 'none'}"


class ControlsError(AssertionError):
    """A negative control passed unnoticed (or the positive run was not exact)."""


def judge(case: str | None, run: ControlRun, margin_bound: float = 0.0) -> ControlResult:
    unseeded = set(run.unseeded)
    verdicts: dict[int, Verdict] = {}
    for key, ref in run.reference.items():
        verdicts[key] = compare(ref, list(run.observed.get(key, ())), run.margins.get(key), margin_bound,
                                deterministic=key not in unseeded)
    return ControlResult(case, [a for a in applied_controls(run.log_text) if case is None or a[0] in case.split(",")],
                         verdicts)


def run_controls(run_case: Callable[[str | None], ControlRun], cases: Sequence[str] = CONTROL_CASES,
                 margin_bound: float = 0.0, positive: bool = True, say: Callable[[str], None] = print
                 ) -> list[ControlResult]:
    """Run each negative control, and the positive run (no control) first, and
    raise ControlsError unless every control was applied and made the comparison
    fail for a request it hit, and the positive run is exact (margin-bounded
    allowed). ``run_case(case)`` starts a deployment whose engines have
    ``control_env(case)`` in their environment, runs the workload without a fault
    and again with a failover (SIGKILL of the active mid-decode, with at least two
    requests with KV blocks, one of them sampled with a seed), stops it and
    returns the ControlRun."""
    results: list[ControlResult] = []
    problems: list[str] = []
    for case in ([None] if positive else []) + list(cases):
        r = judge(case, run_case(case), margin_bound)
        results.append(r)
        say(r.line())
        if case is None:
            if r.applied:
                problems.append(f"positive run: controls applied without being asked for: {r.applied}")
            bad = [f"{k}: {v.detail}" for k, v in r.verdicts.items() if not v.ok]
            if bad:
                problems.append("positive run (no control) not exact: " + "; ".join(bad))
        elif not r.applied:
            problems.append(f"control {case}: not applied (its log line is missing: no adopted request fitted?)")
        elif not r.detected:
            problems.append(f"control {case} passed unnoticed: applied to {r.applied}, and those requests compare "
                            f"{[r.verdicts[k].kind for _, k in r.applied if k in r.verdicts]}")
    if problems:
        raise ControlsError("negative controls: " + " | ".join(problems))
    return results
