package supervisor

import (
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"testing/synctest"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/frmps/frmps/internal/testenv"
	"github.com/frmps/frmps/supervisor/engine"
	"github.com/frmps/frmps/supervisor/failover"
)

// TEST DOUBLE of engine.Spare / ProcessLauncher's spares: a spare is a
// channel pair; activating one makes a fake engine with its pid that speaks
// the control protocol like any fake engine. engine/spare_test.go tests the
// real spare process; vllmpatch/tests/test_e2e_failback.py the whole path.
type fakeSpares struct {
	w        *fakeWorld
	mu       sync.Mutex
	started  []*fakeSpare
	exitWith int  // >0: every spare exits with this code before it is ready
	notReady bool // spares never finish their imports
	// holdReady(i): the i-th spare started (from 0) stays importing until the
	// test calls its finishImports.
	holdReady func(i int) bool
}

type fakeSpare struct {
	pid       int
	env       []string
	modules   string
	model     string
	ready     chan struct{}
	done      chan struct{}
	mu        sync.Mutex
	ws        syscall.WaitStatus
	exited    bool
	activated bool
	closed    bool
}

func (f *fakeSpare) PID() int                       { return f.pid }
func (f *fakeSpare) Done() <-chan struct{}          { return f.done }
func (f *fakeSpare) Ready() <-chan struct{}         { return f.ready }
func (f *fakeSpare) ReadyLine() string              { return engine.SpareReadyMark + " (fake)" }
func (f *fakeSpare) LastStderr() []string           { return []string{"fake spare stderr"} }
func (f *fakeSpare) WaitStatus() syscall.WaitStatus { f.mu.Lock(); defer f.mu.Unlock(); return f.ws }

func (f *fakeSpare) CheckEnv(env []string) error { return engine.CheckActivationEnv(f.env, env) }

func (f *fakeSpare) Close(time.Duration) {
	f.mu.Lock()
	f.closed = true
	f.mu.Unlock()
	f.exit(0)
}

func (f *fakeSpare) finishImports() { close(f.ready) }

func (f *fakeSpare) exit(ws syscall.WaitStatus) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.exited || f.activated { // after activation the engine owns done
		return
	}
	f.exited, f.ws = true, ws
	close(f.done)
}

func (fs *fakeSpares) StartSpare(env []string, logPath string, opts engine.SpareOptions) (Spare, error) {
	fs.w.mu.Lock()
	fs.w.nextPID++
	pid := fs.w.nextPID
	fs.w.mu.Unlock()
	sp := &fakeSpare{pid: pid, env: env, modules: opts.ModulesFile, model: opts.Model, ready: make(chan struct{}), done: make(chan struct{})}
	fs.mu.Lock()
	fs.started = append(fs.started, sp)
	exitWith, notReady := fs.exitWith, fs.notReady
	hold := fs.holdReady != nil && fs.holdReady(len(fs.started)-1)
	fs.mu.Unlock()
	switch {
	case exitWith > 0:
		go sp.exit(exitCode(exitWith))
	case !notReady && !hold:
		close(sp.ready)
	}
	return sp, nil
}

func (fs *fakeSpares) ActivateSpare(sp Spare, role failover.Role, inv engine.Invocation, env []string, logPath string) (Process, error) {
	f := sp.(*fakeSpare)
	if err := f.CheckEnv(env); err != nil {
		return nil, err
	}
	f.mu.Lock()
	f.activated = true
	f.mu.Unlock()
	return fs.w.spawn(&fakeProc{pid: f.pid, role: role, inv: inv, env: env, logPath: logPath, done: f.done}), nil
}

func (fs *fakeSpares) list() []*fakeSpare {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	return slices.Clone(fs.started)
}

