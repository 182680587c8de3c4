package supervisor

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/frmps/frmps/supervisor/failover"
)

func appendServerLog(t *testing.T, dir, line string) {
	t.Helper()
	f, err := os.OpenFile(filepath.Join(dir, "server.log"), os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteString(line + "\n"); err != nil {
		t.Fatal(err)
	}
}

// The MPS server's log says it tears the active's context down: the
// supervisor fails over at once, before the active dies of the fault, and
// ignores what it says about other clients and what it said before.
func TestMPSServerTeardownFailsOverAtOnce(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		w := newWorld()
		w.mps.logDir = t.TempDir()
		h := start(t, w, nil)
		act, sb := h.roles()
		appendServerLog(t, w.mps.logDir, fmt.Sprintf("[2026-11-23 22:19:03.147 Server  1623] Client {PID: %d, Context ID: 1} on device 0 to be torn down", sb.pid))
		appendServerLog(t, w.mps.logDir, "[2026-11-23 22:19:03.147 Server  1623] Client {PID: 999999, Context ID: 1} on device 0 to be torn down")
		time.Sleep(50 * time.Millisecond)
		synctest.Wait()
		if n := len(h.s.Status().Failovers); n != 0 {
			t.Fatalf("%d failovers for teardowns of other clients", n)
		}
		appendServerLog(t, w.mps.logDir, fmt.Sprintf("[2026-11-23 22:19:03.147 Server  1623] Client {PID: %d, Context: 1} encountered a fatal GPU error.", act.pid))
		time.Sleep(10 * time.Millisecond)
		synctest.Wait()
		recs := h.s.Status().Failovers
		if len(recs) != 1 || recs[0].GetCause() != "mps_fault" || !recs[0].GetOk() {
			t.Fatalf("records %v", recs)
		}
		if len(sb.resumes) != 1 {
			t.Fatalf("standby got %d resumes", len(sb.resumes))
		}
		if v := testutil.ToFloat64(h.s.metrics.failovers.WithLabelValues("mps_fault")); v != 1 {
			t.Fatalf("failovers{mps_fault} %v", v)
		}
		// frmps's own daemon is restarted before an engine is launched into it again.
		if restarts := w.mps.recovers(); restarts != 1 {
			t.Fatalf("MPS restarted %d times after the fatal error, want 1", restarts)
		}
		// The same line again (the server repeats the pid in several lines): one failover.
		appendServerLog(t, w.mps.logDir, fmt.Sprintf("[2026-11-23 22:19:03.147 Server  1623] Client {PID: %d, Context ID: 1} on device 0 to be torn down", act.pid))
		time.Sleep(30 * time.Second)
		synctest.Wait()
		if n := len(h.s.Status().Failovers); n != 1 {
			t.Fatalf("%d failovers, want 1", n)
		}
		h.wantState(failover.ServingReady)
		h.stop()
	})
}

// The operator's daemon is never restarted after a fatal error.
func TestMPSFaultLeavesTheOperatorsDaemon(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		w := newWorld()
		w.mps.logDir, w.mps.shared = t.TempDir(), true
		h := start(t, w, nil)
		act, _ := h.roles()
		appendServerLog(t, w.mps.logDir, fmt.Sprintf("[2026-11-23 22:19:03.147 Server  1623] Client {PID: %d, Context ID: 1} on device 0 to be torn down", act.pid))
		time.Sleep(30 * time.Second)
		synctest.Wait()
		if recs := h.s.Status().Failovers; len(recs) != 1 || recs[0].GetCause() != "mps_fault" {
			t.Fatalf("records %v", recs)
		}
		if restarts := w.mps.recovers(); restarts != 0 {
			t.Fatalf("the operator's daemon was restarted %d times", restarts)
		}
		h.stop()
	})
}

// With the watch turned off, the same line changes nothing.
func TestMPSFaultWatchOff(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		w := newWorld()
		w.mps.logDir = t.TempDir()
		h := start(t, w, func(c *Config) { c.NoMPSFaultWatch = true })
		act, _ := h.roles()
		appendServerLog(t, w.mps.logDir, fmt.Sprintf("[2026-11-23 22:19:03.147 Server  1623] Client {PID: %d, Context ID: 1} on device 0 to be torn down", act.pid))
		time.Sleep(time.Second)
		synctest.Wait()
		if n := len(h.s.Status().Failovers); n != 0 {
			t.Fatalf("%d failovers with the watch off", n)
		}
		h.stop()
	})
}

// newMPSDaemon is an mpsDaemon owner on its own with d as its daemon: the
// check's outcome goes to the returned channel instead of a loop.
func newMPSDaemon(d MPS) (*mpsDaemon, chan event) {
	events := make(chan event, 4)
	return &mpsDaemon{log: hclog.NewNullLogger(), post: func(ev event) { events <- ev }, wg: &sync.WaitGroup{},
		window: 10 * time.Second, d: d, state: "running"}, events
}

