package supervisor

import (
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
	"github.com/frmps/frmps/supervisor/failover"
	"github.com/frmps/frmps/supervisor/leftover"
)

// placement returns the fake processes Status names active and standby, and
// checks the invariant failback restores: the active in MPS, the standby out.
func (h *harness) wantPlacementRestored() (active, standby *fakeProc) {
	h.t.Helper()
	active, standby = h.roles()
	if !active.inMPS() || standby.inMPS() {
		h.t.Fatalf("placement: active pid %d in MPS %v, standby pid %d in MPS %v", active.pid, active.inMPS(), standby.pid, standby.inMPS())
	}
	for _, e := range h.s.Status().GetEngines() {
		if e.GetInMps() != (e.GetRole() == "active") {
			h.t.Fatalf("status engines %v", h.s.Status().GetEngines())
		}
	}
	if fb := h.s.Status().GetFailback(); !fb.GetPlacementOk() || fb.GetState() != "idle" {
		h.t.Fatalf("failback status %v", fb)
	}
	if v := testutil.ToFloat64(h.s.metrics.placementG); v != 1 {
		h.t.Fatalf("placement_ok = %v", v)
	}
	return active, standby
}

// Fault after fault: each failover is followed by a failback that puts the
// active back in MPS, with the engine that was promoted as the standby.
func TestFailbackRestoresPlacementFaultAfterFault(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		w := newWorld()
		w.front.open = []*frmpsv1.ResumeRequest{{Key: 7, Prompt: "a", DeliveredTokenIds: []uint32{1, 2}}}
		h := start(t, w, nil)
		act, sb := h.wantPlacementRestored()
		for round := 1; round <= 3; round++ {
			launched := len(w.procs)
			act.Kill() // an MPS fault kills the active
			synctest.Wait()
			h.wantState(failover.ServingReady)
			newAct, newSb := h.wantPlacementRestored()
			if newSb != sb {
				t.Fatalf("round %d: the standby is pid %d, want the promoted engine pid %d back as the standby", round, newSb.pid, sb.pid)
			}
			if len(w.procs) != launched+1 || newAct == act || newAct == sb {
				t.Fatalf("round %d: want exactly one new engine (in MPS) per fault, %d launched", round, len(w.procs)-launched)
			}
			if sb.handoffs != round {
				t.Fatalf("round %d: the promoted engine yielded %d times", round, sb.handoffs)
			}
			// The new active got the open requests in its Resume, like a failover's standby.
			if n := len(newAct.resumes); n != 1 || len(newAct.resumes[0].GetRequests()) != 1 || newAct.resumes[0].GetRingPath() != w.ring.path {
				t.Fatalf("round %d: new active resumes %v", round, newAct.resumes)
			}
			// Generations: the failover published one, the swap another.
			gen, g := h.current(uint64(1 + 2*round))
			if g != uint64(1+2*round) || gen.endpoint != "unix://"+newAct.inv.GenerationSocket {
				t.Fatalf("round %d: current %s gen %d", round, gen.endpoint, g)
			}
			fb := h.s.Status().GetFailback()
			if fb.GetSucceeded() != uint64(round) || fb.GetFailed() != 0 || fb.GetLastDurationSeconds() < 0 {
				t.Fatalf("round %d: failback %v", round, fb)
			}
			act = newAct
		}
		if v := testutil.ToFloat64(h.s.metrics.failbacks.WithLabelValues("ok")); v != 3 {
			t.Fatalf("failbacks_total{ok} = %v", v)
		}
		// One restore per fault, each from the active's death to its failback (no time passes
		// on this test's clock while fake engines start).
		if r := h.histogram("frmps_placement_restore_seconds"); r.GetSampleCount() != 3 {
			t.Fatalf("frmps_placement_restore_seconds: %v", r)
		}
		if n := len(h.s.Status().GetFailovers()); n != 3 {
			t.Fatalf("%d failover records, want 3 (handovers are not failovers)", n)
		}
		h.stop()
	})
}

