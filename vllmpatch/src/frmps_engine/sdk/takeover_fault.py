"""Negative controls for takeover exactness: a test-and-bench-only switch that
breaks one adopted request on purpose, so that a check comparing resumed output
with the no-fault output can be shown to fail (a check is only a check if it can).

``FRMPS_TEST_TAKEOVER_FAULT`` (one case or a comma list), refused at start unless
``FRMPS_TEST_MODE=1`` is set too. Read by the engine process when it starts and
applied at every takeover it makes. ``FRMPS_TEST_TAKEOVER_FAULT=@PATH`` instead
reads the cases from the file PATH at each takeover (a comma list; an empty or
missing file: none), so that one deployment can run the run without a control
and every case in turn, each across its own fault (a bench's driver rewrites
the file between faults; every engine of the deployment, spares included, reads
it). Applied: a Resume after a failover and a planned
handover's (failback's) Resume alike, in both the generation-API and the
vLLM-frontend (core) modes; each case goes to ONE adopted request, and a WARNING
line names the case and the request's key (``applied_line``), or says that no
adopted request fitted (``not_applied_line``). This is not a debug switch: it
stays, and is exempt from any cleanup of ``FRMPS_DEBUG_*`` switches.

Cases (``CASES``):

The KV cases and ``shift-table`` go to greedy (temperature 0) requests only: a
sampled request's noise can mask a small KV error, and a control must make the
comparison fail; ``sampler-offset`` goes to a sampled one.

- ``zero-block``: the first adopted block of the request is zeroed (every layer,
  K and V) before the first resumed step touches the KV cache.
- ``swap-block``: its first adopted block is swapped with another adopted
  request's first block (needs two adopted requests with blocks).
- ``shift-table``: its block table is rotated by one block (needs two blocks).
- ``position``: the engine is told one more computed token than the snapshot
  says (``num_computed + 1``), and that token's KV slot is zeroed: after the last
  sync the dead engine may have written it, and a standby must not rely on what
  the snapshot does not vouch for. Only a request with at least two tokens past
  its computed count fits: an engine recomputes the last known token whatever
  the count says, so at the usual ``num_computed = tokens - 1`` an off-by-one is
  absorbed (harmless, and undetectable).
- ``sampler-offset``: a sampled (temperature > 0) request's sampler draws the
  noise of the next position (the seeded stream advanced by one).

What an engine needs (``engine_api.TakeoverFaultHooks``): ``fault_kv`` for the
KV-content cases (``zero-block``, ``swap-block``, ``position``),
``shift_sampler`` for ``sampler-offset``; ``shift-table`` needs nothing.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable

log = logging.getLogger(__name__)

ENV = "FRMPS_TEST_TAKEOVER_FAULT"
TEST_MODE_ENV = "FRMPS_TEST_MODE"
CASES = ("zero-block", "swap-block", "shift-table", "position", "sampler-offset")
# Cases that write the KV cache (engine_api.TakeoverFaultHooks.fault_kv).
KV_CASES = ("zero-block", "swap-block", "position")
APPLIED = "takeover fault control"  # the start of every line this module logs about a control


class ControlError(ValueError):
    """A bad FRMPS_TEST_TAKEOVER_FAULT setting; the engine refuses to start."""


def _cases(raw: str, what: str) -> tuple[str, ...]:
    cases = tuple(dict.fromkeys(c.strip() for c in raw.split(",") if c.strip()))
    bad = [c for c in cases if c not in CASES]
    if bad:
        raise ControlError(f"{what}: unknown case {', '.join(bad)} (known: {', '.join(CASES)})")
    return cases


def _setting(env: dict[str, str] | None) -> tuple[str, tuple[str, ...], str | None]:
    """(raw value, cases, file): the cases named in the variable, or every case
    and the file's path for ``@PATH``. Raises ControlError, one line, for an
    unknown case, an empty path, or without ``FRMPS_TEST_MODE=1``."""
    env = os.environ if env is None else env
    raw = env.get(ENV, "").strip()
    if not raw:
        return "", (), None
    path = None
    if raw.startswith("@"):
        path = raw[1:].strip()
        if not path:
            raise ControlError(f"{ENV}={raw!r}: '@' wants a file's path (the cases, read at each takeover)")
        cases = CASES
    else:
        cases = _cases(raw, f"{ENV}={raw!r}")
    if env.get(TEST_MODE_ENV, "") != "1":
        raise ControlError(f"{ENV}={raw!r} breaks takeovers on purpose (a test and bench negative control) and is "
                           f"refused unless {TEST_MODE_ENV}=1 is set")
    return raw, cases, path


def parse(env: dict[str, str] | None = None) -> tuple[str, ...]:
    """The cases ``FRMPS_TEST_TAKEOVER_FAULT`` may apply (empty when unset; every
    case for ``@PATH``). Raises ControlError, one line, for an unknown case or
    without ``FRMPS_TEST_MODE=1``."""
    return _setting(env)[1]


def from_env(block_size: int, env: dict[str, str] | None = None) -> "TakeoverFaults | None":
    """The engine's controls (None when the variable is unset); ControlError as parse."""
    raw, cases, path = _setting(env)
    return TakeoverFaults(cases, int(block_size), path=path) if raw else None


