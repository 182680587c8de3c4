package supervisor

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/hashicorp/go-hclog"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
	"github.com/frmps/frmps/supervisor/failover"
)

// newPair is a pair owner on its own, on the fake world: its events go to the
// returned channel instead of a loop (so the test plays the loop); stop shuts
// its engines down and waits for their goroutines.
func newPair(t *testing.T, w *fakeWorld) (*pair, chan event, func()) {
	t.Helper()
	cfg := testConfig(t)
	cfg.setDefaults()
	m, err := newMetrics(nil, cfg.Model)
	if err != nil {
		t.Fatal(err)
	}
	runDir := t.TempDir()
	events, stopped := make(chan event, 64), make(chan struct{})
	wg := &sync.WaitGroup{}
	p := &pair{cfg: &cfg, deps: w.deps(), log: hclog.NewNullLogger(), metrics: m,
		post: func(ev event) { events <- ev }, enqueue: func(ev event) { events <- ev }, stopped: stopped,
		wg: wg, spares: &spares{}, limit: &modelLimit{configured: 4096}, deployID: "d", beat: time.Second,
		runDir: runDir, logDir: filepath.Join(runDir, "logs"), ringPath: "/ring", slots: map[*slot]struct{}{}}
	p.openBroker(w.deps().NewBroker())
	var once sync.Once
	stop := func() {
		once.Do(func() {
			p.shutdown(time.Second)
			close(stopped)
			wg.Wait()
			p.closeBroker()
		})
	}
	t.Cleanup(stop)
	return p, events, stop
}

// next waits for the pair's next event of kind, skipping others.
func nextEvent(t *testing.T, events chan event, kind evKind) event {
	t.Helper()
	for {
		synctest.Wait()
		select {
		case ev := <-events:
			if ev.kind == kind {
				return ev
			}
		default:
			t.Fatalf("no event %v came", kind)
		}
	}
}

// An active launched by the pair shakes hands (its goroutine reports ready),
// a standby after it gets the active's pools; both are named by their id in
// the run dir; promote makes the standby the active and retires the old one.
func TestPairLaunchesAndPromotes(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		w := newWorld()
		p, events, stop := newPair(t, w)
		noEnv := func() ([]string, error) { return []string{"A=1"}, nil }
		p.start(failover.Active, true, noEnv)
		act := p.active
		if ev := nextEvent(t, events, evReady); ev.slot != act || act.id != 1 || !act.inMPS {
			t.Fatalf("ready %v, want the active (id 1, in MPS)", ev.slot)
		}
		if err := p.dialGeneration(act); err != nil || act.gen == nil {
			t.Fatalf("dial the active's generation API: %v", err)
		}
		p.start(failover.Standby, false, noEnv)
		sb := p.standby
		nextEvent(t, events, evReady)
		fp := w.liveRole(failover.Standby)
		fp.mu.Lock()
		pools := fp.sleep.GetPools()
		fp.mu.Unlock()
		if len(pools) != len(testPools) {
			t.Fatalf("standby slept with %d pools, want the active's %d", len(pools), len(testPools))
		}
		if want := filepath.Join(p.runDir, "ctl-2.sock"); sb.ctlSocket != want || fp.logPath != filepath.Join(p.logDir, "standby-2.log") {
			t.Fatalf("standby socket %q log %q", sb.ctlSocket, fp.logPath)
		}
		if p.inverted() || !p.placementOK(true) {
			t.Fatal("active in MPS, standby out: the placement holds")
		}
		p.fenceFirst(act)
		if !act.dead || !act.groupPending {
			t.Fatal("the dead active's leader was not fenced alone")
		}
		p.promote()
		if p.active != sb || p.standby != nil || sb.roleNow() != failover.Active || sb.state != "serving" {
			t.Fatalf("after promote: active %v standby %v", p.active, p.standby)
		}
		for _, path := range []string{act.ctlSocket, act.genSocket} { // as a real engine leaves them
			if err := os.WriteFile(path, nil, 0o600); err != nil {
				t.Fatal(err)
			}
		}
		synctest.Wait()
		p.reap()
		if _, ok := p.slots[act]; ok {
			t.Fatal("the retired, reaped active is still a slot")
		}
		if _, err := os.Stat(act.ctlSocket); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("the reaped active's socket: %v", err)
		}
		if p.placementOK(true) || !p.placementOK(false) {
			t.Fatal("the promoted active runs outside MPS: the placement does not hold (with MPS on)")
		}
		stop()
		if len(p.slots) != 0 || p.active != nil {
			t.Fatalf("%d slots, active %v after shutdown", len(p.slots), p.active)
		}
	})
}

