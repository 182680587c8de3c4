package supervisor

import (
	"context"
	"errors"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"testing/synctest"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
	"github.com/frmps/frmps/supervisor/failover"
)

type harness struct {
	t      *testing.T
	w      *fakeWorld
	s      *Supervisor
	reg    *prometheus.Registry
	runDir string
	cancel context.CancelFunc
	runErr chan error
	once   sync.Once
	err    error
}

func testConfig(t testing.TB) Config {
	return Config{
		Model: "tiny", Engine: "ref", SyncEvery: 16,
		RunDir: filepath.Join(t.TempDir(), "run"), RingDir: t.TempDir(),
		RingCapacity:     1 << 16,
		Breaker:          failover.BreakerConfig{MaxRestarts: 3, Window: time.Minute, BaseBackoff: 100 * time.Millisecond, MaxBackoff: time.Second},
		HandshakeTimeout: 5 * time.Second, ResumeTimeout: time.Second, ShutdownGrace: time.Second,
		BaseEnv: []string{"PATH=/usr/bin"},
	}
}

// start runs a supervisor on fakes; call inside a synctest bubble.
func start(t *testing.T, w *fakeWorld, mod func(*Config)) *harness {
	t.Helper()
	cfg := testConfig(t)
	if mod != nil {
		mod(&cfg)
	}
	reg := prometheus.NewRegistry()
	s, err := NewWithDeps(cfg, w.deps(), hclog.NewNullLogger(), reg)
	if err != nil {
		t.Fatal(err)
	}
	s.SetFrontDoor(w.front)
	ctx, cancel := context.WithCancel(context.Background())
	h := &harness{t: t, w: w, s: s, reg: reg, runDir: cfg.RunDir, cancel: cancel, runErr: make(chan error, 1)}
	go func() { h.runErr <- s.Run(ctx) }()
	// On a failed assertion, still end the bubble cleanly.
	t.Cleanup(func() { h.shutdown() })
	synctest.Wait()
	return h
}

func (h *harness) shutdown() error {
	h.once.Do(func() {
		h.cancel()
		h.err = <-h.runErr
	})
	return h.err
}

// stop shuts the deployment down and checks it left nothing behind.
func (h *harness) stop() {
	h.t.Helper()
	if err := h.shutdown(); err != nil {
		h.t.Fatalf("Run: %v", err)
	}
	if live := h.w.live(); len(live) != 0 {
		h.t.Fatalf("%d engines still alive after shutdown", len(live))
	}
	if _, err := os.Stat(h.runDir); !errors.Is(err, os.ErrNotExist) {
		h.t.Fatalf("run dir left behind: %v", err)
	}
	if h.w.ring != nil {
		if _, err := os.Stat(h.w.ring.path); !errors.Is(err, os.ErrNotExist) {
			h.t.Fatalf("ring file left behind: %v", err)
		}
		if !h.w.ring.closed {
			h.t.Fatal("ring reader not closed")
		}
	}
	h.w.mu.Lock()
	defer h.w.mu.Unlock()
	if len(h.w.listeners) != 0 {
		h.t.Fatalf("control sockets left open: %v", h.w.listeners)
	}
	for _, b := range h.w.broker {
		if !b.closed {
			h.t.Fatal("fd broker not closed")
		}
	}
}

// roles finds the fake processes the supervisor holds as active and standby.
func (h *harness) roles() (active, standby *fakeProc) {
	h.t.Helper()
	byPID := map[int32]*fakeProc{}
	h.w.mu.Lock()
	for _, p := range h.w.procs {
		byPID[int32(p.pid)] = p
	}
	h.w.mu.Unlock()
	for _, e := range h.s.Status().GetEngines() {
		switch e.GetRole() {
		case "active":
			active = byPID[e.GetPid()]
		case "standby":
			standby = byPID[e.GetPid()]
		}
	}
	if active == nil || standby == nil {
		h.t.Fatalf("engines %v", h.s.Status().GetEngines())
	}
	return active, standby
}