// The standby in MPS dies while it is being resumed (another MPS fault): the
// yielded engine takes its requests back, a new standby starts, and the next
// handover, after the policy's backoff, succeeds.
func TestFailbackStandbyDiesDuringResumeRestoresTheYieldedEngine(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		w := newWorld()
		w.front.open = []*frmpsv1.ResumeRequest{{Key: 3, Prompt: "x"}}
		w.behave = func(r failover.Role, nth int) behavior {
			if r == failover.Standby && nth == 1 { // the first standby started in MPS
				return behavior{dieOnResume: true}
			}
			return behavior{}
		}
		h := start(t, w, func(c *Config) { c.FailbackBaseBackoff = 2 * time.Second })
		act, sb := h.roles()
		act.Kill()
		synctest.Wait()
		time.Sleep(time.Second) // the breaker's backoff before the next standby (100ms)
		synctest.Wait()
		// Restored: the yielded engine serves again (outside MPS), a new standby sits in MPS,
		// and the next handover waits for the failback backoff.
		h.wantState(failover.ServingReady)
		fb := h.s.Status().GetFailback()
		if fb.GetFailed() != 1 || fb.GetSucceeded() != 0 || fb.GetConsecutiveFailures() != 1 || fb.GetState() != "scheduled" ||
			!strings.Contains(fb.GetLastError(), "resuming the yielded engine") {
			t.Fatalf("after the failed handover: %v", fb)
		}
		a, _ := h.roles()
		if a != sb || len(sb.resumes) != 2 {
			t.Fatalf("active pid %d (want the yielded pid %d), its resumes %d (failover + restore)", a.pid, sb.pid, len(sb.resumes))
		}
		time.Sleep(3 * time.Second)
		synctest.Wait()
		h.wantState(failover.ServingReady)
		h.wantPlacementRestored()
		if fb := h.s.Status().GetFailback(); fb.GetSucceeded() != 1 || fb.GetConsecutiveFailures() != 0 {
			t.Fatalf("after the retry: %v", fb)
		}
		if v := testutil.ToFloat64(h.s.metrics.failbacks.WithLabelValues("failed")); v != 1 {
			t.Fatalf("failbacks_total{failed} = %v", v)
		}
		// One restore, from the death to the retry that succeeded: the failed handover, the new
		// standby's start (the breaker's 100 ms) and the failback backoff (2 s) inside it.
		if r := h.histogram("frmps_placement_restore_seconds"); r.GetSampleCount() != 1 || r.GetSampleSum() < 2 || r.GetSampleSum() > 2.2 {
			t.Fatalf("frmps_placement_restore_seconds: %v", r)
		}
		h.stop()
	})
}

// A refused Handoff leaves the active serving; the handover is retried after
// the backoff.
func TestFailbackRefusedHandoffIsRetriedWithBackoff(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		w := newWorld()
		refusals := 2
		w.behave = func(r failover.Role, nth int) behavior {
			if r == failover.Standby && nth == 0 { // becomes the active at the failover
				return behavior{handoff: func() *frmpsv1.Reply {
					if refusals > 0 {
						refusals--
						return &frmpsv1.Reply{Ok: false, Error: "busy"}
					}
					return &frmpsv1.Reply{Ok: true}
				}}
			}
			return behavior{}
		}
		h := start(t, w, func(c *Config) { c.FailbackBaseBackoff = time.Second; c.FailbackMaxBackoff = 10 * time.Second })
		act, sb := h.roles()
		act.Kill()
		synctest.Wait()
		fb := h.s.Status().GetFailback()
		if fb.GetConsecutiveFailures() != 1 || !strings.Contains(fb.GetLastError(), "busy") {
			t.Fatalf("after the first refusal %v", fb)
		}
		a, _ := h.roles()
		if a != sb {
			t.Fatal("a refused handover must leave the active serving")
		}
		start := time.Now()
		time.Sleep(30 * time.Second)
		synctest.Wait()
		h.wantPlacementRestored()
		if sb.handoffs != 3 {
			t.Fatalf("%d handoffs, want 3 (two refused)", sb.handoffs)
		}
		if fb := h.s.Status().GetFailback(); fb.GetSucceeded() != 1 || fb.GetFailed() != 2 || time.Unix(0, fb.GetLastUnixNanos()).Sub(start) < 3*time.Second {
			t.Fatalf("want backoffs of 1s then 2s before the third try: %v", fb)
		}
		h.stop()
	})
}

// The active dies while it yields: an ordinary failover to the standby, which
// is in MPS, so the placement is right at once.
func TestFailbackActiveDiesWhileYielding(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		w := newWorld()
		w.behave = func(r failover.Role, nth int) behavior {
			if r == failover.Standby && nth == 0 {
				return behavior{dieOnHandoff: true}
			}
			return behavior{}
		}
		h := start(t, w, nil)
		act, _ := h.roles()
		act.Kill()
		synctest.Wait()
		h.wantState(failover.ServingReady)
		h.wantPlacementRestored()
		if n := len(h.s.Status().GetFailovers()); n != 2 {
			t.Fatalf("%d failovers, want 2 (the MPS fault, then the death while yielding)", n)
		}
		if fb := h.s.Status().GetFailback(); fb.GetFailed() != 1 || fb.GetSucceeded() != 0 {
			t.Fatalf("failback %v", fb)
		}
		h.stop()
	})
}