def read_cases(path: str) -> tuple[str, ...]:
    """The cases the file at ``path`` names now (none when it is missing or empty).
    Raises ControlError for an unknown case."""
    try:
        with open(path) as f:
            raw = f.read()
    except FileNotFoundError:
        return ()
    return _cases(raw.replace("\n", ","), f"{ENV}=@{path} ({raw.strip()!r})")


def applied_line(case: str, key: int, num_prompt: int, detail: str) -> str:
    return f"{APPLIED} {case} applied to request {key} (prompt of {num_prompt} tokens): {detail}"


def not_applied_line(case: str, why: str) -> str:
    return f"{APPLIED} {case} NOT applied: {why}"


@dataclass
class _Adopted:
    key: int
    num_prompt: int
    blocks: list[int]  # as given to the engine


@dataclass
class TakeoverFaults:
    """The cases to apply at each takeover of this engine (``parse``)."""

    cases: tuple[str, ...]  # for a file: every case it may name
    block_size: int
    path: str | None = None  # FRMPS_TEST_TAKEOVER_FAULT=@PATH: the cases are read at each takeover

    def describe(self) -> str:
        return f"{ENV}=@{self.path} (read at each takeover)" if self.path else f"{ENV}={','.join(self.cases)}"

    def check_core(self, core: Any) -> None:
        """Raise ControlError when the core cannot apply a case (the engine refuses to start)."""
        from .engine_api import TakeoverFaultHooks

        need = [c for c in self.cases if c in KV_CASES or c == "sampler-offset"]
        if not need:
            return
        if not isinstance(core, TakeoverFaultHooks):
            raise ControlError(f"{self.describe()}: this engine's core has no takeover fault hooks "
                               f"(engine_api.TakeoverFaultHooks), needed by {', '.join(need)}")
        try:
            core.check_takeover_faults(need)
        except ValueError as e:
            raise ControlError(f"{self.describe()}: {e}") from None

    def arm(self, core: Any) -> "_Armed":
        """One takeover's controls. With a file, the cases it names now (logged; a
        file that names an unknown case applies none and says so)."""
        if self.path is None:
            return _Armed(self, core, self.cases)
        try:
            cases = read_cases(self.path)
        except ControlError as e:
            log.error("%s: %s: none applied at this takeover", APPLIED, e)
            cases = ()
        log.warning("%s: this takeover's cases from %s: %s", APPLIED, self.path, ",".join(cases) or "none")
        return _Armed(self, core, cases)


