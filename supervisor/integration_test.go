package supervisor

// End-to-end tests against real processes: the supervisor with its real
// collaborators (control sockets with SO_PEERCRED and SCM_RIGHTS, the ring,
// the fd broker, the process launcher) driving the fake engine binary (a
// TEST DOUBLE that speaks the real control protocol, package
// internal/fakeengine) instead of a Python engine. No MPS.

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/goleak"

	"github.com/frmps/frmps/supervisor/engine"
	"github.com/frmps/frmps/supervisor/failover"
	"github.com/frmps/frmps/supervisor/internal/fakeengine"
)

// fakeEngineAdapter launches the fake engine with the real engine CLI's
// arguments (it accepts and ignores the ones it does not use).
type fakeEngineAdapter struct{ bin string }

func (a fakeEngineAdapter) Name() string { return "fake" }

func (a fakeEngineAdapter) Command(inv engine.Invocation) (string, []string, error) {
	_, args, err := engine.PythonCLI{Engine: "ref"}.Command(inv)
	if err != nil {
		return "", nil, err
	}
	return a.bin, args[2:], nil // drop "-m frmps_engine.cli"
}

func realSupervisor(t testing.TB, bin string, env []string, breaker failover.BreakerConfig) (*Supervisor, func()) {
	t.Helper()
	runDir, err := os.MkdirTemp("", "frmps-it-")
	if err != nil {
		t.Fatal(err)
	}
	os.Remove(runDir) // Run creates it
	cfg := Config{Model: "fake", Engine: "ref", NoMPS: true, RunDir: runDir, RingDir: t.TempDir(),
		HandshakeTimeout: 20 * time.Second, ResumeTimeout: 10 * time.Second, ShutdownGrace: 5 * time.Second,
		Breaker: breaker, BaseEnv: env}
	log := hclog.New(&hclog.LoggerOptions{Level: hclog.Warn, Output: testWriter{t}})
	deps, err := defaultDeps(cfg, log)
	if err != nil {
		t.Fatal(err)
	}
	deps.Launcher = ProcessLauncher{Adapter: fakeEngineAdapter{bin: bin}, Log: log}
	s, err := NewWithDeps(cfg, deps, log, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	var once sync.Once
	stop := func() {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("Run: %v", err)
			}
			if _, err := os.Stat(runDir); err == nil {
				t.Errorf("run dir %s left behind", runDir)
			}
		})
	}
	t.Cleanup(stop) // also after a failed assertion
	return s, stop
}

type testWriter struct{ t testing.TB }

func (w testWriter) Write(p []byte) (int, error) { w.t.Log(string(p)); return len(p), nil }

// waitFor polls the supervisor's status (real processes: there is no event
// to wait on from outside); the deadline is a safety net, not a timing test.
func waitFor(t testing.TB, s *Supervisor, what string, ok func() bool) {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); !ok(); {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s; status %v", what, s.Status())
		}
		time.Sleep(time.Millisecond)
	}
}

func buildFakeEngine(t testing.TB) string {
	t.Helper()
	bin, err := fakeengine.BuildBinary(context.Background(), t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	return bin
}

func fdCount(t testing.TB) int {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

// TestRealSIGKILLSoak: ≥ 200 SIGKILLs of the active real process; every
// cycle fails over and re-arms; no fds, goroutines or children leak. It also
// prints the detection-to-resume-command latency.
func TestRealSIGKILLSoak(t *testing.T) {
	cycles := 200
	if testing.Short() {
		cycles = 20
	}
	if v, err := strconv.Atoi(os.Getenv("FRMPS_SOAK_CYCLES")); err == nil {
		cycles = v
	}
	bin := buildFakeEngine(t)
	fds := fdCount(t)
	t.Cleanup(func() {
		goleak.VerifyNone(t)
		if after := fdCount(t); after != fds {
			t.Errorf("fd leak: %d before, %d after", fds, after)
		}
	}) // runs after the supervisor's stop (cleanups run last-in first-out)
	s, stop := realSupervisor(t, bin, []string{"FAKEENGINE_BEHAVIOR=normal"},
		failover.BreakerConfig{MaxRestarts: 100000, Window: time.Second, BaseBackoff: time.Millisecond, MaxBackoff: 10 * time.Millisecond})
	ready := func() bool { return s.Status().GetState() == "serving_ready" }
	waitFor(t, s, "serving_ready", ready)
	for i := range cycles {
		var pid int32
		for _, e := range s.Status().GetEngines() {
			if e.GetRole() == "active" {
				pid = e.GetPid()
			}
		}
		if pid <= 0 {
			t.Fatalf("cycle %d: no active pid", i)
		}
		n := len(s.Status().GetFailovers())
		if err := syscall.Kill(int(pid), syscall.SIGKILL); err != nil {
			t.Fatalf("cycle %d: kill %d: %v", i, pid, err)
		}
		waitFor(t, s, "failover", func() bool {
			st := s.Status()
			return st.GetState() == "serving_ready" && (len(st.GetFailovers()) > n || n == 32 && st.GetFailovers()[0].GetSeq() > uint64(i))
		})
		if rec := s.Status().GetFailovers()[0]; !rec.GetOk() {
			t.Fatalf("cycle %d: failover failed: %v", i, rec)
		}
		// Reaping runs on the launcher's goroutine and may trail the
		// re-arm on a loaded machine; a process never reaped fails here.
		waitFor(t, s, fmt.Sprintf("killed active %d reaped (cycle %d)", pid, i), func() bool {
			return syscall.Kill(int(pid), 0) == syscall.ESRCH
		})
	}
	s.mu.Lock()
	lat := slices.Clone(s.detectToResume)
	s.mu.Unlock()
	slices.Sort(lat)
	if len(lat) > 0 {
		t.Logf("detection → resume sent over %d SIGKILL failovers: p50 %s p99 %s max %s",
			len(lat), lat[len(lat)/2], lat[len(lat)*99/100], lat[len(lat)-1])
	}
	stop()
}

// TestRealWrongVersionCrashLoop: a refused engine ends in crash_loop with the
// reason visible in status.
func TestRealWrongVersionCrashLoop(t *testing.T) {
	bin := buildFakeEngine(t)
	t.Cleanup(func() { goleak.VerifyNone(t) })
	s, stop := realSupervisor(t, bin, []string{"FAKEENGINE_BEHAVIOR=wrong-version"},
		failover.BreakerConfig{MaxRestarts: 3, Window: time.Minute, BaseBackoff: 10 * time.Millisecond, MaxBackoff: 100 * time.Millisecond})
	waitFor(t, s, "crash_loop", func() bool { return s.Status().GetState() == "crash_loop" })
	if c := s.Status().GetStateCause(); !strings.Contains(c, "protocol version") {
		t.Fatalf("cause %q", c)
	}
	stop()
}
