package supervisor

import (
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/frmps/frmps/supervisor/failover"
)

// An active that fails to start every time, each attempt taking longer than
// the breaker's window (vLLM's imports, then a configuration error with exit
// code 1): the breaker opens after MaxRestarts+1 launches in a row that were
// never ready, and the supervisor gives up with the engine's reason.
func TestNeverReadyGivesUpAfterLaunchesNotTime(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		w := newWorld()
		w.behave = func(failover.Role, int) behavior {
			return behavior{exitOnStart: true, startExit: 1, startDelay: 2 * time.Minute, stderr: []string{
				"2026-11-29 01:00:00,000 INFO frmps_engine: importing vllm",
				"ValueError: --num-blocks is required with --engine vllm",
			}}
		}
		// MaxRestarts 3 within a minute; the handshake waits as long as an engine's start takes.
		h := start(t, w, func(c *Config) { c.HandshakeTimeout = time.Hour })
		max := h.s.cfg.Breaker.MaxRestarts
		for i := 0; i < 20 && h.s.GiveUpErr() == nil; i++ {
			time.Sleep(time.Minute)
			synctest.Wait()
		}
		err := h.s.GiveUpErr()
		if err == nil {
			t.Fatalf("never gave up; state %v", h.s.Status().GetState())
		}
		if n := w.launches(failover.Active); n != max+1 {
			t.Fatalf("%d launches, want %d", n, max+1)
		}
		if msg := err.Error(); !strings.Contains(msg, "never became ready in 4 launches") ||
			!strings.Contains(msg, "ValueError: --num-blocks is required with --engine vllm") || strings.Contains(msg, "\n") {
			t.Fatalf("reason %q", msg)
		}
		h.wantState(failover.CrashLoop)
		time.Sleep(10 * time.Minute)
		synctest.Wait()
		if n := w.launches(failover.Active); n != max+1 {
			t.Fatalf("launched again after giving up: %d launches", n)
		}
		h.stop()
	})
}

// An active that refuses its options (the engines' refusal exit code) before
// anything served: no restart, the supervisor gives up after one launch.
func TestRefusedStartGivesUpAtOnce(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		w := newWorld()
		w.behave = func(failover.Role, int) behavior {
			return behavior{exitOnStart: true, startExit: engineExitRefused, startDelay: 20 * time.Second, stderr: []string{
				"usage: frmps-engine serve [-h] ...",
				"frmps-engine serve: error: unrecognized arguments: --bogus",
			}}
		}
		h := start(t, w, func(c *Config) { c.HandshakeTimeout = time.Hour })
		select {
		case <-h.s.GaveUp():
		case <-time.After(time.Hour):
			t.Fatalf("never gave up; state %v", h.s.Status().GetState())
		}
		if n := w.launches(failover.Active); n != 1 {
			t.Fatalf("%d launches, want 1", n)
		}
		if msg := h.s.GiveUpErr().Error(); !strings.Contains(msg, "refused its options") || !strings.Contains(msg, "unrecognized arguments: --bogus") {
			t.Fatalf("reason %q", msg)
		}
		h.stop()
	})
}

// Once an engine has served, a crash loop keeps the supervisor up (status and
// metrics say so): it does not give up.
func TestCrashLoopAfterServingDoesNotGiveUp(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		w := newWorld()
		w.behave = func(r failover.Role, n int) behavior {
			if n == 0 {
				return behavior{}
			}
			return behavior{exitOnStart: true, startExit: engineExitRefused}
		}
		h := start(t, w, nil)
		h.wantState(failover.ServingReady)
		w.liveRole(failover.Standby).Kill()
		w.liveRole(failover.Active).Kill()
		for range 30 {
			time.Sleep(time.Second)
			synctest.Wait()
		}
		h.wantState(failover.CrashLoop)
		select {
		case <-h.s.GaveUp():
			t.Fatalf("gave up after serving: %v", h.s.GiveUpErr())
		default:
		}
		h.stop()
	})
}

func (w *fakeWorld) launches(r failover.Role) int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.launched[r]
}