func TestSpareBecomesTheEngineAfterAFailover(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		w := newWorld()
		w.spares = &fakeSpares{w: w}
		h := start(t, w, func(c *Config) { c.Spare = "on" })
		h.wantState(failover.ServingReady)
		spares := w.spares.list()
		if len(spares) != 1 {
			t.Fatalf("%d spares once the pair is ready, want 1", len(spares))
		}
		sp := spares[0]
		if !strings.HasSuffix(sp.modules, "engine-modules.txt") || !slices.Contains(sp.env, "FRMPS_MODULES_FILE="+sp.modules) || sp.model != "tiny" {
			t.Fatalf("spare env %v modules %s", sp.env, sp.modules)
		}
		if st := h.s.Status().GetSpare(); st.GetState() != "ready" || int(st.GetPid()) != sp.pid {
			t.Fatalf("spare status %v", st)
		}
		w.liveRole(failover.Active).Kill()
		synctest.Wait()
		// The failover promoted the standby (outside MPS); the spare became the
		// fresh standby inside MPS, and failback swapped the two.
		h.wantState(failover.ServingReady)
		st := h.s.Status()
		var fromSpare bool
		for _, e := range st.GetEngines() {
			if e.GetRole() == "active" && (int(e.GetPid()) != sp.pid || !e.GetInMps()) {
				t.Fatalf("active %v, want the spare %d inside MPS", e, sp.pid)
			}
			if int(e.GetPid()) == sp.pid {
				fromSpare = e.GetFromSpare()
			}
		}
		if st.GetFailback().GetSucceeded() != 1 {
			t.Fatalf("failback %v", st.GetFailback())
		}
		if !fromSpare || st.GetSpare().GetActivations() != 1 || st.GetSpare().GetColdStarts() != 0 {
			t.Fatalf("engines %v spare %v", st.GetEngines(), st.GetSpare())
		}
		if v := testutil.ToFloat64(h.s.metrics.launchesFrom.WithLabelValues("spare")); v != 1 {
			t.Fatalf("launches{spare} = %v", v)
		}
		// The consumed spare was replaced at once.
		spares = w.spares.list()
		if len(spares) != 2 || h.s.Status().GetSpare().GetPid() != int32(spares[1].pid) {
			t.Fatalf("spares %d, status %v", len(spares), h.s.Status().GetSpare())
		}
		h.stop()
		if !spares[1].closed {
			t.Fatal("the unused spare was not sent away at shutdown")
		}
		if v := testutil.ToFloat64(h.s.metrics.spareReadyG); v != 0 {
			t.Fatalf("spare_ready = %v after shutdown", v)
		}
	})
}

func TestSparesThatDieAreRetriedThenTurnedOff(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		w := newWorld()
		w.spares = &fakeSpares{w: w, exitWith: 1}
		h := start(t, w, func(c *Config) { c.Spare = "on"; c.NoFailback = true })
		h.wantState(failover.ServingReady)
		time.Sleep(time.Minute) // past every backoff
		synctest.Wait()
		if n := len(w.spares.list()); n != spareMaxFails {
			t.Fatalf("%d spares started, want %d", n, spareMaxFails)
		}
		st := h.s.Status().GetSpare()
		if !strings.HasPrefix(st.GetState(), "off: ") || !strings.Contains(st.GetState(), "exit code 1") {
			t.Fatalf("spare state %q", st.GetState())
		}
		// Engines now start cold, as without spares.
		w.liveRole(failover.Active).Kill()
		synctest.Wait()
		h.wantState(failover.ServingReady)
		if st := h.s.Status().GetSpare(); st.GetColdStarts() != 1 || st.GetActivations() != 0 {
			t.Fatalf("spare %v", st)
		}
		h.stop()
	})
}

func TestSparesOffWhenTheirImportsInitialiseCUDA(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		w := newWorld()
		w.spares = &fakeSpares{w: w, exitWith: engine.SpareExitDriverInitialised}
		h := start(t, w, func(c *Config) { c.Spare = "on" })
		h.wantState(failover.ServingReady)
		time.Sleep(time.Minute)
		synctest.Wait()
		if n := len(w.spares.list()); n != 1 {
			t.Fatalf("%d spares started, want 1 (no retry)", n)
		}
		if st := h.s.Status().GetSpare().GetState(); !strings.Contains(st, "CUDA driver") {
			t.Fatalf("spare state %q", st)
		}
		h.stop()
	})
}