// A launch that fails (the environment, the socket, the launcher) is a dead
// slot of its role with a death event; a delayed start fires once, unless
// cancelled; a start that waits for the MPS check is handed back once.
func TestPairFailedLaunchesAndDelayedStarts(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		w := newWorld()
		p, events, _ := newPair(t, w)
		p.start(failover.Active, false, func() ([]string, error) { return nil, errors.New("outside-MPS env: no dir") })
		ev := nextEvent(t, events, evDied)
		if ev.slot != p.active || ev.cause != "launch failed: outside-MPS env: no dir" || ev.slot.proc.PID() != 0 {
			t.Fatalf("died %q for %v", ev.cause, ev.slot)
		}
		w.mu.Lock()
		w.launchErr = errors.New("no such binary")
		w.mu.Unlock()
		p.start(failover.Standby, false, func() ([]string, error) { return nil, nil })
		if ev := nextEvent(t, events, evDied); ev.slot != p.standby || !strings.Contains(ev.cause, "no such binary") {
			t.Fatalf("died %q", ev.cause)
		}
		if len(p.slots) != 0 {
			t.Fatalf("%d slots for launches that failed", len(p.slots))
		}

		p.startLater(failover.Active, time.Second)
		p.startLater(failover.Active, time.Second) // the first is stale now
		time.Sleep(time.Second)
		// Both fire at the same instant, in either order.
		a, b := nextEvent(t, events, evStartDue), nextEvent(t, events, evStartDue)
		if a.id > b.id {
			a, b = b, a
		}
		if p.startDue(a) || !p.startDue(b) || p.startDue(b) {
			t.Fatal("want only the start armed last to be due, once")
		}
		p.startLater(failover.Standby, time.Second)
		p.cancelStart(failover.Standby)
		time.Sleep(2 * time.Second)
		synctest.Wait()
		if len(events) != 0 {
			t.Fatal("a cancelled start fired")
		}
		p.waitForMPS(failover.Standby)
		if r := p.waiting(); len(r) != 1 || r[0] != failover.Standby || len(p.waiting()) != 0 {
			t.Fatalf("waiting %v, want the standby once", r)
		}
	})
}

// An active that dies starting is let exit on its own (bounded): its
// refusal code and its stderr's reason go into the cause; a refused
// handshake's reason leads the recorded cause.
func TestPairStartFailureAndBurial(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		w := newWorld()
		p, _, _ := newPair(t, w)
		proc := &fakeProc{pid: 7, done: make(chan struct{}), stderr: []string{"loading", "ValueError: max_model_len too large"}}
		sl := &slot{role: failover.Active, proc: proc, state: "starting"}
		go func() { time.Sleep(100 * time.Millisecond); proc.exit(exitCode(engineExitRefused)) }()
		cause, refused := p.startFailure(sl, "control socket closed")
		if !refused || cause != "control socket closed: ValueError: max_model_len too large" {
			t.Fatalf("cause %q refused %v", cause, refused)
		}

		hung := &fakeProc{pid: 8, done: make(chan struct{})}
		t0 := time.Now()
		sl = &slot{role: failover.Active, proc: hung, state: "starting", refused: "hello refused: wrong model"}
		if cause, refused := p.startFailure(sl, "x"); cause != "x" || !refused || time.Since(t0) != startExitWait {
			t.Fatalf("an engine that does not exit: cause %q refused %v after %s", cause, refused, time.Since(t0))
		}
		sl.state = "ready"
		if cause, refused := p.startFailure(sl, "x"); cause != "x" || refused {
			t.Fatalf("an engine past starting: cause %q refused %v", cause, refused)
		}

		cause, wasReady, refused := p.buried(sl, "control socket closed", classDrill)
		if cause != "hello refused: wrong model (control socket closed)" || !wasReady || !refused {
			t.Fatalf("buried: cause %q ready %v refused %v", cause, wasReady, refused)
		}
		if sl.state != "dead" || sl.deathCause != cause || sl.deathClass != classDrill {
			t.Fatalf("slot after burial: %q %q %q", sl.state, sl.deathCause, sl.deathClass)
		}
		next := &slot{role: failover.Active, proc: hung}
		if got := p.lastDeathCause(next); got != cause {
			t.Fatalf("the replacement shows its predecessor's death %q, want %q", got, cause)
		}
		if got := p.lastDeathCause(sl); got != "" {
			t.Fatalf("the dead engine shows its own death as its predecessor's: %q", got)
		}
		hung.exit(0)
	})
}