func (h *harness) state() (string, string) {
	st := h.s.Status()
	return st.GetState(), st.GetStateCause()
}

func (h *harness) wantState(want failover.State) {
	h.t.Helper()
	if got, cause := h.state(); got != want.String() {
		h.t.Fatalf("state %s (%s), want %s", got, cause, want)
	}
}

func (h *harness) current(minGen uint64) (*fakeGen, uint64) {
	h.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Millisecond)
	defer cancel()
	c, gen, err := h.s.Current(ctx, minGen)
	if err != nil {
		h.t.Fatalf("Current(%d): %v", minGen, err)
	}
	return c.(*fakeGen), gen
}

// histogram is the deployment's histogram of that name as gathered (nil when absent).
func (h *harness) histogram(name string) *dto.Histogram {
	h.t.Helper()
	mfs, err := h.reg.Gather()
	if err != nil {
		h.t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name {
			return mf.GetMetric()[0].GetHistogram()
		}
	}
	return nil
}

func TestStartupHandshakeAndServe(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		w := newWorld()
		h := start(t, w, nil)
		h.wantState(failover.ServingReady)
		act, sb := w.liveRole(failover.Active), w.liveRole(failover.Standby)
		if act == nil || sb == nil {
			t.Fatalf("active %v standby %v", act, sb)
		}
		// The active publishes to the ring; the standby is told nothing of it yet.
		if act.welcome.GetRingPath() != w.ring.path || act.welcome.GetSyncEvery() != 16 || sb.welcome.GetRingPath() != "" {
			t.Fatalf("welcomes: active %v standby %v", act.welcome, sb.welcome)
		}
		if len(sb.sleep.GetPools()) != 2 || !slices.Equal(sb.sleepFD, testFDs) {
			t.Fatalf("standby slept with %v fds %v", sb.sleep, sb.sleepFD)
		}
		if !slices.Contains(act.env, "CUDA_MPS_PIPE_DIRECTORY=/fake/mps/pipe") || slices.Contains(sb.env, "CUDA_MPS_PIPE_DIRECTORY=/fake/mps/pipe") ||
			!strings.Contains(strings.Join(sb.env, " "), "no-mps") || !slices.Contains(sb.env, "PATH=/usr/bin") {
			t.Fatalf("env: active %v standby %v", act.env, sb.env)
		}
		if fi, err := os.Stat(h.runDir); err != nil || fi.Mode().Perm() != 0o700 {
			t.Fatalf("run dir: %v %v", fi, err)
		}
		gen, g := h.current(1)
		if g != 1 || gen.endpoint != "unix://"+act.inv.GenerationSocket {
			t.Fatalf("current %v gen %d", gen.endpoint, g)
		}
		if name, maxLen := h.s.Model(); name != "tiny" || maxLen != 2048 {
			t.Fatalf("model %s %d: the limit was not learned from the engine", name, maxLen)
		}
		st := h.s.Status()
		if len(st.Engines) != 2 || st.Engines[0].GetState() != "serving" || st.Engines[1].GetState() != "ready" || !st.Engines[0].GetInMps() {
			t.Fatalf("engines %v", st.Engines)
		}
		if v := testutil.ToFloat64(h.s.metrics.engineUp.WithLabelValues("standby")); v != 1 {
			t.Fatalf("engine_up{standby} = %v", v)
		}
		h.stop()
		if !act.gotShut || !sb.gotShut {
			t.Fatal("engines were not asked to shut down")
		}
		if !w.mps.stopped {
			t.Fatal("MPS not stopped")
		}
	})
}

func TestBothDieThenRecover(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		w := newWorld()
		h := start(t, w, nil)
		// Kill the standby first, then the active before the new standby is ready.
		w.liveRole(failover.Standby).Kill()
		w.liveRole(failover.Active).Kill()
		synctest.Wait()
		h.wantState(failover.Starting) // waiting out the backoff
		time.Sleep(time.Second)
		synctest.Wait()
		h.wantState(failover.ServingReady)
		if len(w.live()) != 2 {
			t.Fatalf("%d live engines", len(w.live()))
		}
		h.stop()
	})
}