func TestSpareStillImportingIsUsedAndShutdownDoesNotWaitForIt(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		w := newWorld()
		w.spares = &fakeSpares{w: w, notReady: true}
		h := start(t, w, func(c *Config) { c.Spare = "on"; c.NoFailback = true })
		h.wantState(failover.ServingReady)
		if st := h.s.Status().GetSpare().GetState(); st != "importing" {
			t.Fatalf("spare state %q", st)
		}
		// A spare still importing is still the faster start: it takes the
		// command line when its imports are done.
		sp := w.spares.list()[0]
		w.liveRole(failover.Active).Kill()
		synctest.Wait()
		if sb := w.liveRole(failover.Standby); sb == nil || sb.pid != sp.pid {
			t.Fatalf("standby %v, want the spare %d", sb, sp.pid)
		}
		h.stop()
		for _, sp := range w.spares.list()[1:] {
			if !sp.closed {
				t.Fatalf("spare %d not sent away", sp.pid)
			}
		}
	})
}

func TestSparesFollowTheDevice(t *testing.T) {
	for _, tc := range []struct {
		device, spare string
		on            bool
	}{{"cpu", "", false}, {"cpu", "auto", false}, {"cuda", "", true}, {"cuda", "auto", true}, {"cuda", "off", false}, {"cpu", "on", true}} {
		c := Config{Device: tc.device, Spare: tc.spare}
		if got := c.sparesOn(); got != tc.on {
			t.Errorf("device %q spare %q: on %v, want %v", tc.device, tc.spare, got, tc.on)
		}
	}
	synctest.Test(t, func(t *testing.T) {
		w := newWorld()
		w.spares = &fakeSpares{w: w}
		h := start(t, w, nil) // the CPU: spares default off
		h.wantState(failover.ServingReady)
		if n := len(w.spares.list()); n != 0 {
			t.Fatalf("%d spares on the CPU by default", n)
		}
		if st := h.s.Status().GetSpare(); st.GetEnabled() || st.GetState() != "off" {
			t.Fatalf("spare %v", st)
		}
		h.stop()
	})
	cfg := testConfig(t)
	cfg.Spare = "sometimes"
	if _, err := NewWithDeps(cfg, newWorld().deps(), nil, nil); err == nil || !strings.Contains(err.Error(), "spare") {
		t.Fatalf("bad --spare accepted: %v", err)
	}
}

func TestSeveralSparesTheReadyOneFirst(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		w := newWorld()
		// The first spare stays importing: the second, ready, must be the one taken.
		w.spares = &fakeSpares{w: w, holdReady: func(i int) bool { return i == 0 }}
		h := start(t, w, func(c *Config) { c.Spare, c.Spares = "on", 2 })
		h.wantState(failover.ServingReady)
		spares := w.spares.list()
		if len(spares) != 2 {
			t.Fatalf("%d spares once the pair is ready, want 2", len(spares))
		}
		st := h.s.Status().GetSpare()
		if st.GetState() != "ready" || int(st.GetPid()) != spares[1].pid || st.GetSize() != 2 || st.GetReadyCount() != 1 {
			t.Fatalf("spare status %v, want the second (pid %d) ready, 1 of 2", st, spares[1].pid)
		}
		if v := testutil.ToFloat64(h.s.metrics.spareReadyG); v != 1 {
			t.Fatalf("spare_ready = %v, want 1", v)
		}
		w.liveRole(failover.Active).Kill()
		synctest.Wait()
		h.wantState(failover.ServingReady)
		if a, _ := h.wantPlacementRestored(); a.pid != spares[1].pid {
			t.Fatalf("active pid %d, want the ready spare %d", a.pid, spares[1].pid)
		}
		// The consumed one was replaced at once; the one still importing stays.
		spares = w.spares.list()
		if len(spares) != 3 || spares[0].closed {
			t.Fatalf("%d spares started (want 3), the first closed: %v", len(spares), spares[0].closed)
		}
		spares[0].finishImports()
		synctest.Wait()
		if st := h.s.Status().GetSpare(); st.GetReadyCount() != 2 || int(st.GetPid()) != spares[0].pid {
			t.Fatalf("spare status %v, want 2 ready, the oldest (pid %d) next", st, spares[0].pid)
		}
		// A second fault at once: restored from a ready spare again, without
		// waiting for a replacement's imports.
		a, _ := h.roles()
		a.Kill()
		synctest.Wait()
		h.wantState(failover.ServingReady)
		if a, _ := h.wantPlacementRestored(); a.pid != spares[0].pid {
			t.Fatalf("active pid %d, want the oldest ready spare %d", a.pid, spares[0].pid)
		}
		st = h.s.Status().GetSpare()
		if st.GetActivations() != 2 || st.GetColdStarts() != 0 || st.GetReadyCount() != 2 {
			t.Fatalf("spare status %v", st)
		}
		h.stop()
		spares = w.spares.list()
		if len(spares) != 4 {
			t.Fatalf("%d spares started, want 4", len(spares))
		}
		for _, sp := range spares[2:] {
			if !sp.closed {
				t.Fatalf("spare %d not sent away at shutdown", sp.pid)
			}
		}
		if v := testutil.ToFloat64(h.s.metrics.spareReadyG); v != 0 {
			t.Fatalf("spare_ready = %v after shutdown", v)
		}
	})
	cfg := testConfig(t)
	for _, n := range []int{-1, MaxSpares + 1} {
		cfg.Spares = n
		if _, err := NewWithDeps(cfg, newWorld().deps(), nil, nil); err == nil || !strings.Contains(err.Error(), "spares") {
			t.Fatalf("spares %d accepted: %v", n, err)
		}
	}
}