// One check at a time; a daemon that does not answer is restarted when it is
// frmps's own, waited for when it is the operator's; a fault reported by the
// server restarts frmps's own daemon before the check.
func TestMPSDaemonCheck(t *testing.T) {
	for _, tc := range []struct {
		name       string
		mps        *fakeMPS
		faulted    bool
		wantErr    string
		wantState  string
		wantChecks int
		wantRecov  int
	}{
		{"answers", &fakeMPS{}, false, "", "running", 1, 0},
		{"restarted", &fakeMPS{checkErr: errors.New("no answer")}, false, "", "running (restarted)", 1, 1},
		{"cannot restart", &fakeMPS{checkErr: errors.New("no answer"), restartErr: errors.New("no binary")}, false,
			"restart MPS: no binary", "failed: restart MPS: no binary", 1, 1},
		{"operator's answers again", &fakeMPS{shared: true, checkErr: errors.New("no answer")}, false, "",
			"joined (the operator's daemon answers again)", 1, 1},
		{"fresh server after a fault", &fakeMPS{}, true, "", "running (restarted after a fatal GPU error)", 1, 1},
		{"the operator's is never restarted for a fault", &fakeMPS{shared: true}, true, "", "running", 1, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m, events := newMPSDaemon(tc.mps)
			m.faulted = tc.faulted
			m.check()
			m.check() // busy: no second check
			ev := <-events
			m.wg.Wait()
			if len(events) != 0 {
				t.Fatal("a second check ran while one was in progress")
			}
			if ev.kind != evMPSChecked || errString(ev.err) != tc.wantErr {
				t.Fatalf("checked %v with %v, want error %q", ev.kind, ev.err, tc.wantErr)
			}
			if !m.busy || m.faulted {
				t.Fatalf("busy %v, faulted %v before the outcome is taken", m.busy, m.faulted)
			}
			m.checked(ev.err)
			if m.busy || errString(m.err) != tc.wantErr {
				t.Fatalf("after checked: busy %v, err %v", m.busy, m.err)
			}
			if got := m.shownState(); got != tc.wantState {
				t.Fatalf("state %q, want %q", got, tc.wantState)
			}
			if tc.mps.checks != tc.wantChecks || tc.mps.restarts != tc.wantRecov {
				t.Fatalf("%d checks, %d restarts; want %d and %d", tc.mps.checks, tc.mps.restarts, tc.wantChecks, tc.wantRecov)
			}
		})
	}
	m, events := newMPSDaemon(nil)
	m.check()
	if m.busy || len(events) != 0 {
		t.Fatal("checked with no daemon")
	}
}

// A standby inside MPS that dies within the recovery window of an MPS
// active's death was not admitted, unless it refused on its own (exit 2);
// the server's teardown of the active's leader marks a fault.
func TestMPSDaemonAdmissionAndTeardown(t *testing.T) {
	m, _ := newMPSDaemon(&fakeMPS{})
	t0 := time.Unix(1000, 0)
	running := &fakeProc{pid: 10, done: make(chan struct{})}
	refused := &fakeProc{pid: 11, done: make(chan struct{})}
	refused.exit(exitCode(engineExitRefused))
	crashed := &fakeProc{pid: 12, done: make(chan struct{})}
	crashed.exit(exitCode(1))
	in := func(p Process) *slot { return &slot{proc: p, inMPS: true} }
	if m.notAdmitted(in(running), t0) {
		t.Fatal("not admitted with no MPS death")
	}
	m.activeDied(t0)
	for _, tc := range []struct {
		name string
		sl   *slot
		at   time.Time
		want bool
	}{
		{"still running", in(running), t0.Add(time.Second), true},
		{"crashed", in(crashed), t0.Add(time.Second), true},
		{"refused on its own", in(refused), t0.Add(time.Second), false},
		{"outside MPS", &slot{proc: crashed}, t0.Add(time.Second), false},
		{"past the window", in(crashed), t0.Add(11 * time.Second), false},
	} {
		if got := m.notAdmitted(tc.sl, tc.at); got != tc.want {
			t.Errorf("%s: not admitted %v, want %v", tc.name, got, tc.want)
		}
	}
	m.window = -1
	if m.notAdmitted(in(crashed), t0.Add(time.Second)) {
		t.Error("not admitted with the window off")
	}

	active := in(running)
	if m.tearsDown(&slot{proc: running}, event{pid: 10}) || m.tearsDown(active, event{pid: 1 << 30}) || m.faulted {
		t.Fatal("a teardown of another client, or of an active outside MPS, counted")
	}
	if !m.tearsDown(active, event{pid: 10}) || !m.faulted {
		t.Fatal("the teardown of the active's leader did not count")
	}
	active.dead = true
	if m.tearsDown(active, event{pid: 10}) {
		t.Fatal("a dead active's teardown counted again")
	}
}