func TestStandbyCrashLoopDegrades(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		w := newWorld()
		w.behave = func(r failover.Role, n int) behavior { return behavior{exitOnStart: r == failover.Standby} }
		h := start(t, w, nil)
		time.Sleep(10 * time.Second)
		synctest.Wait()
		h.wantState(failover.ServingDegraded)
		st := h.s.Status()
		if !st.GetCrashLoopOpen() || !strings.Contains(st.GetStateCause(), "standby died 4 times") {
			t.Fatalf("status %v", st)
		}
		if w.launched[failover.Standby] != 4 {
			t.Fatalf("standby launched %d times", w.launched[failover.Standby])
		}
		if _, g := h.current(1); g != 1 { // the active still serves
			t.Fatal("active not serving")
		}
		if err := h.s.TriggerFailover(context.Background(), "drill"); err == nil {
			t.Fatal("drill accepted without a standby")
		}
		if v := testutil.ToFloat64(h.s.metrics.crashLoopG); v != 1 {
			t.Fatalf("crash_loop_open = %v", v)
		}
		h.stop()
	})
}

// Shutdown while engines are still starting: one not connected yet (killed
// at once), one connected but silent (asked, then killed after the grace).
func TestShutdownDuringStartup(t *testing.T) {
	for _, b := range []behavior{{noConnect: true}, {hang: true}} {
		synctest.Test(t, func(t *testing.T) {
			w := newWorld()
			w.behave = func(failover.Role, int) behavior { return b }
			h := start(t, w, nil)
			h.wantState(failover.Starting)
			t0 := time.Now()
			h.stop()
			ws := w.procs[0].WaitStatus()
			if !ws.Signaled() || ws.Signal() != syscall.SIGKILL {
				t.Fatalf("engine ended with %v", ws)
			}
			took := time.Since(t0)
			if b.noConnect && took != 0 || b.hang && took != testConfig(t).ShutdownGrace {
				t.Fatalf("shutdown took %s (virtual time)", took)
			}
		})
	}
}

func TestDrill(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		w := newWorld()
		h := start(t, w, nil)
		if err := h.s.TriggerFailover(context.Background(), "game day"); err != nil {
			t.Fatal(err)
		}
		synctest.Wait()
		h.wantState(failover.ServingReady)
		rec := h.s.Status().Failovers[0]
		if rec.GetCause() != "drill" || !rec.GetOk() {
			t.Fatalf("record %v", rec)
		}
		if v := testutil.ToFloat64(h.s.metrics.failovers.WithLabelValues("drill")); v != 1 {
			t.Fatalf("failovers{drill} %v", v)
		}
		h.stop()
	})
}

// A GPU whose compute mode leaves the standby no context of its own is
// refused before anything starts; the check sees CUDA_VISIBLE_DEVICES, and
// is skipped on the CPU.
func TestComputeModeCheck(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		w := newWorld()
		w.computeModeErr = errors.New("GPU 0 (GPU-aaaa) is in Exclusive_Process compute mode")
		cfg := testConfig(t)
		cfg.Device, cfg.Memory = "cuda", "cuda-vmm"
		cfg.BaseEnv = append(cfg.BaseEnv, "CUDA_VISIBLE_DEVICES=GPU-aaaa")
		s, err := NewWithDeps(cfg, w.deps(), hclog.NewNullLogger(), prometheus.NewRegistry())
		if err != nil {
			t.Fatal(err)
		}
		err = s.Run(context.Background())
		if err == nil || !strings.Contains(err.Error(), "check the GPU: GPU 0 (GPU-aaaa) is in Exclusive_Process") {
			t.Fatalf("Run: %v", err)
		}
		if !slices.Equal(w.computeModeChecks, []string{"GPU-aaaa"}) || w.launched != [2]int{} {
			t.Fatalf("checks %v, launched %v", w.computeModeChecks, w.launched)
		}
		if _, err := os.Stat(cfg.RunDir); !errors.Is(err, os.ErrNotExist) {
			t.Fatal("run dir left behind")
		}
		w.computeModeChecks = nil
		h := start(t, w, nil) // on the CPU
		h.wantState(failover.ServingReady)
		if len(w.computeModeChecks) != 0 {
			t.Fatalf("checked the compute mode for a CPU deployment: %v", w.computeModeChecks)
		}
		h.stop()
	})
}

