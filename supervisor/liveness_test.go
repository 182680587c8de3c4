package supervisor

import (
	"context"
	"io"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
	"github.com/frmps/frmps/supervisor/engine"
	"github.com/frmps/frmps/supervisor/failover"
)

// startWithDeps is start with collaborators the test has wrapped.
func startWithDeps(t *testing.T, w *fakeWorld, deps Deps, prep func(*Supervisor)) *harness {
	t.Helper()
	cfg := testConfig(t)
	reg := prometheus.NewRegistry()
	s, err := NewWithDeps(cfg, deps, hclog.NewNullLogger(), reg)
	if err != nil {
		t.Fatal(err)
	}
	s.SetFrontDoor(w.front)
	if prep != nil {
		prep(s)
	}
	ctx, cancel := context.WithCancel(context.Background())
	h := &harness{t: t, w: w, s: s, reg: reg, runDir: cfg.RunDir, cancel: cancel, runErr: make(chan error, 1)}
	go func() { h.runErr <- s.Run(ctx) }()
	t.Cleanup(func() { h.shutdown() })
	synctest.Wait()
	return h
}

// countingWatchdog is a TEST DOUBLE of the systemd notifier: it counts feeds.
type countingWatchdog struct{ n atomic.Int64 }

func (c *countingWatchdog) Feed() { c.n.Add(1) }

// gatedLauncher wraps the fake launcher; once armed, a launch blocks until
// the gate opens, which wedges the event loop that calls it.
type gatedLauncher struct {
	Launcher
	armed atomic.Bool
	gate  chan struct{}
}

func (g *gatedLauncher) Launch(role failover.Role, inv engine.Invocation, env []string, logPath string) (Process, error) {
	if g.armed.Load() {
		<-g.gate
	}
	return g.Launcher.Launch(role, inv, env, logPath)
}

func alive(s *Supervisor) error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	return s.Alive(ctx)
}

// The loop feeds the watchdog and answers Alive while it runs; wedged inside
// an action it does neither, and both come back when it is released.
func TestWatchdogAndAliveFollowTheLoop(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		w := newWorld()
		deps := w.deps()
		gl := &gatedLauncher{Launcher: w, gate: make(chan struct{})}
		deps.Launcher = gl
		wd := &countingWatchdog{}
		const every = 2 * time.Second
		h := startWithDeps(t, w, deps, func(s *Supervisor) { s.SetWatchdog(wd, every) })
		h.wantState(failover.ServingReady)
		before := wd.n.Load()
		time.Sleep(5 * every)
		if fed := wd.n.Load() - before; fed < 4 || fed > 6 {
			t.Fatalf("fed %d times in 5 intervals", fed)
		}
		if err := alive(h.s); err != nil {
			t.Fatalf("Alive while running: %v", err)
		}

		gl.armed.Store(true)
		if err := h.s.TriggerFailover(context.Background(), "wedge the loop"); err != nil {
			t.Fatal(err)
		}
		synctest.Wait() // the loop now waits inside Launch of the fresh standby
		wedged := wd.n.Load()
		time.Sleep(10 * every)
		if got := wd.n.Load(); got != wedged {
			t.Fatalf("a wedged loop fed the watchdog %d times", got-wedged)
		}
		if err := alive(h.s); err == nil {
			t.Fatal("Alive answered while the loop was wedged")
		}

		close(gl.gate)
		synctest.Wait()
		time.Sleep(2 * every)
		if wd.n.Load() == wedged {
			t.Fatal("the watchdog was not fed after the loop came back")
		}
		if err := alive(h.s); err != nil {
			t.Fatalf("Alive after the loop came back: %v", err)
		}
		h.wantState(failover.ServingReady)
		h.stop()
		if err := alive(h.s); err == nil {
			t.Fatal("Alive answered after Run returned")
		}
	})
}

// gatedGen is a TEST DOUBLE of an engine's generation API whose Health
// answers only when the gate opens.
type gatedGen struct {
	frmpsv1.GenerationClient
	gate  chan struct{}
	calls *atomic.Int64
}

