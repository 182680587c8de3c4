"""KV digests (FRMPS_DEBUG_KV_DIGESTS, sdk/kv_digest.py) and their check (bench/kv_digests.py):
two blocks with the same token prefix must hold the same KV. The check is shown to find a
changed token's KV in a full block and in a partly covered last block, and to pass equal
ones; the digests of a torch KV tensor depend on a block's contents, not on where it is."""

from __future__ import annotations

import json
import os

import pytest

from bench import kv_digests
from e2e import require
from frmps_engine.sdk import kv_digest

BS = 16


def _digests(tokens, salt=0):
    """A stand-in for an engine's per-token KV digests: a function of the prefix."""
    out, acc = [], 7 + salt
    for t in tokens:
        acc = (acc * 1_000_003 + t + 1) & kv_digest.MASK64
        out.append(acc)
    return out


def _rec(key, tokens, n, event="adopt", pid=1, t=0.0, change_at=None):
    d = _digests(tokens[:n])
    if change_at is not None:
        d[change_at] ^= 1
    return kv_digest.record(key, tokens, n, list(range(100 + key, 100 + key + 8)), d, BS, event=event, pid=pid, t=t)


TOKENS = [(i * 37) % 101 for i in range(100)]


def test_equal_prefixes_pass_and_are_compared():
    recs = [_rec(1, TOKENS, 40, "handover-out", 1, 1.0), _rec(2, TOKENS, 37, "adopt", 2, 2.0),
            _rec(3, TOKENS[:50] + [5] * 50, 64, "adopt", 3, 3.0)]
    rep = kv_digests.check(recs)
    assert rep.ok, rep.violations
    # blocks 0 and 1 by all three, the last block of 1 and 2 token by token (37 of 40), 3's block 2 differs in tokens
    assert rep.compared >= 2 + 5, rep.line()
    assert rep.events == {"handover-out": 1, "adopt": 2}


def test_a_changed_full_block_is_found():
    recs = [_rec(1, TOKENS, 40, pid=1, t=1.0), _rec(2, TOKENS, 40, pid=2, t=2.0), _rec(3, TOKENS, 40, pid=3, t=3.0,
                                                                                         change_at=5)]
    rep = kv_digests.check(recs)
    assert not rep.ok
    (v,) = rep.violations
    assert [(d["pid"], d["key"], d["block"]) for d in v["differing"]] == [(3, 3, 0)]


def test_a_changed_token_of_a_partly_covered_last_block_is_found():
    """The handover's record covers 41 tokens, the adoption's 38: its token 37 (block 2,
    slot 5) differs; only the token-by-token comparison of the last block can see it."""
    recs = [_rec(1, TOKENS, 41, "handover-out", 1, 1.0), _rec(1, TOKENS, 38, "adopt", 2, 2.0, change_at=37)]
    rep = kv_digests.check(recs)
    assert not rep.ok, rep.line()
    assert {(d["event"], d["block"]) for v in rep.violations for d in v["differing"]} == {("adopt", 2)}
    # the negative control's twin: nothing changed, nothing found
    assert kv_digests.check([_rec(1, TOKENS, 41, "handover-out", 1, 1.0), _rec(1, TOKENS, 38, "adopt", 2, 2.0)]).ok


def test_load_skips_a_torn_line_and_main_exits_by_verdict(tmp_path, capsys):
    good = [_rec(1, TOKENS, 40, t=1.0), _rec(2, TOKENS, 40, t=2.0)]
    (tmp_path / "kv-1.jsonl").write_text("\n".join(json.dumps(r) for r in good) + "\n{\"chain\": [\"ab")
    (tmp_path / "other.jsonl").write_text("not read\n")
    recs, torn = kv_digests.load([str(tmp_path)])
    assert len(recs) == 2 and torn == 1
    assert kv_digests.main([str(tmp_path), "--json", str(tmp_path / "r.json")]) == 0
    assert json.loads((tmp_path / "r.json").read_text())["ok"] is True
    (tmp_path / "kv-2.jsonl").write_text(json.dumps(_rec(3, TOKENS, 40, t=3.0, change_at=20)) + "\n")
    assert kv_digests.main([str(tmp_path)]) == 1
    assert "with differing KV" in capsys.readouterr().out
    empty = tmp_path / "empty"
    empty.mkdir()
    assert kv_digests.main([str(empty)]) == 2


def test_record_refuses_a_wrong_count_and_from_env():
    with pytest.raises(ValueError, match="3 token digests for 4 tokens"):
        kv_digest.record(1, TOKENS, 4, [1], [1, 2, 3], BS)
    assert kv_digest.from_env(BS, {}) is None


@pytest.mark.torch
def test_torch_digests_follow_the_contents_not_the_block_ids():
    torch = require("torch")  # the torch-free suite runs the rest
    g = torch.Generator().manual_seed(1)
    kv = torch.randn(3, 2, 12, BS, 2, 4, generator=g).to(torch.bfloat16)  # the reference engine's layout
    kv[:, :, 7] = kv[:, :, 2]
    kv[:, :, 9] = kv[:, :, 4]
    a = kv_digest.torch_token_digests([(kv, 2, 3)], [2, 4], 20, BS)
    b = kv_digest.torch_token_digests([(kv, 2, 3)], [7, 9], 20, BS, chunk=1)
    assert len(a) == 20 and a == b and len(set(a)) == 20
    kv[1, 1, 9, 2, 0, 3] += 1  # layer 1, V, block 9 slot 2: token 18 of the request on [7, 9]
    c = kv_digest.torch_token_digests([(kv, 2, 3)], [7, 9], 20, BS)
    assert [i for i in range(20) if c[i] != a[i]] == [18]
    # one tensor per layer, blocks first (vLLM's layout on the Triton backend)
    layers = [kv[i].movedim(1, 0).contiguous() for i in range(3)]  # [NB, 2, BS, H, D]
    d = kv_digest.torch_token_digests([(t, 0, 2) for t in layers], [2, 4], 20, BS)
    assert len(d) == 20 and len(set(d)) == 20
    with pytest.raises(ValueError, match="20 tokens need 2 blocks"):
        kv_digest.torch_token_digests([(kv, 2, 3)], [2], 20, BS)