func TestStartDeathsAreClassifiedAndShownBesideTheReplacements(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		w := newWorld()
		w.behave = func(r failover.Role, n int) behavior {
			if r == failover.Active {
				return behavior{exitOnStart: n == 0, startExit: 5}
			}
			return behavior{exitOnStart: n == 0, startExit: 7}
		}
		h := start(t, w, nil)
		time.Sleep(2 * time.Second) // the restart's backoff, and the classification waits for the reap
		synctest.Wait()
		h.wantState(failover.ServingReady)
		got := map[string]*frmpsv1.EngineStatus{}
		for _, e := range h.s.Status().GetEngines() {
			got[e.GetRole()] = e
		}
		// Each replacement shows why the engine before it died: the classified exit,
		// not only what the control socket saw.
		for role, want := range map[failover.Role]string{failover.Active: "exit_code: exit code 5", failover.Standby: "exit_code: exit code 7"} {
			e := got[role.String()]
			if e == nil || e.GetRestarts() != 1 || e.GetLastDeathCause() != want {
				t.Fatalf("%s: %v, want last death cause %q", role, e, want)
			}
		}
		h.stop()
	})
}

func TestVersionMismatchRefusedToCrashLoop(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		w := newWorld()
		w.behave = func(failover.Role, int) behavior { return behavior{version: 2} }
		h := start(t, w, nil)
		time.Sleep(10 * time.Second)
		synctest.Wait()
		h.wantState(failover.CrashLoop)
		_, cause := h.state()
		if !strings.Contains(cause, "protocol version mismatch: engine speaks 2") {
			t.Fatalf("cause %q", cause)
		}
		p := w.procs[0]
		if p.welcome.GetAccepted() || !strings.Contains(p.welcome.GetReason(), "protocol version") {
			t.Fatalf("welcome %v", p.welcome)
		}
		_, _, err := h.s.Current(context.Background(), 1)
		if !errors.Is(err, ErrUnavailable) {
			t.Fatalf("Current: %v", err)
		}
		h.stop()
	})
}

func TestWrongPeerRefused(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		w := newWorld()
		// Before the standby connects, another process dials its socket.
		w.behave = func(r failover.Role, n int) behavior { return behavior{intruderFirst: r == failover.Standby && n == 0} }
		h := start(t, w, nil)
		h.wantState(failover.ServingReady)
		if w.refusedPeers != 1 {
			t.Fatalf("refused %d peers, want the intruder", w.refusedPeers)
		}
		if w.launched[failover.Standby] != 1 {
			t.Fatal("the intruder disturbed the real standby")
		}
		h.stop()
	})
}

func TestHandshakeTimeout(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		w := newWorld()
		w.behave = func(r failover.Role, n int) behavior { return behavior{hang: r == failover.Standby && n == 0} }
		h := start(t, w, nil)
		h.wantState(failover.Rearming)
		time.Sleep(6 * time.Second)
		synctest.Wait()
		h.wantState(failover.ServingReady)
		if w.launched[failover.Standby] != 2 {
			t.Fatalf("standby launched %d", w.launched[failover.Standby])
		}
		h.stop()
	})
}

func TestLaunchFailure(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		w := newWorld()
		w.launchErr = errors.New("exec: python3: not found")
		h := start(t, w, nil)
		time.Sleep(10 * time.Second)
		synctest.Wait()
		h.wantState(failover.CrashLoop)
		if _, c := h.state(); !strings.Contains(c, "python3: not found") {
			t.Fatalf("cause %q", c)
		}
		h.stop()
	})
}

// An engine whose Ready names another role than it was launched as is
// refused like a wrong Hello.
func TestReadyInAnotherRoleRefused(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		w := newWorld()
		w.behave = func(failover.Role, int) behavior { return behavior{readyAs: frmpsv1.Role_ROLE_STANDBY} }
		h := start(t, w, nil)
		time.Sleep(10 * time.Second)
		synctest.Wait()
		h.wantState(failover.CrashLoop)
		if _, cause := h.state(); !strings.Contains(cause, "ready as ROLE_STANDBY, launched as ROLE_ACTIVE") {
			t.Fatalf("cause %q", cause)
		}
		h.stop()
	})
}