func TestResidentBytesOfLiveAndGoneProcesses(t *testing.T) {
	if _, err := os.Stat("/proc/self/statm"); err != nil {
		testenv.Missing(t, "no /proc/self/statm: this test reads a process's resident memory from /proc")
	}
	if got := residentBytes([]int{os.Getpid()}); got < 1<<20 {
		t.Fatalf("this process's resident memory %d bytes", got)
	}
	one := residentBytes([]int{os.Getpid()})
	if got := residentBytes([]int{os.Getpid(), -1, 1 << 30}); got < one/2 || got > 2*one {
		t.Fatalf("with pids that do not exist: %d, alone %d", got, one)
	}
	if got := residentBytes(nil); got != 0 {
		t.Fatalf("no pids: %d", got)
	}
}

// newSpares is a spares owner on its own: its events go to the returned
// channel instead of a loop.
func newSpares(t *testing.T, w *fakeWorld, size int) (*spares, chan event, func()) {
	t.Helper()
	m, err := newMetrics(nil, "m")
	if err != nil {
		t.Fatal(err)
	}
	events, stopped := make(chan event, 16), make(chan struct{})
	wg := &sync.WaitGroup{}
	n := 0
	sp := &spares{launcher: w.spares, size: size, model: "m", log: hclog.NewNullLogger(), metrics: m,
		post: func(ev event) { events <- ev }, stopped: stopped, wg: wg,
		env: func() []string { return []string{"A=1"} }, modules: func() string { return "/run/modules.txt" },
		logPath: func() string { n++; return fmt.Sprintf("/logs/spare-%d.log", n) }}
	return sp, events, func() { sp.stop(); close(stopped); wg.Wait() }
}

