"""Exact mode: every token's KV and logits come from a pass whose shapes depend
only on its own request, so a takeover reproduces the no-fault run bit for bit
on hardware whose kernels are not batch-invariant (bf16 cuBLAS on a GPU).

On the CPU these tests switch batch_invariant off, so the exactness they check
comes from exact mode's scheduling alone, and they check the structural
property itself: each (request, position) is computed by a pass of the same
shape in the no-fault run, in a run with other arrivals, and across a takeover.
The GPU proof (bench/gpu) checks the token equality on an H100-class GPU.
"""

from __future__ import annotations

import pytest

from e2e import require

torch = require("torch")
# one_torch_thread (conftest.py): one intra-op thread for the whole module.
pytestmark = [pytest.mark.torch, pytest.mark.usefixtures("one_torch_thread")]

from frmps_engine.refengine import ConfigError, EngineConfig, RefCore, SamplingParams  # noqa: E402

B = 6  # max_num_seqs: the one decode batch size
C = 24  # max_num_batched_tokens: the prefill chunk alignment


def make_cfg(exact: bool = True, **kw) -> EngineConfig:
    kw.setdefault("num_blocks", 160)
    return EngineConfig.from_preset("tiny", max_num_seqs=B, max_num_batched_tokens=C,
                                    batch_invariant=False, exact=exact, **kw)


def requests(n: int = 4, max_tokens: int = 20):
    g = torch.Generator().manual_seed(11)
    out = []
    for i in range(n):
        sp = (SamplingParams(max_tokens=max_tokens + 3 * i, temperature=0.0, ignore_eos=True) if i % 2 == 0 else
              SamplingParams(max_tokens=max_tokens + 3 * i, temperature=0.9, top_p=0.9, top_k=40, seed=5 + i,
                             ignore_eos=True))
        out.append((100 + i, torch.randint(0, 256, (7 + 19 * i,), generator=g).tolist(), sp))
    return out


class Shapes:
    """Records, per (request key, position), the shape of the pass that computed it:
    (rows in the pass, the chunk's start, the chunk's length, logits rows)."""

    def __init__(self, core: RefCore):
        self.sig: dict[tuple[int, int], tuple] = {}
        self.mixed_steps = 0
        self.prefill_chunks: list[tuple[int, int, int]] = []  # (key, start, n)
        self.decode_rows: list[int] = []
        fwd, model_fwd = core._forward, core.model.forward
        current: list = []

        def forward(sched, on_launch=None):
            current[:] = sched
            return fwd(sched, on_launch)

        def model_forward(batch):
            kinds = set()
            for (r, n), sq in zip(current, batch.seqs):
                assert sq.q_len == n and sq.start_pos == r.num_computed
                for p in range(sq.start_pos, sq.start_pos + n):
                    self.sig[(r.key, p)] = (batch.input_ids.shape[0], sq.start_pos, n, batch.logits_rows.shape[0])
                decode = n == 1 and r.num_computed >= r.num_prompt
                kinds.add(decode)
                if not decode:
                    self.prefill_chunks.append((r.key, sq.start_pos, n))
            if kinds == {True}:
                self.decode_rows.append(batch.input_ids.shape[0])
            self.mixed_steps += len(kinds) > 1
            return model_fwd(batch)

        core._forward = forward
        core.model.forward = model_forward


def run_no_fault(reqs, cfg, stagger: int = 0):
    """All requests to the end; with stagger > 0 request i arrives at step i*stagger."""
    core = RefCore(cfg, RefCore.allocate_pools(cfg), True)
    shapes = Shapes(core)
    out = {k: [] for k, _, _ in reqs}
    pending = list(reqs)
    step = 0
    while pending or core.has_work():
        while pending and step >= stagger * (len(reqs) - len(pending)):
            core.add_request(*pending.pop(0))
        for o in core.step():
            out[o.key] += o.new_token_ids
        step += 1
    return out, shapes, core