def test_a_failing_digest_costs_nothing_but_a_device_error_is_raised(tmp_path, caplog):
    """Recorder.write is a diagnostic on the handover's and the takeover's path: a core
    whose digest fails writes nothing and says so; a device error (the engine is lost)
    still goes up."""

    class FailingCore:  # TEST DOUBLE: a core whose KV digest raises what it is given
        def __init__(self, err):
            self.err = err

        def kv_token_digests(self, block_ids, n):
            raise self.err

    rec = kv_digest.from_env(BS, {kv_digest.ENV: str(tmp_path)})
    entries = [(1, TOKENS, 20, [3, 4])]
    assert rec.write(FailingCore(ValueError("no KV caches")), "adopt", entries) == 0
    assert not (tmp_path / f"kv-{os.getpid()}.jsonl").exists()
    assert "the adopt KV digests failed: no KV caches" in caplog.text
    with pytest.raises(RuntimeError, match="CUDA error"):
        rec.write(FailingCore(RuntimeError("CUDA error: an illegal memory access was encountered")), "adopt", entries)

    class Core:  # TEST DOUBLE: the digests of _digests above
        def kv_token_digests(self, block_ids, n):
            return _digests(TOKENS[:n])

    assert rec.write(Core(), "adopt", entries) == 1
    assert kv_digests.load([str(tmp_path)])[0][0]["n"] == 20


class _View:  # TEST DOUBLE: engine_api.RequestView's fields
    def __init__(self, key, tokens, num_prompt, num_computed, block_ids, finished=False):
        self.key, self.token_ids, self.num_prompt, self.num_computed = key, tokens, num_prompt, num_computed
        self.block_ids, self.finished, self.seed, self.aborted = block_ids, finished, 0, False


class _PoolCore:  # TEST DOUBLE: a KV pool of per-slot digests, written by prefill, read by the digests
    def __init__(self):
        self.pool: dict[tuple[int, int], int] = {}
        self.views: list[_View] = []

    def prefill(self, tokens, block_ids, start=0):
        d = _digests(tokens)
        for i in range(start, len(tokens)):
            self.pool[(block_ids[i // BS], i % BS)] = d[i]

    def kv_token_digests(self, block_ids, n):
        return [self.pool[(block_ids[i // BS], i % BS)] for i in range(n)]

    def request_views(self):
        return list(self.views)


def test_prompt_records_find_a_stale_prefix_cache_block_where_it_is_read(tmp_path):
    """The ``prompt`` event: each request once, after the step that commits its prompt.
    Two requests of one 40-token prompt, the second reading the first's two full blocks
    from the prefix cache: the same KV, nothing found. The negative control: the second
    block overwritten (with another prefix's KV) before a third request reads it from the
    cache: found at that request's ``prompt`` line, block 1."""
    core, rec = _PoolCore(), kv_digest.from_env(BS, {kv_digest.ENV: str(tmp_path)})
    hook = rec.prompts(core)
    core.prefill(TOKENS[:40], [5, 6, 7])
    core.views = [_View(1, TOKENS[:40], 40, 20, [5, 6, 7])]  # mid-prefill: not yet
    hook()
    core.views = [_View(1, TOKENS[:40], 40, 40, [5, 6, 7])]
    hook()
    hook()  # once per request
    core.prefill(TOKENS[:40], [5, 6, 8], start=32)  # blocks 5, 6 from the cache
    core.views = [_View(1, TOKENS[:41], 40, 41, [5, 6, 7]), _View(2, TOKENS[:40], 40, 40, [5, 6, 8])]
    hook()
    rep = kv_digests.check(kv_digests.load([str(tmp_path)])[0])
    assert rep.ok and rep.events == {"prompt": 2} and rep.compared >= 2, rep.line()

    core.prefill([9] * 32, [4, 6])  # block 6 reused for another prefix, its hash left behind
    core.prefill(TOKENS[:40], [5, 6, 9], start=32)
    core.views = [_View(3, TOKENS[:40], 40, 40, [5, 6, 9])]
    hook()
    rep = kv_digests.check(kv_digests.load([str(tmp_path)])[0])
    assert not rep.ok, rep.line()
    assert {(d["event"], d["key"], d["block"], d["block_id"]) for v in rep.violations for d in v["differing"]} == {
        ("prompt", 3, 1, 6)}


def test_a_differing_block_is_printed_once():
    """A changed token in a last block differs under the block's key and under each of its
    token-by-token keys: main prints the block once."""
    recs = [_rec(1, TOKENS, 40, pid=1, t=1.0), _rec(2, TOKENS, 40, pid=2, t=2.0, change_at=33)]
    rep = kv_digests.check(recs)
    assert len(rep.violations) > 1, rep.line()
    lines = kv_digests.differing_lines(rep)
    assert len(lines) == 1 and "pid 2 request 2 block 2" in lines[0], lines