func TestBadConfig(t *testing.T) {
	w := newWorld()
	for _, mod := range []func(*Config){
		func(c *Config) { c.Model = "" },
		func(c *Config) { c.Engine = "" }, // names themselves belong to the engine CLI (frmps serve checks them)
		func(c *Config) { c.Memory = "disk" },
		func(c *Config) { c.Device = "tpu" },
		func(c *Config) { c.RingCapacity = 10 },
		func(c *Config) { c.Breaker.MaxRestarts = -1 },
		func(c *Config) { c.TensorParallelSize = -1 },
	} {
		cfg := testConfig(t)
		mod(&cfg)
		if _, err := NewWithDeps(cfg, w.deps(), nil, nil); err == nil {
			t.Errorf("config %+v accepted", cfg)
		}
	}
	if _, err := NewWithDeps(testConfig(t), Deps{}, nil, nil); err == nil {
		t.Error("empty deps accepted")
	}
	// Both engines take tensor parallelism.
	tp := testConfig(t)
	tp.Engine, tp.TensorParallelSize = "vllm", 2
	if _, err := NewWithDeps(tp, w.deps(), nil, nil); err != nil {
		t.Errorf("vllm TP=2: %v", err)
	}
	cfg := testConfig(t)
	if err := os.MkdirAll(cfg.RunDir, 0o700); err != nil {
		t.Fatal(err)
	}
	s, err := NewWithDeps(cfg, w.deps(), nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Run(context.Background()); err == nil || !strings.Contains(err.Error(), "run dir") {
		t.Fatalf("existing run dir: %v", err)
	}
	if _, err := os.Stat(cfg.RunDir); err != nil {
		t.Fatal("a run dir we did not create was removed")
	}
}

// TestSoakSIGKILL: ≥ 200 cycles of killing engines at random points. Every
// cycle must end armed again (one active serving, one standby ready), with
// the generation advancing on every active death; at the end nothing is
// left (the bubble itself fails on leaked goroutines).
func TestSoakSIGKILL(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		w := newWorld()
		w.front.open = []*frmpsv1.ResumeRequest{{Key: 1}}
		h := start(t, w, func(c *Config) {
			c.Breaker = failover.BreakerConfig{MaxRestarts: 10000, Window: time.Second, BaseBackoff: time.Millisecond, MaxBackoff: 10 * time.Millisecond}
		})
		// An admin client reading status throughout, so the race detector
		// sees Status against every step of the loop.
		pollStop := make(chan struct{})
		pollDone := make(chan struct{})
		go func() {
			defer close(pollDone)
			for {
				select {
				case <-pollStop:
					return
				case <-time.After(time.Millisecond):
					_ = h.s.Status()
					_, _ = h.s.Model()
					_ = h.s.Serving()
				}
			}
		}()
		defer func() { close(pollStop); <-pollDone }()
		rng := rand.New(rand.NewPCG(1, 2))
		_, gen := h.current(1)
		failovers := 0
		for cycle := range 250 {
			h.wantState(failover.ServingReady)
			act, sb := h.roles()
			killActive := true
			switch rng.IntN(4) {
			case 0, 1: // the common case: the active dies, the standby takes over
				act.Kill()
				failovers++
			case 2: // the standby dies: re-arm
				sb.Kill()
				killActive = false
			case 3: // the active dies right after its standby did: cold start
				sb.Kill()
				act.Kill()
			}
			synctest.Wait()
			time.Sleep(50 * time.Millisecond) // past any backoff
			synctest.Wait()
			if st, c := h.state(); st != "serving_ready" {
				t.Fatalf("cycle %d: state %s (%s)", cycle, st, c)
			}
			if live := w.live(); len(live) != 2 {
				t.Fatalf("cycle %d: %d live engines", cycle, len(live))
			}
			_, g := h.current(gen)
			if killActive && (act.alive() || g <= gen) || !killActive && (!act.alive() || g != gen) {
				t.Fatalf("cycle %d (active killed: %v): old active alive=%v gen %d -> %d", cycle, killActive, act.alive(), gen, g)
			}
			gen = g
		}
		if len(h.s.pair.slots) > 2 {
			t.Fatalf("%d engine slots kept after the soak", len(h.s.pair.slots))
		}
		if v := testutil.ToFloat64(h.s.metrics.failovers.WithLabelValues("signal")); int(v) != failovers {
			t.Fatalf("failovers_total %v, want %d", v, failovers)
		}
		h.stop()
		for _, p := range w.procs {
			if p.alive() {
				t.Fatalf("engine %d alive", p.pid)
			}
			if ws := p.WaitStatus(); !ws.Signaled() && !(ws.Exited() && ws.ExitStatus() == 0) {
				t.Fatalf("engine %d ended with %v", p.pid, ws)
			}
		}
		_ = syscall.SIGKILL
	})
}