def run_failover(reqs, cfg, kill_step: int, sync_every: int, lag: int):
    """The active runs kill_step steps (syncing every sync_every); the client lags
    `lag` tokens behind it; a standby on the same pools adopts and finishes."""
    pools = RefCore.allocate_pools(cfg)
    active = RefCore(cfg, pools, True)
    shapes = Shapes(active)
    for r in reqs:
        active.add_request(*r)
    produced = {k: [] for k, _, _ in reqs}
    done = set()
    snap = {}
    for step in range(1, kill_step + 1):
        for o in active.step():
            produced[o.key] += o.new_token_ids
            if o.finished:
                done.add(o.key)
        if step % sync_every == 0:
            for v in active.request_views():
                if v.finished or v.aborted:
                    snap.pop(v.key, None)
                else:
                    snap[v.key] = v
    standby = RefCore(cfg, pools, False)
    sig_active = dict(shapes.sig)
    shapes = Shapes(standby)
    final = {}
    for key, ids, sp in reqs:
        delivered = produced[key][: max(0, len(produced[key]) - lag)]
        final[key] = list(delivered)
        if key in done and lag == 0:
            continue
        v = snap.get(key)
        if v is None:
            standby.adopt_request(key, sp, ids, len(ids), 0, [], None, delivered)
        else:
            standby.adopt_request(key, sp, v.token_ids, v.num_prompt, v.num_computed, v.block_ids, v.seed, delivered)
    while standby.has_work():
        for o in standby.step():
            assert o.output_index == len(final[o.key]), "a token was lost or repeated"
            final[o.key] += o.new_token_ids
    return final, sig_active, shapes, standby


def test_config():
    assert EngineConfig.from_preset("tiny").exact is False  # the CPU's batch_invariant already gives exactness
    with pytest.raises(ConfigError, match="max_num_seqs must be <= 512"):
        EngineConfig.from_preset("tiny", exact=True, max_num_seqs=513)


def test_schedule_shapes():
    """No step mixes prefill with decode; prefill chunks are one request each and end
    at the prompt's end or a multiple of C; every decode pass has exactly B rows."""
    reqs = requests()
    _, shapes, core = run_no_fault(reqs, make_cfg(), stagger=3)
    assert shapes.mixed_steps == 0
    assert shapes.decode_rows and set(shapes.decode_rows) == {B}
    prompt_len = {k: len(ids) for k, ids, _ in reqs}
    for key, start, n in shapes.prefill_chunks:
        assert start % C == 0 and (start + n == prompt_len[key] or (start + n) % C == 0), (key, start, n)
    assert core.counters["replay_mismatches"] == 0


def test_shapes_independent_of_arrivals():
    """The structural property: each token's pass shape depends on its own request only."""
    reqs = requests()
    out0, s0, _ = run_no_fault(reqs, make_cfg(), stagger=0)
    out1, s1, _ = run_no_fault(reqs, make_cfg(), stagger=5)
    assert s0.sig == s1.sig
    assert out0 == out1


def test_shapes_depend_on_arrivals_without_exact_mode():
    """Negative control: the same check fails for the ordinary scheduler."""
    reqs = requests()
    _, s0, _ = run_no_fault(reqs, make_cfg(exact=False), stagger=0)
    _, s1, _ = run_no_fault(reqs, make_cfg(exact=False), stagger=5)
    assert s0.sig != s1.sig


_REF: dict = {}


def reference(reqs, cfg):
    key = repr((reqs, cfg))
    if key not in _REF:
        _REF[key] = run_no_fault(reqs, cfg)[:2]
    return _REF[key]