// The pool fills once the pair was ready, the ready spare goes first, a
// launch with none left starts cold, and stop sends the rest away.
func TestSparesFillTakeAndStop(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		w := newWorld()
		w.spares = &fakeSpares{w: w, holdReady: func(i int) bool { return i == 0 }}
		sp, events, stop := newSpares(t, w, 2)
		sp.fill(failover.Starting)
		if len(sp.pool) != 0 {
			t.Fatalf("%d spares started before the pair was ready", len(sp.pool))
		}
		sp.fill(failover.ServingReady)
		sp.fill(failover.ServingReady)
		started := w.spares.list()
		if len(sp.pool) != 2 || len(started) != 2 {
			t.Fatalf("pool %d, started %d; want 2 and 2", len(sp.pool), len(started))
		}
		if got := started[1].env; !slices.Equal(got, []string{"A=1"}) || started[1].modules != "/run/modules.txt" || started[1].model != "m" {
			t.Fatalf("spare started with env %v modules %q model %q", got, started[1].modules, started[1].model)
		}
		synctest.Wait()
		ev := <-events
		if ev.kind != evSpareReady || ev.spare != Spare(started[1]) {
			t.Fatalf("event %v for spare %v, want the second spare ready", ev.kind, ev.spare)
		}
		sp.ready(ev)
		if st, _ := sp.shown(); st.GetState() != "ready" || st.GetPid() != int32(started[1].pid) || st.GetReadyCount() != 1 {
			t.Fatalf("shown %v, want the second spare ready", st)
		}
		inv := engine.Invocation{Role: engine.RoleStandby, Model: "m"}
		p, ok := sp.launch(failover.Standby, inv, []string{"A=1"}, "/logs/standby-3.log")
		if !ok || p.PID() != started[1].pid {
			t.Fatalf("launch took %v (ok %v), want the ready spare %d", p, ok, started[1].pid)
		}
		sp.fill(failover.ServingReady) // replaced at once
		if len(w.spares.list()) != 3 || len(sp.pool) != 2 {
			t.Fatalf("started %d, pool %d after a launch; want the spare replaced", len(w.spares.list()), len(sp.pool))
		}
		synctest.Wait()
		sp.ready(<-events) // the replacement's imports are done
		// The ready replacement goes before the older spare still importing.
		if p, ok := sp.launch(failover.Standby, inv, []string{"A=1"}, ""); !ok || p.PID() != w.spares.list()[2].pid {
			t.Fatalf("launch took %v (ok %v), want the ready replacement", p, ok)
		}
		sp.fill(failover.CrashLoop) // no spare starts in a crash loop
		if len(w.spares.list()) != 3 {
			t.Fatalf("%d spares started, want no new one in a crash loop", len(w.spares.list()))
		}
		// The spare still importing is the last; then launches start cold.
		if p, ok := sp.launch(failover.Standby, inv, []string{"A=1"}, ""); !ok || p.PID() != started[0].pid {
			t.Fatalf("launch took %v (ok %v), want the spare still importing", p, ok)
		}
		if _, ok := sp.launch(failover.Standby, inv, []string{"A=1"}, ""); ok {
			t.Fatal("a launch with the pool empty took a spare")
		}
		if st, _ := sp.shown(); st.GetActivations() != 3 || st.GetColdStarts() != 1 || st.GetState() != "none" {
			t.Fatalf("shown %v, want 3 activations, 1 cold start, state none", st)
		}
		sp.fill(failover.ServingReady)
		left := w.spares.list()[3]
		stop()
		if !left.closed {
			t.Fatalf("spare %d not sent away at stop", left.pid)
		}
		if st, _ := sp.shown(); st.GetReadyCount() != 0 || st.GetState() != "none" {
			t.Fatalf("shown %v after stop, want no spare", st)
		}
	})
}

// Spares that fail are retried with a doubling backoff, then turned off.
func TestSparesBackOffThenTurnOff(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		w := newWorld()
		w.spares = &fakeSpares{w: w, exitWith: 1}
		sp, events, stop := newSpares(t, w, 1)
		defer stop()
		t0 := time.Now()
		var retries []time.Duration
		sp.fill(failover.ServingReady)
		for sp.off == "" {
			synctest.Wait()
			ev := <-events
			switch ev.kind {
			case evSpareDied:
				sp.died(ev)
				if st, _ := sp.shown(); sp.off == "" && st.GetState() != "backoff" {
					t.Fatalf("state %q after a failed spare, want backoff", st.GetState())
				}
			case evSpareDue:
				retries = append(retries, time.Since(t0))
				sp.due(ev)
			default:
				t.Fatalf("unexpected event %v", ev.kind)
			}
			sp.fill(failover.ServingReady)
		}
		want := []time.Duration{spareBaseBackoff, 3 * spareBaseBackoff}
		if !slices.Equal(retries, want) || len(w.spares.list()) != spareMaxFails {
			t.Fatalf("retries at %v with %d spares started; want %v and %d", retries, len(w.spares.list()), want, spareMaxFails)
		}
		if st, _ := sp.shown(); !strings.HasPrefix(st.GetState(), "off: 3 spares in a row failed") {
			t.Fatalf("state %q", st.GetState())
		}
	})
}
