"""StepTimer: the engine's estimate of its step in progress (hang detection's progress rule)."""

import pytest

from frmps_engine.sdk.steptime import StepTimer

MS = 1_000_000


class Clock:
    def __init__(self):
        self.now = 1_000 * MS

    def __call__(self):
        return self.now


def step(timer: StepTimer, clock: Clock, took_ns: int, tokens: int | None) -> None:
    timer.begin()
    clock.now += took_ns
    timer.end(tokens)


def test_no_estimate_until_measured_then_the_slowest_recent_step_scaled_up():
    clock = Clock()
    t = StepTimer(min_samples=4, clock=clock)
    assert t.progress(8) == (0, 0)
    for _ in range(3):
        step(t, clock, 10 * MS, 8)
    t.begin()
    clock.now += 3 * MS
    assert t.progress(8) == (3 * MS, 0), "no estimate from fewer than 4 steps"
    clock.now += 7 * MS
    t.end(8)
    assert t.expected_ns(8) == 10 * MS
    assert t.expected_ns(400) == 400 * 10 * MS // 8, "no large step yet: the decodes' per-token cost, overstated"
    step(t, clock, 40 * MS, 100)  # a prefill: 0.4 ms per token
    assert t.expected_ns(8) == 40 * MS, "a small step is expected to take as long as the slowest recent one"
    assert t.expected_ns(400) == 400 * 40 * MS // 100, "a large step: the per-token cost of large steps"
    assert t.expected_ns(None) == 0, "a core that does not say its tokens gets no estimate"
    # Far larger than the large steps measured (and than a small step): no estimate.
    assert t.expected_ns(512) > 0 and t.expected_ns(513) == 0
    # Between steps nothing is reported; an idle device check is timed but not learned from.
    t.begin()
    clock.now += 2 * MS
    assert t.progress(8) == (2 * MS, 40 * MS)
    t.end(None)
    assert t.progress(8) == (0, 0) and t.measured == 5


def test_old_steps_leave_the_window_but_large_steps_keep_their_cost():
    clock = Clock()
    t = StepTimer(window=8, min_samples=1, clock=clock)
    step(t, clock, 500 * MS, 64)
    for _ in range(7):
        step(t, clock, 5 * MS, 4)
    assert t.expected_ns(4) == 500 * MS
    step(t, clock, 5 * MS, 4)
    assert t.expected_ns(4) == 5 * MS
    assert t.expected_ns(128) == 128 * 500 * MS // 64, "the cost per token of the last large steps, however old"


def test_slow_decodes_do_not_inflate_a_prefill_chunks_estimate():
    """Decodes of one token that a loaded machine slowed to 9 ms would put a 512-token
    chunk at 4.6 s if their per-token cost were scaled up; the chunks measured before
    give the cost of a chunk."""
    clock = Clock()
    t = StepTimer(clock=clock)
    for _ in range(4):
        step(t, clock, 60 * MS, 512)
    for _ in range(100):
        step(t, clock, 9 * MS, 1)
    assert t.expected_ns(512) == 60 * MS


# The supervisor's default rule (supervisor/hang.go): a step is hung once older than
# max(1 s, 8 × expected), or than 60 s when the engine gives no estimate.
def bound_ns(expected: int) -> int:
    return 60_000 * MS if expected == 0 else max(1_000 * MS, 8 * expected)


@pytest.mark.parametrize("device,fixed_ms,token_ms,attn_ms", [
    # per step: fixed cost, per token, per token per 1k tokens of context (attention)
    ("gpu-0.5b", 4.0, 0.02, 0.004),
    ("gpu-14b", 25.0, 0.15, 0.02),
    ("cpu-tiny", 2.0, 0.01, 0.05),  # attention dominates long contexts
], ids=lambda x: x if isinstance(x, str) else "")
def test_no_false_hang_in_a_chunked_32k_prefill_between_decodes(device, fixed_ms, token_ms, attn_ms):
    """A 32k-token prompt, prefilled in 2048-token chunks whose cost grows with the
    context (attention), arrives while 8 requests decode at short contexts. No step
    may exceed the bound the supervisor derives from the estimate."""
    clock = Clock()
    t = StepTimer(clock=clock)

    def cost(tokens: int, context: int) -> int:
        return int((fixed_ms + tokens * (token_ms + attn_ms * context / 1024)) * MS)

    def run(tokens: int, context: int) -> None:
        took = cost(tokens, context)
        t.begin()
        _, expected = t.progress(tokens)
        assert took <= bound_ns(expected), f"{tokens} tokens at context {context}: {took / MS:.0f} ms > bound"
        clock.now += took
        t.end(tokens)

    for i in range(200):
        run(8, 1000 + i)
    for chunk in range(16):
        run(2048, chunk * 2048 + 1024)
        run(8, 1200)  # the decodes go on between chunks
    # And an adopted request re-prefilled in one pass after a takeover (no chunking).
    run(32768, 16384)