@dataclass
class _Armed:
    """One takeover's controls: ``install`` wraps the core's adopt_request for the
    adoption, ``remove`` restores it and logs the cases that found no request,
    ``gate(wait)`` / ``apply_kv`` write the KV cache once it is writable and
    before the first resumed step touches it."""

    faults: TakeoverFaults
    core: Any
    cases: tuple[str, ...] = ()
    pending: set[str] = field(default_factory=set)
    kv_ops: list[tuple[str, int, int, int]] = field(default_factory=list)  # (op, block, other, slot)
    swap_first: _Adopted | None = None
    _had_own: bool = False
    _own: Any = None

    def __post_init__(self) -> None:
        self.pending = set(self.cases)

    def install(self) -> None:
        own = vars(self.core).get("adopt_request")
        self._had_own, self._own = own is not None, own
        inner = self.core.adopt_request

        def adopt_request(key, params, token_ids, num_prompt, num_computed, block_ids, seed, delivered, *a, **kw):
            return self._adopt(inner, key, params, token_ids, num_prompt, num_computed, block_ids, seed, delivered,
                               *a, **kw)

        self.core.adopt_request = adopt_request

    def remove(self) -> None:
        if self._had_own:
            self.core.adopt_request = self._own
        else:
            vars(self.core).pop("adopt_request", None)
        for case in sorted(self.pending):
            why = {
                "swap-block": "no adopted greedy request with KV blocks and another adopted request with KV blocks",
                "shift-table": "no adopted greedy request with two or more KV blocks",
                "position": "no adopted greedy request with two or more tokens past its computed count",
                "sampler-offset": "no adopted sampled (temperature > 0) request with KV blocks",
            }.get(case, "no adopted greedy request with KV blocks")
            log.warning("%s", not_applied_line(case, why))

    def _adopt(self, inner: Callable[..., Any], key, params, token_ids, num_prompt, num_computed, block_ids, seed,
               delivered, *a, **kw):
        blocks = list(block_ids)
        nc = int(num_computed)
        bs = self.faults.block_size
        notes: list[tuple[str, str]] = []
        post: list[tuple[str, str, Any]] = []
        sampled = float(getattr(params, "temperature", 0.0) or 0.0) > 1e-5
        if blocks and nc > 0:
            # The KV cases go to greedy requests only: a sampled request's noise can
            # mask a small KV error (seen: one zeroed slot of ~100 left a seeded
            # request at temperature 0.9 unchanged on the tiny model), and a control
            # must make the comparison fail. sampler-offset goes to a sampled one.
            if "shift-table" in self.pending and not sampled and len(blocks) >= 2:
                self.pending.discard("shift-table")
                blocks = blocks[1:] + blocks[:1]
                notes.append(("shift-table", f"block table rotated by one: {list(block_ids)[:4]}... -> {blocks[:4]}..."))
            n_delivered = len(delivered) if delivered is not None else 0
            if ("position" in self.pending and not sampled and nc + 1 <= len(token_ids) and nc + 2 <= num_prompt + n_delivered
                    and -(-(nc + 1) // bs) <= len(blocks)):
                self.pending.discard("position")
                post.append(("position", f"num_computed {nc} -> {nc + 1}; the KV slot of token {nc} zeroed",
                             ("zero", blocks[nc // bs], -1, nc % bs)))
                nc += 1
            if "zero-block" in self.pending and not sampled:
                self.pending.discard("zero-block")
                post.append(("zero-block", f"KV block {blocks[0]} (its first) zeroed", ("zero", blocks[0], -1, -1)))
            if "swap-block" in self.pending:
                if self.swap_first is None and not sampled:
                    self.swap_first = _Adopted(int(key), int(num_prompt), blocks)
                elif self.swap_first is not None:
                    self.pending.discard("swap-block")
                    first = self.swap_first
                    post.append(("swap-block", f"KV block {first.blocks[0]} (its first) swapped with block "
                                 f"{blocks[0]} of request {key}", ("swap", first.blocks[0], blocks[0], -1)))
            if "sampler-offset" in self.pending and sampled:
                self.pending.discard("sampler-offset")
                post.append(("sampler-offset", "the sampler draws the noise of the next position", "sampler"))
        try:
            res = inner(key, params, token_ids, num_prompt, nc, blocks, seed, delivered, *a, **kw)
        except BaseException:  # not adopted: the cases stay for another request
            self.pending.update(c for c, _ in notes)
            self.pending.update(c for c, _, _ in post)
            if self.swap_first is not None and self.swap_first.key == int(key):
                self.swap_first = None
            raise
        for case, detail in notes:
            log.warning("%s", applied_line(case, int(key), int(num_prompt), detail))
        for case, detail, op in post:
            if op == "sampler":
                self.core.shift_sampler(int(key), 1)
            else:
                self.kv_ops.append(op)
            if case == "swap-block" and self.swap_first is not None:
                who, n = self.swap_first.key, self.swap_first.num_prompt
            else:
                who, n = int(key), int(num_prompt)
            log.warning("%s", applied_line(case, who, n, detail))
        return res

    def apply_kv(self) -> None:
        """Write the KV cache as the cases asked (once)."""
        ops, self.kv_ops = self.kv_ops, []
        for op, block, other, slot in ops:
            self.core.fault_kv(op, block, other, slot)

    def gate(self, wait: Callable[[], None]) -> Callable[[], None]:
        """A device gate's wait that applies the KV writes after the flip and before
        the step's first device work that touches the KV cache."""

        def gated() -> None:
            wait()
            self.apply_kv()

        return gated