// An active that never answers Handoff is fenced after HandoffTimeout and the
// standby takes over.
func TestFailbackHandoffTimeoutFencesTheActive(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		w := newWorld()
		block := make(chan struct{})
		w.behave = func(r failover.Role, nth int) behavior {
			if r == failover.Standby && nth == 0 {
				return behavior{handoff: func() *frmpsv1.Reply { <-block; return nil }}
			}
			return behavior{}
		}
		h := start(t, w, func(c *Config) { c.HandoffTimeout = 5 * time.Second })
		act, sb := h.roles()
		act.Kill()
		synctest.Wait()
		if st, _ := h.state(); st != failover.HandingOver.String() {
			t.Fatalf("state %s, want handing_over while the active does not answer", st)
		}
		time.Sleep(6 * time.Second)
		synctest.Wait()
		close(block)
		h.wantState(failover.ServingReady)
		h.wantPlacementRestored()
		if sb.alive() {
			t.Fatal("the wedged active was not fenced")
		}
		recs := h.s.Status().GetFailovers()
		if len(recs) != 2 || recs[0].GetCause() != "stalled" {
			t.Fatalf("records %v", recs)
		}
		h.stop()
	})
}

// With --no-failback the pair stays where the failover left it: both outside MPS.
func TestNoFailbackLeavesThePlacement(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		w := newWorld()
		h := start(t, w, func(c *Config) { c.NoFailback = true })
		act, _ := h.roles()
		act.Kill()
		synctest.Wait()
		h.wantState(failover.ServingReady)
		a, sb := h.roles()
		if a.inMPS() || sb.inMPS() || a.handoffs != 0 {
			t.Fatalf("active in MPS %v, standby in MPS %v, handoffs %d", a.inMPS(), sb.inMPS(), a.handoffs)
		}
		fb := h.s.Status().GetFailback()
		if fb.GetEnabled() || fb.GetState() != "disabled" || fb.GetPlacementOk() {
			t.Fatalf("failback %v", fb)
		}
		h.stop()
	})
}

// Without MPS there is nothing to restore.
func TestNoMPSHasNoFailback(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		w := newWorld()
		h := start(t, w, func(c *Config) { c.NoMPS = true })
		act, _ := h.roles()
		act.Kill()
		synctest.Wait()
		h.wantState(failover.ServingReady)
		a, sb := h.roles()
		if a.inMPS() || sb.inMPS() || a.handoffs != 0 || !h.s.Status().GetFailback().GetPlacementOk() {
			t.Fatalf("active %v standby %v handoffs %d failback %v", a.inMPS(), sb.inMPS(), a.handoffs, h.s.Status().GetFailback())
		}
		h.stop()
	})
}

// A supervisor that joined an operator's MPS daemon records no private
// daemon: whoever cleans up after it must not stop the operator's.
func TestLaunchRecordNeverClaimsAnOperatorsDaemon(t *testing.T) {
	for _, tc := range []struct {
		pipeDir string
		private bool
	}{{"", true}, {"/run/operator-mps", false}} {
		d, err := leftover.OpenDir(filepath.Join(t.TempDir(), "state"))
		if err != nil {
			t.Fatal(err)
		}
		s := &Supervisor{cfg: Config{MPSPipeDir: tc.pipeDir, MPSControlBinary: "mps-control"}, stateDir: d, deployID: "x"}
		if err := s.writeLaunchRecord(); err != nil {
			t.Fatal(err)
		}
		raw, err := os.ReadFile(filepath.Join(d.Path(), "x.json"))
		if err != nil {
			t.Fatal(err)
		}
		var r leftover.Record
		if err := json.Unmarshal(raw, &r); err != nil {
			t.Fatal(err)
		}
		if r.PrivateMPS != tc.private {
			t.Errorf("pipe dir %q: record says private MPS %v", tc.pipeDir, r.PrivateMPS)
		}
	}
}

