package supervisor

import (
	"testing"
	"time"
)

func TestHangPolicyDerivedTimes(t *testing.T) {
	cfg := Config{Model: "m", Engine: "ref"}
	cfg.setDefaults()
	p := cfg.hangPolicy()
	if p.heartbeat != time.Second || p.stepFactor != 8 || p.stepMin != time.Second || p.stepDefault != time.Minute {
		t.Fatalf("defaults %+v", p)
	}
	if got := p.beatInterval(); got != 125*time.Millisecond {
		t.Fatalf("beat interval %s", got)
	}
	if got := p.tick(); got != 50*time.Millisecond {
		t.Fatalf("tick %s", got)
	}
	for _, tc := range []struct{ expected, want time.Duration }{
		{0, time.Minute},                          // no estimate: the default
		{20 * time.Millisecond, time.Second},      // 8 × 20ms is under the minimum
		{500 * time.Millisecond, 4 * time.Second}, // 8 × the estimate
	} {
		if got := p.stepBound(tc.expected); got != tc.want {
			t.Errorf("bound for an estimate of %s: %s, want %s", tc.expected, got, tc.want)
		}
	}
	off := hangPolicy{heartbeat: -1, stepFactor: 8, stepMin: time.Second, stepDefault: time.Minute}
	if off.enabled() || off.beatInterval() != time.Second {
		t.Fatalf("disabled policy: enabled %v, interval %s", off.enabled(), off.beatInterval())
	}
	now := time.Unix(100, 0)
	if c, _ := off.verdict(beats{last: now.Add(-time.Hour), interval: time.Second}, now); c != "" {
		t.Fatalf("disabled policy judged an engine %s", c)
	}
	// Fast timeouts: intervals and ticks keep a floor.
	fast := hangPolicy{heartbeat: 40 * time.Millisecond, stepFactor: 8, stepMin: 40 * time.Millisecond, stepDefault: time.Second}
	if fast.beatInterval() != 10*time.Millisecond || fast.tick() != 10*time.Millisecond {
		t.Fatalf("fast policy: interval %s tick %s", fast.beatInterval(), fast.tick())
	}
}