func TestMPSStartFailure(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		w := newWorld()
		w.mps.startErr = errors.New("nvidia-cuda-mps-control: not found")
		cfg := testConfig(t)
		s, err := NewWithDeps(cfg, w.deps(), hclog.NewNullLogger(), prometheus.NewRegistry())
		if err != nil {
			t.Fatal(err)
		}
		err = s.Run(context.Background())
		if err == nil || !strings.Contains(err.Error(), "start MPS") || !strings.Contains(err.Error(), "not found") {
			t.Fatalf("Run: %v", err)
		}
		if _, err := os.Stat(cfg.RunDir); !errors.Is(err, os.ErrNotExist) {
			t.Fatal("run dir left behind")
		}
		if _, _, err := s.Current(context.Background(), 1); !errors.Is(err, ErrUnavailable) {
			t.Fatalf("Current after failed start: %v", err)
		}
	})
}

func TestMPSRestartFailureStopsColdStart(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		w := newWorld()
		h := start(t, w, nil)
		w.mps.checkErr = errors.New("daemon gone")
		w.mps.restartErr = errors.New("cannot start")
		w.liveRole(failover.Standby).Kill()
		w.liveRole(failover.Active).Kill()
		synctest.Wait()
		time.Sleep(time.Second)
		synctest.Wait()
		h.wantState(failover.CrashLoop)
		st := h.s.Status()
		if !strings.Contains(st.GetStateCause(), "MPS") || !strings.Contains(st.GetMpsState(), "cannot start") {
			t.Fatalf("status %v", st)
		}
		h.stop()
	})
}

// The operator's MPS daemon (--mps-pipe-dir): joined, checked after each
// failover, waited for when it does not answer — never restarted — and
// reported when it stays away; a cold start then trips the breaker.
func TestSharedMPS(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		w := newWorld()
		w.mps.shared = true
		h := start(t, w, func(c *Config) { c.MPSPipeDir = "/op/mps/pipe" })
		h.wantState(failover.ServingReady)
		if st := h.s.Status().GetMpsState(); st != "joined the operator's daemon at /op/mps/pipe" {
			t.Fatalf("mps state %q", st)
		}
		if act := w.liveRole(failover.Active); !slices.Contains(act.env, "CUDA_MPS_PIPE_DIRECTORY=/fake/mps/pipe") {
			t.Fatalf("active env %v", act.env)
		}
		w.mps.mu.Lock()
		w.mps.checkErr = errors.New("server gone")
		w.mps.mu.Unlock()
		w.liveRole(failover.Active).Kill()
		synctest.Wait()
		time.Sleep(time.Second)
		synctest.Wait()
		h.wantState(failover.ServingReady)
		if st := h.s.Status().GetMpsState(); st != "joined (the operator's daemon answers again)" {
			t.Fatalf("mps state after a recovered check %q", st)
		}
		w.mps.mu.Lock()
		w.mps.restartErr = errors.New("did not answer within 30s; frmps does not restart it")
		w.mps.mu.Unlock()
		for _, p := range w.live() { // the promoted engine and the fresh standby
			p.Kill()
		}
		synctest.Wait()
		time.Sleep(time.Second)
		synctest.Wait()
		h.wantState(failover.CrashLoop)
		st := h.s.Status()
		if !strings.Contains(st.GetMpsState(), "failed: the operator's MPS daemon: did not answer") || !strings.Contains(st.GetStateCause(), "MPS") {
			t.Fatalf("status %v", st)
		}
		w.mps.mu.Lock()
		if w.mps.restarts != 2 {
			t.Fatalf("%d recoveries, want 2", w.mps.restarts)
		}
		w.mps.mu.Unlock()
		h.stop()
	})
}

func TestNoMPS(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		w := newWorld()
		logDir := t.TempDir()
		h := start(t, w, func(c *Config) { c.NoMPS = true; c.LogDir = logDir })
		h.wantState(failover.ServingReady)
		act := w.liveRole(failover.Active)
		if act.logPath != filepath.Join(logDir, "active-1.log") {
			t.Fatalf("engine log %s, want it in %s", act.logPath, logDir)
		}
		// The base environment, and where the first served engine lists its modules for spares.
		if !slices.Equal(act.env, []string{"PATH=/usr/bin", "FRMPS_MODULES_FILE=" + filepath.Join(h.s.runDir, "engine-modules.txt")}) {
			t.Fatalf("env %v", act.env)
		}
		if h.s.Status().GetMpsState() != "disabled" {
			t.Fatal("mps state")
		}
		h.stop()
	})
}