// After an MPS fault the MPS server refuses or breaks new clients while it
// resets the device (seen on a 2-GPU machine: the first standbys launched into
// MPS for the failback died at start for ~5 s). Those deaths, within
// MPSRecoveryWindow of the active's death, are relaunched without counting
// against the breaker, and the placement is restored once one starts; an
// engine's own refusal (exit code 2) still counts.
func TestStandbyNotAdmittedByRecoveringMPSIsRelaunched(t *testing.T) {
	for _, tc := range []struct {
		name      string
		code      int
		wantState failover.State
	}{
		{"device error at start", 3, failover.ServingReady},
		{"engine refused", 2, failover.ServingDegraded},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				w := newWorld()
				fails := 8 // more than the default breaker's 5 restarts in a minute
				w.behave = func(r failover.Role, nth int) behavior {
					if r == failover.Standby && nth >= 1 && nth <= fails { // launched into MPS after the failover
						return behavior{exitOnStart: true, startExit: tc.code}
					}
					return behavior{}
				}
				h := start(t, w, nil)
				act, _ := h.roles()
				act.Kill()
				time.Sleep(30 * time.Second)
				synctest.Wait()
				h.wantState(tc.wantState)
				if tc.wantState == failover.ServingReady {
					h.wantPlacementRestored()
					if n := w.launched[failover.Standby]; n != fails+2 {
						t.Fatalf("%d standbys launched, want %d", n, fails+2)
					}
				}
				h.stop()
			})
		})
	}
}

// PrimeFaultPath: one deliberate fault per GPU inside frmps's own MPS daemon,
// before any engine is launched, with an MPS client's environment; a GPU that
// could not be primed is logged and the deployment serves as usual.
func TestPrimeFaultPathBeforeTheFirstEngine(t *testing.T) {
	for _, tc := range []struct {
		name    string
		tp      int
		err     error
		devices []int
		state   string
	}{
		{"one GPU", 1, nil, []int{0}, "running (fault path primed on 1 GPU(s))"},
		{"two ranks", 2, nil, []int{0, 1}, "running (fault path primed on 2 GPU(s))"},
		{"priming fails, tried twice", 1, errors.New("exit status 2"), []int{0, 0}, "running"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				w := newWorld()
				w.primeErr = tc.err
				h := start(t, w, func(c *Config) { c.PrimeFaultPath, c.TensorParallelSize = true, tc.tp })
				time.Sleep(5 * primeSettle) // each run and the first engine wait for the faulted MPS server to go
				synctest.Wait()
				h.wantState(failover.ServingReady)
				w.mu.Lock()
				primes := slices.Clone(w.primes)
				w.mu.Unlock()
				if len(primes) != len(tc.devices) {
					t.Fatalf("%d prime runs, want %d", len(primes), len(tc.devices))
				}
				for i, p := range primes {
					if p.device != tc.devices[i] || p.launched != 0 || !slices.Contains(p.env, "CUDA_MPS_PIPE_DIRECTORY=/fake/mps/pipe") {
						t.Fatalf("prime %d: device %d, after %d launches, env %v", i, p.device, p.launched, p.env)
					}
					if i > 0 && p.at.Sub(primes[i-1].at) < primeSettle {
						t.Fatalf("prime %d ran %s after the one before it, want >= %s", i, p.at.Sub(primes[i-1].at), primeSettle)
					}
				}
				if got := h.s.Status().GetMpsState(); got != tc.state {
					t.Fatalf("MPS state %q, want %q", got, tc.state)
				}
				want := float64(tc.tp)
				if tc.err != nil {
					want = 0
				}
				if got := testutil.ToFloat64(h.s.metrics.primedG); got != want {
					t.Fatalf("frmps_fault_path_primed_gpus %v, want %v", got, want)
				}
				h.stop()
			})
		})
	}
}

func TestPrimeFaultPathNeedsOwnDaemon(t *testing.T) {
	for _, mod := range []func(*Config){
		func(c *Config) { c.NoMPS = true },
		func(c *Config) { c.MPSPipeDir = "/run/operator-mps" },
	} {
		cfg := testConfig(t)
		cfg.PrimeFaultPath = true
		mod(&cfg)
		if _, err := NewWithDeps(cfg, newWorld().deps(), hclog.NewNullLogger(), prometheus.NewRegistry()); err == nil ||
			!strings.Contains(err.Error(), "frmps's own MPS daemon") {
			t.Fatalf("want a refusal, got %v", err)
		}
	}
}

// newFailback is a failback owner on its own: its timers' events go to the
// returned channel instead of a loop.
func newFailback(t *testing.T) (*failback, chan event) {
	t.Helper()
	m, err := newMetrics(nil, "m")
	if err != nil {
		t.Fatal(err)
	}
	events := make(chan event, 8)
	return &failback{enabled: true, delay: 5 * time.Second, base: time.Second, max: 5 * time.Second, timeout: time.Second,
		log: hclog.NewNullLogger(), metrics: m, post: func(ev event) { events <- ev }}, events
}

