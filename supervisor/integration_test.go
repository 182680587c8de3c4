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
	"os/exec"
	"path/filepath"
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

// realSupervisor runs a supervisor with its real collaborators over the
// fake engine binary; mod, if given, adjusts the config.
func realSupervisor(t testing.TB, bin string, env []string, breaker failover.BreakerConfig, mod ...func(*Config)) (*Supervisor, func()) {
	t.Helper()
	runDir, err := os.MkdirTemp("", "frmps-it-")
	if err != nil {
		t.Fatal(err)
	}
	os.Remove(runDir) // Run creates it
	cfg := Config{Model: "fake", Engine: "ref", NoMPS: true, RunDir: runDir, RingDir: t.TempDir(),
		HandshakeTimeout: 20 * time.Second, ResumeTimeout: 10 * time.Second, ShutdownGrace: 5 * time.Second,
		Breaker: breaker, BaseEnv: env}
	for _, f := range mod {
		f(&cfg)
	}
	log := hclog.New(&hclog.LoggerOptions{Level: hclog.Warn, Output: testWriter{t}})
	s, err := newFakeEngineSupervisor(cfg, bin, log)
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

// newFakeEngineSupervisor is New with the fake engine binary as the engine.
func newFakeEngineSupervisor(cfg Config, bin string, log hclog.Logger) (*Supervisor, error) {
	deps, err := defaultDeps(cfg, log)
	if err != nil {
		return nil, err
	}
	deps.Launcher = ProcessLauncher{Adapter: fakeEngineAdapter{bin: bin}, Log: log}
	return NewWithDeps(cfg, deps, log, prometheus.NewRegistry())
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

// socketFiles lists the unix socket files in dir.
func socketFiles(t testing.TB, dir string) []string {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range ents {
		if e.Type()&os.ModeSocket != 0 {
			out = append(out, e.Name())
		}
	}
	return out
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
		// Reaped, not left a zombie. The failover record is written at the
		// resume ack, which may come before the launcher's Wait returns.
		waitFor(t, s, fmt.Sprintf("cycle %d: killed active %d reaped", i, pid), func() bool { return syscall.Kill(int(pid), 0) == syscall.ESRCH })
	}
	// A dead engine's socket files go when it is reaped: those of the two
	// live engines (control and generation each) are all that is left.
	waitFor(t, s, "the dead engines' sockets removed", func() bool { return len(socketFiles(t, s.runDir)) == 4 })
	lat := s.failovers.detectToResumeSeen()
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

// TestRealSharedMPS joins an MPS daemon an operator started (the labelled
// fake control program of package mps): the active runs with its pipe
// directory, the standby outside it, and frmps leaves the daemon as it found
// it after a failover and a shutdown.
func TestRealSharedMPS(t *testing.T) {
	bin := buildFakeEngine(t)
	ctl, err := filepath.Abs("mps/testdata/nvidia-cuda-mps-control")
	if err != nil {
		t.Fatal(err)
	}
	base := t.TempDir()
	pipeDir, logDir := filepath.Join(base, "pipe"), filepath.Join(base, "log")
	operator := func(arg, stdin string) {
		cmd := exec.Command(ctl)
		if arg != "" {
			cmd.Args = append(cmd.Args, arg)
		}
		cmd.Env = append(os.Environ(), "FAKE_MPS_MODE=ok", "CUDA_MPS_PIPE_DIRECTORY="+pipeDir, "CUDA_MPS_LOG_DIRECTORY="+logDir)
		cmd.Stdin = strings.NewReader(stdin)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Errorf("operator %s: %v: %s", arg, err, out)
		}
	}
	for _, d := range []string{pipeDir, logDir} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	operator("-d", "")
	t.Cleanup(func() { operator("", "quit\n") })
	daemonPID := func() string {
		b, _ := os.ReadFile(filepath.Join(pipeDir, "nvidia-cuda-mps-control.pid"))
		return strings.TrimSpace(string(b))
	}
	pid := daemonPID()
	s, stop := realSupervisor(t, bin, []string{"FAKEENGINE_BEHAVIOR=normal"},
		failover.BreakerConfig{MaxRestarts: 10, Window: time.Minute, BaseBackoff: time.Millisecond, MaxBackoff: 10 * time.Millisecond},
		func(c *Config) { c.NoMPS, c.MPSPipeDir, c.MPSControlBinary = false, pipeDir, ctl })
	waitFor(t, s, "serving_ready", func() bool { return s.Status().GetState() == "serving_ready" })
	if st := s.Status().GetMpsState(); st != "joined the operator's daemon at "+pipeDir {
		t.Fatalf("mps state %q", st)
	}
	pids := map[string]int{}
	for _, e := range s.Status().GetEngines() {
		pids[e.GetRole()] = int(e.GetPid())
	}
	environ := func(pid int) string {
		b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/environ")
		if err != nil {
			t.Fatal(err)
		}
		return strings.ReplaceAll(string(b), "\x00", "\n")
	}
	if env := environ(pids["active"]); !strings.Contains(env, "CUDA_MPS_PIPE_DIRECTORY="+pipeDir+"\n") {
		t.Fatalf("the active is not in the operator's daemon: %s", env)
	}
	if env := environ(pids["standby"]); strings.Contains(env, "CUDA_MPS_PIPE_DIRECTORY="+pipeDir+"\n") || !strings.Contains(env, "mps-outside") {
		t.Fatalf("the standby is not outside MPS: %s", env)
	}
	if err := syscall.Kill(pids["active"], syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	waitFor(t, s, "failover", func() bool {
		st := s.Status()
		return st.GetState() == "serving_ready" && len(st.GetFailovers()) == 1 && strings.HasPrefix(st.GetMpsState(), "joined")
	})
	stop()
	starts, _ := os.ReadFile(filepath.Join(logDir, "fake-starts"))
	if daemonPID() != pid || strings.Count(string(starts), "start") != 1 {
		t.Fatalf("frmps touched the operator's daemon: pid %s, was %s; starts %q", daemonPID(), pid, starts)
	}
	if n, _ := strconv.Atoi(pid); n <= 0 || syscall.Kill(n, 0) != nil {
		t.Fatalf("the operator's daemon %s is gone", pid)
	}
}