func (g gatedGen) Health(ctx context.Context, _ *frmpsv1.HealthRequest, _ ...grpc.CallOption) (*frmpsv1.HealthResponse, error) {
	g.calls.Add(1)
	select {
	case <-g.gate:
		return &frmpsv1.HealthResponse{Serving: true, Model: "tiny", MaxModelLen: 4096}, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// The context limit is known before the first engine is published, so
// nothing is ever served while Model says 0.
func TestModelLimitKnownBeforeServing(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		w := newWorld()
		deps := w.deps()
		gate, calls := make(chan struct{}), &atomic.Int64{}
		deps.DialGeneration = func(endpoint string) (frmpsv1.GenerationClient, io.Closer, error) {
			return gatedGen{GenerationClient: &fakeGen{endpoint: endpoint}, gate: gate, calls: calls}, nopCloser{}, nil
		}
		h := startWithDeps(t, w, deps, nil)
		if _, limit := h.s.Model(); h.s.Serving() || limit != 0 {
			t.Fatalf("serving=%v with limit %d before the engine reported its limit", h.s.Serving(), limit)
		}
		close(gate)
		synctest.Wait()
		if _, limit := h.s.Model(); !h.s.Serving() || limit != 4096 {
			t.Fatalf("serving=%v limit %d, want serving with 4096", h.s.Serving(), limit)
		}
		if n := calls.Load(); n != 1 {
			t.Fatalf("engine asked %d times for its limit", n)
		}
		h.stop()
	})
}

// The time to the first resumed token is a metric as well as a record field.
func TestFirstResumedTokenMetric(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		w := newWorld()
		w.front.open = []*frmpsv1.ResumeRequest{{Key: 7, Prompt: "a", DeliveredTokenIds: []uint32{1}}}
		// No handover after the failover: its generation would take the token.
		h := start(t, w, func(c *Config) { c.NoFailback = true })
		w.liveRole(failover.Active).Kill()
		synctest.Wait()
		_, gen := h.current(2)
		time.Sleep(30 * time.Millisecond)
		h.s.NoteResumedToken(gen, time.Now())
		h.s.NoteResumedToken(gen, time.Now()) // the first token only
		hist := h.histogram("frmps_failover_first_token_seconds")
		if hist.GetSampleCount() != 1 || hist.GetSampleSum() < 0.03 || hist.GetSampleSum() > 0.031 {
			t.Fatalf("frmps_failover_first_token_seconds: %v", hist)
		}
		if got := h.s.Status().Failovers[0].GetFirstTokenSeconds(); got < 0.03 || got > 0.031 {
			t.Fatalf("record first_token_seconds %v", got)
		}
		h.stop()
	})
}

// noteDuringLaunch calls NoteResumedToken for the newest generation from
// inside the launch of the fresh standby, which the loop runs after it has
// published the promoted engine and before it has written the failover
// record: a client may get its first resumed token that early.
type noteDuringLaunch struct {
	Launcher
	s     *Supervisor
	after time.Duration
}

func (n *noteDuringLaunch) Launch(role failover.Role, inv engine.Invocation, env []string, logPath string) (Process, error) {
	if role == failover.Standby && n.s != nil {
		if _, gen, err := n.s.Current(context.Background(), 2); err == nil {
			time.Sleep(n.after)
			n.s.NoteResumedToken(gen, time.Now())
		}
	}
	return n.Launcher.Launch(role, inv, env, logPath)
}

func TestFirstResumedTokenBeforeTheRecord(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		w := newWorld()
		w.front.open = []*frmpsv1.ResumeRequest{{Key: 7, Prompt: "a", DeliveredTokenIds: []uint32{1}}}
		deps := w.deps()
		nl := &noteDuringLaunch{Launcher: w, after: 20 * time.Millisecond}
		deps.Launcher = nl
		h := startWithDeps(t, w, deps, nil)
		nl.s = h.s
		w.liveRole(failover.Active).Kill()
		time.Sleep(time.Second)
		synctest.Wait()
		h.wantState(failover.ServingReady)
		if got := h.s.Status().Failovers[0].GetFirstTokenSeconds(); got < 0.02 || got > 0.021 {
			t.Fatalf("first_token_seconds %v, want the 20ms the token took", got)
		}
		h.stop()
	})
}