// The first handover waits FailbackDelay; after failed ones the base backoff
// doubles per consecutive failure up to the cap, and a success resets it.
// A timer dropped or replaced fires nothing that counts.
func TestFailbackScheduleBacksOffAndDropsStaleTimers(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		fb, events := newFailback(t)
		fb.schedule(false)
		if fb.timer != nil {
			t.Fatal("armed without an inverted placement")
		}
		fb.enabled = false
		fb.schedule(true)
		if fb.timer != nil {
			t.Fatal("armed while failback is off")
		}
		fb.enabled = true
		var waits []time.Duration
		sl := &slot{proc: deadProcess{}}
		for range 5 {
			t0 := time.Now()
			fb.schedule(true)
			fb.schedule(true) // armed once
			ev := <-events
			waits = append(waits, time.Since(t0))
			if !fb.fire(ev) || fb.fire(ev) {
				t.Fatal("the armed timer's event did not fire exactly once")
			}
			fb.handover = &handoverRun{started: time.Now()} // one that fails
			fb.end(failover.Transition{Cause: "refused"}, sl)
		}
		want := []time.Duration{5 * time.Second, time.Second, 2 * time.Second, 4 * time.Second, 5 * time.Second}
		if !slices.Equal(waits, want) {
			t.Fatalf("waits %v, want %v", waits, want)
		}
		fb.handover = &handoverRun{started: time.Now(), swapped: true}
		if _, ok := fb.end(failover.Transition{}, sl); !ok || fb.failures != 0 || fb.backoff() != 5*time.Second {
			t.Fatalf("after a success: ok %v, %d failures, next wait %s", ok, fb.failures, fb.backoff())
		}

		fb.schedule(true)
		dropped := fb.seq
		fb.schedule(false) // the placement held after all: dropped
		fb.schedule(true)
		// A dropped timer that fired before it was stopped: its event is stale.
		if fb.fire(event{kind: evHandoverDue, id: dropped}) {
			t.Fatal("a dropped timer's event fired")
		}
		if ev := <-events; !fb.fire(ev) {
			t.Fatal("the current timer's event did not fire")
		}
		synctest.Wait()
		if len(events) != 0 {
			t.Fatalf("%d more timer events, want none (the dropped timer was stopped)", len(events))
		}
	})
}

// end counts a handover's outcome, keeps the cause of a failed one (the
// reason it turned to restoring first), and measures the placement's
// restore from the active's death in MPS.
func TestFailbackEndRecordsTheOutcome(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		fb, _ := newFailback(t)
		sl := &slot{proc: deadProcess{}}
		fb.handover = &handoverRun{started: time.Now()}
		fb.noteStep(failover.Transition{To: failover.HandingOver, Cause: "standby refused resume"}, failover.Restoring)
		fb.noteStep(failover.Transition{To: failover.HandingOver, Cause: "later"}, failover.Restoring)
		time.Sleep(time.Second)
		if _, ok := fb.end(failover.Transition{Cause: "restored"}, sl); ok {
			t.Fatal("a handover never swapped ended ok")
		}
		fb.sync(failover.ServingReady, failover.NoHandover, false)
		v := fb.shown()
		if v.GetFailed() != 1 || v.GetLastError() != "standby refused resume" || v.GetLastDurationSeconds() != 1 || v.GetState() != "waiting" {
			t.Fatalf("after a failed handover: %v", v)
		}
		fb.lost(time.Now())
		time.Sleep(time.Minute)
		fb.lost(time.Now()) // the first loss counts
		fb.handover = &handoverRun{started: time.Now()}
		fb.swapped()
		started, ok := fb.end(failover.Transition{}, sl)
		if !ok || !started.Equal(fb.lastAt) {
			t.Fatalf("swapped handover: ok %v, started %v", ok, started)
		}
		var d dto.Metric
		if err := fb.metrics.placementRestore.Write(&d); err != nil {
			t.Fatal(err)
		}
		if h := d.GetHistogram(); h.GetSampleCount() != 1 || h.GetSampleSum() != 60 {
			t.Fatalf("placement restores: %d observed, %vs in all; want one of 60s (from the first loss)", h.GetSampleCount(), h.GetSampleSum())
		}
		fb.noteFirstToken(0.25)
		fb.sync(failover.ServingReady, failover.NoHandover, true)
		v = fb.shown()
		if v.GetSucceeded() != 1 || v.GetConsecutiveFailures() != 0 || v.GetState() != "idle" || v.GetLastFirstTokenSeconds() != 0.25 {
			t.Fatalf("after a handover that succeeded: %v", v)
		}
		if h := testutil.ToFloat64(fb.metrics.placementG); h != 1 {
			t.Fatalf("placement gauge %v, want 1", h)
		}
	})
}