@pytest.mark.parametrize("kill_step", [1, 2, 3, 5, 9, 14, 23, 31])
@pytest.mark.parametrize("sync_every,lag", [(1, 0), (4, 0), (4, 3), (16, 2)])
def test_takeover_exact(kill_step, sync_every, lag):
    reqs = requests()
    cfg = make_cfg()
    ref, ref_shapes = reference(reqs, cfg)
    final, sig_active, shapes, standby = run_failover(reqs, cfg, kill_step, sync_every, lag)
    assert final == ref
    # Every position the standby computed was computed with the no-fault run's shape.
    for kp, sig in shapes.sig.items():
        assert ref_shapes.sig[kp] == sig, kp
    for kp, sig in sig_active.items():
        assert ref_shapes.sig[kp] == sig, kp
    c = standby.counters
    assert c["replay_mismatches"] == 0
    assert shapes.mixed_steps == 0


def test_takeover_replays_unsynced_tokens_by_decode():
    """Tokens the active produced after the last sync are recomputed one decode step
    at a time (checked against what the client has), not folded into a prefill."""
    reqs = requests(n=2, max_tokens=30)
    cfg = make_cfg()
    ref, _ = reference(reqs, cfg)
    final, _, shapes, standby = run_failover(reqs, cfg, kill_step=14, sync_every=8, lag=0)
    assert final == ref
    c = standby.counters
    assert c["replayed_tokens"] > 0 and c["replay_mismatches"] == 0
    assert all(start < len(ids) for key, start, n in shapes.prefill_chunks for k, ids, _ in reqs if k == key)


def test_replay_detects_a_divergence():
    """The replay check can fail: a delivered token the model would not produce is
    counted as a mismatch (and kept, since the client has it)."""
    reqs = requests(n=1, max_tokens=12)
    cfg = make_cfg()
    ref, _ = reference(reqs, cfg)
    key, ids, sp = reqs[0]
    bad = list(ref[key][:5])
    bad[3] = (bad[3] + 1) % 256
    core = RefCore(cfg, RefCore.allocate_pools(cfg), True)
    core.adopt_request(key, sp, ids, len(ids), 0, [], None, bad)
    out = list(bad)
    while core.has_work():
        for o in core.step():
            out += o.new_token_ids
    assert core.counters["replay_mismatches"] >= 1
    assert out[:5] == bad


def test_no_kv_reuse_recomputes_everything_and_stays_exact():
    reqs = requests()
    cfg = make_cfg(kv_reuse=False)
    ref, _ = reference(reqs, make_cfg())
    final, _, _, standby = run_failover(reqs, cfg, kill_step=20, sync_every=4, lag=0)
    assert final == ref
    assert standby.counters["adopted_tokens_reused"] == 0


def test_preemption_is_exact():
    """A request preempted for lack of blocks is recomputed the same way (prompt in
    aligned chunks, its output by decode replay), so it still matches."""
    reqs = requests(n=4, max_tokens=40)
    big = make_cfg()
    ref, _ = run_no_fault(reqs, big)[:2]
    tight = make_cfg(num_blocks=16)
    out, _, core = run_no_fault(reqs, tight)
    assert core.counters["preemptions"] > 0
    assert out == ref
    assert core.counters["replay_mismatches"] == 0


def test_cli_flags_reach_the_engine():
    from frmps_engine.cli import build_parser
    from frmps_engine.sdk.adapters import EngineOptions, RefAdapter

    base = ["serve", "--role", "active", "--model", "tiny", "--control-socket", "c", "--generation-socket", "g"]
    a = build_parser().parse_args(base + ["--exact", "--no-kv-reuse"])
    assert a.exact is True and a.kv_reuse is False
    a = build_parser().parse_args(base)
    assert a.exact is None and a.kv_reuse is True
    cfg = RefAdapter(EngineOptions(model="tiny", exact=True, kv_reuse=False)).cfg
    assert cfg.exact and not cfg.kv_reuse
    assert RefAdapter(EngineOptions(model="tiny", exact=False)).cfg.exact is False
    # A GPU config defaults to exact mode (not built here: only the config is checked).
    assert EngineConfig.from_preset("tiny", device="cuda").exact is True