// Status shows what each engine said of itself: its Hello, its Ready and its
// latest Heartbeat.
func TestStatusShowsWhatEnginesSaid(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		w := newWorld()
		w.behave = func(r failover.Role, _ int) behavior {
			if r != failover.Active {
				return behavior{}
			}
			return behavior{beatEvery: 100 * time.Millisecond, heartbeat: func(n int) *frmpsv1.Heartbeat {
				return &frmpsv1.Heartbeat{Step: 40, Running: 3, Waiting: 5, IntervalMs: 100}
			}}
		}
		h := start(t, w, nil)
		time.Sleep(300 * time.Millisecond)
		synctest.Wait()
		engines := h.s.Status().GetEngines()
		if len(engines) != 2 {
			t.Fatalf("engines %v", engines)
		}
		for _, e := range engines {
			if e.GetEngine() != "fake 0.1" || e.GetDevice() != "cpu" || e.GetBlockSize() != 16 || e.GetNumBlocks() != 64 || e.GetInitSeconds() != 2 ||
				e.GetWeights() != "loaded:/models/fake" {
				t.Fatalf("%s: %v", e.GetRole(), e)
			}
			if e.GetRole() == "active" && (e.GetSteps() != 40 || e.GetRunning() != 3 || e.GetWaiting() != 5) {
				t.Fatalf("active's heartbeat not shown: %v", e)
			}
		}
		h.stop()
	})
}

// statusFrontDoor is a TEST DOUBLE of a front door that is a process of its
// own (--frontend vllm): it reports a fixed state.
type statusFrontDoor struct{ fakeFrontDoor }

func (*statusFrontDoor) FrontendStatus() *frmpsv1.FrontendStatus {
	return &frmpsv1.FrontendStatus{Kind: "vllm", Pid: 7, State: "serving", EngineLost: 2}
}

// Status carries the front door's own state where it has one, and nothing
// for frmps's built-in front door.
func TestStatusShowsTheFrontendProcess(t *testing.T) {
	w := newWorld()
	s, err := NewWithDeps(testConfig(t), w.deps(), hclog.NewNullLogger(), prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	s.SetFrontDoor(w.front)
	if fe := s.Status().GetFrontend(); fe != nil {
		t.Fatalf("built-in front door reported as a frontend process: %v", fe)
	}
	s.SetFrontDoor(&statusFrontDoor{})
	if fe := s.Status().GetFrontend(); fe.GetKind() != "vllm" || fe.GetPid() != 7 || fe.GetState() != "serving" || fe.GetEngineLost() != 2 {
		t.Fatalf("frontend status %v", fe)
	}
}
