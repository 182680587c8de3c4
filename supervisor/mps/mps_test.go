package mps

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// fakeControl is the test double in testdata (a shell script standing in
// for nvidia-cuda-mps-control).
func fakeControl(t *testing.T, mode string) Config {
	t.Helper()
	bin, err := filepath.Abs("testdata/nvidia-cuda-mps-control")
	if err != nil {
		t.Fatal(err)
	}
	t.Setenv("FAKE_MPS_MODE", mode)
	runDir := t.TempDir()
	t.Cleanup(func() { checkNoProcessesIn(t, runDir) })
	return Config{ControlBinary: bin, RunDir: runDir, StartTimeout: 5 * time.Second}
}

// checkNoProcessesIn fails if a live process still has an environment
// pointing into runDir: a daemon or a control command we leaked.
func checkNoProcessesIn(t *testing.T, runDir string) {
	t.Helper()
	// A process killed a moment ago may still be exiting.
	for deadline := time.Now().Add(3 * time.Second); time.Now().Before(deadline); {
		if len(processesIn(runDir)) == 0 {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	for _, p := range processesIn(runDir) {
		t.Errorf("leaked process %s", p)
	}
}

func processesIn(runDir string) []string {
	var leaked []string
	ents, _ := os.ReadDir("/proc")
	self := []byte("CUDA_MPS_PIPE_DIRECTORY=" + runDir)
	for _, e := range ents {
		pid := e.Name()
		env, err := os.ReadFile("/proc/" + pid + "/environ")
		if err != nil || !bytes.Contains(env, self) {
			continue
		}
		stat, _ := os.ReadFile("/proc/" + pid + "/stat")
		if i := bytes.LastIndexByte(stat, ')'); i >= 0 && i+2 < len(stat) && stat[i+2] == 'Z' {
			continue
		}
		cmdline, _ := os.ReadFile("/proc/" + pid + "/cmdline")
		leaked = append(leaked, fmt.Sprintf("%s: %q", pid, bytes.ReplaceAll(cmdline, []byte{0}, []byte{' '})))
	}
	return leaked
}

func starts(t *testing.T, d *Daemon) int {
	b, _ := os.ReadFile(filepath.Join(d.logDir, "fake-starts"))
	return strings.Count(string(b), "start")
}

func openFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents) - 1
}

func TestStartCheckStop(t *testing.T) {
	cfg := fakeControl(t, "ok")
	ctx := context.Background()
	fdsBefore := openFDs(t)
	d, err := Start(ctx, cfg, hclog.NewNullLogger())
	if err != nil {
		t.Fatalf("Start: %v", err)
	}
	for _, dir := range []string{filepath.Join(cfg.RunDir, "mps"), d.pipeDir, d.logDir} {
		fi, err := os.Stat(dir)
		if err != nil || fi.Mode().Perm() != 0o700 {
			t.Fatalf("%s: %v mode %v", dir, err, fi.Mode())
		}
	}
	want := []string{
		"CUDA_MPS_PIPE_DIRECTORY=" + filepath.Join(cfg.RunDir, "mps", "pipe"),
		"CUDA_MPS_LOG_DIRECTORY=" + filepath.Join(cfg.RunDir, "mps", "log"),
	}
	if got := d.ClientEnv(); !slices.Equal(got, want) {
		t.Fatalf("ClientEnv %v, want %v", got, want)
	}
	pid := d.daemonPID()
	if pid <= 0 || !alive(pid) {
		t.Fatalf("daemon pid %d not running", pid)
	}
	if err := d.Check(ctx); err != nil {
		t.Fatalf("Check: %v", err)
	}
	if err := d.Stop(ctx); err != nil {
		t.Fatalf("Stop: %v", err)
	}
	if alive(pid) {
		t.Fatalf("daemon %d alive after Stop", pid)
	}
	if err := d.Check(ctx); !errors.Is(err, ErrNotAnswering) {
		t.Fatalf("Check after Stop: %v", err)
	}
	if err := d.Stop(ctx); err != nil {
		t.Fatalf("second Stop: %v", err)
	}
	if after := openFDs(t); after != fdsBefore {
		t.Fatalf("fd leak: %d before, %d after", fdsBefore, after)
	}
}

func TestRestart(t *testing.T) {
	cfg := fakeControl(t, "ok")
	ctx := context.Background()
	d, err := Start(ctx, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Stop(ctx)
	old := d.daemonPID()
	if err := d.Restart(ctx); err != nil {
		t.Fatalf("Restart: %v", err)
	}
	if alive(old) || d.daemonPID() == old || !alive(d.daemonPID()) {
		t.Fatalf("restart kept the old daemon %d (new %d)", old, d.daemonPID())
	}
	if err := d.Check(ctx); err != nil {
		t.Fatalf("Check after Restart: %v", err)
	}
	if n := starts(t, d); n != 2 {
		t.Fatalf("%d starts, want 2", n)
	}
	// Restart after Stop starts it again.
	if err := d.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if err := d.Restart(ctx); err != nil {
		t.Fatalf("Restart after Stop: %v", err)
	}
	if err := d.Stop(ctx); err != nil {
		t.Fatal(err)
	}
}

func TestStartFailures(t *testing.T) {
	cases := []struct {
		name    string
		mode    string
		binary  string
		timeout time.Duration
		is      error
		say     string
	}{
		{"binary missing (path)", "ok", "/nonexistent/nvidia-cuda-mps-control", 0, ErrBinaryMissing, "/nonexistent/nvidia-cuda-mps-control"},
		{"binary missing (PATH)", "ok", "nvidia-cuda-mps-control-not-installed", 0, ErrBinaryMissing, "not found"},
		{"daemon fails to start", "fail-start", "", 0, ErrStartFailed, "An instance of this daemon is already running"},
		{"daemon start hangs", "hang-start", "", 300 * time.Millisecond, ErrStartFailed, "did not return within 300ms"},
		{"daemon does not answer", "no-answer", "", 2 * time.Second, ErrNotAnswering, "got no answer"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cfg := fakeControl(t, tc.mode)
			if tc.binary != "" {
				cfg.ControlBinary = tc.binary
			}
			if tc.timeout != 0 {
				cfg.StartTimeout = tc.timeout
			}
			began := time.Now()
			d, err := Start(context.Background(), cfg, nil)
			if err == nil {
				d.Stop(context.Background())
				t.Fatal("Start succeeded")
			}
			if took := time.Since(began); took > cfg.StartTimeout+3*time.Second {
				t.Errorf("Start took %s with a %s timeout", took, cfg.StartTimeout)
			}
			if !errors.Is(err, tc.is) || !strings.Contains(err.Error(), tc.say) {
				t.Fatalf("error %q: want %v saying %q", err, tc.is, tc.say)
			}
			// checkNoProcessesIn (cleanup) verifies the hung command and
			// the unresponsive daemon were killed.
		})
	}
}

func TestStopKillsDaemonIgnoringQuit(t *testing.T) {
	cfg := fakeControl(t, "ignore-quit")
	cfg.StartTimeout = 3 * time.Second
	d, err := Start(context.Background(), cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	pid := d.daemonPID()
	if err := d.Stop(context.Background()); err != nil {
		t.Fatalf("Stop: %v", err)
	}
	if alive(pid) {
		t.Fatalf("daemon %d survived Stop", pid)
	}
}

func TestStartStopsStaleDaemon(t *testing.T) {
	cfg := fakeControl(t, "ok")
	ctx := context.Background()
	first, err := Start(ctx, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	stale := first.daemonPID()
	// A new supervisor on the same run directory (the first one "died").
	second, err := Start(ctx, cfg, nil)
	if err != nil {
		t.Fatalf("Start over a stale daemon: %v", err)
	}
	defer second.Stop(ctx)
	if alive(stale) {
		t.Fatalf("stale daemon %d still running", stale)
	}
	if second.daemonPID() == stale || second.Check(ctx) != nil {
		t.Fatal("second daemon not running")
	}
}

func TestStopLeftover(t *testing.T) {
	cfg := fakeControl(t, "ok")
	ctx := context.Background()
	if err := StopLeftover(ctx, cfg, nil); err != nil {
		t.Fatalf("no daemon ever started: %v", err)
	}
	if _, err := os.Stat(filepath.Join(cfg.RunDir, "mps")); !os.IsNotExist(err) {
		t.Fatalf("StopLeftover created directories: %v", err)
	}
	left, err := Start(ctx, cfg, nil) // its supervisor "died" without Stop
	if err != nil {
		t.Fatal(err)
	}
	pid := left.daemonPID()
	if err := StopLeftover(ctx, cfg, nil); err != nil {
		t.Fatal(err)
	}
	if alive(pid) {
		t.Fatalf("leftover daemon %d still running", pid)
	}
	if err := StopLeftover(ctx, cfg, nil); err != nil {
		t.Fatalf("a daemon that already quit: %v", err)
	}
	cfg.ControlBinary = "no-such-mps-control"
	if err := StopLeftover(ctx, cfg, nil); err != nil {
		t.Fatalf("a daemon that quit, binary gone: %v", err)
	}
}

func TestStartHonoursContext(t *testing.T) {
	cfg := fakeControl(t, "hang-start")
	cfg.StartTimeout = time.Minute
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	began := time.Now()
	if _, err := Start(ctx, cfg, nil); !errors.Is(err, ErrStartFailed) {
		t.Fatalf("Start: %v", err)
	}
	if took := time.Since(began); took > 5*time.Second {
		t.Fatalf("Start ignored its context: %s", took)
	}
}

func TestOutsideEnv(t *testing.T) {
	runDir := t.TempDir()
	env, err := OutsideEnv(runDir)
	if err != nil {
		t.Fatal(err)
	}
	pipe := filepath.Join(runDir, "mps-outside", "pipe")
	want := []string{"CUDA_MPS_PIPE_DIRECTORY=" + pipe, "CUDA_MPS_LOG_DIRECTORY=" + filepath.Join(runDir, "mps-outside", "log")}
	if !slices.Equal(env, want) {
		t.Fatalf("OutsideEnv %v, want %v", env, want)
	}
	fi, err := os.Stat(pipe)
	if err != nil || fi.Mode().Perm() != 0o700 {
		t.Fatalf("pipe dir: %v %v", err, fi.Mode())
	}
	entries, _ := os.ReadDir(pipe)
	if len(entries) != 0 {
		t.Fatalf("outside pipe dir not empty: %v", entries)
	}
	// Idempotent, and tightens a loosened directory.
	os.Chmod(pipe, 0o755)
	if _, err := OutsideEnv(runDir); err != nil {
		t.Fatal(err)
	}
	if fi, _ := os.Stat(pipe); fi.Mode().Perm() != 0o700 {
		t.Fatalf("mode %v not restored", fi.Mode())
	}
	// A daemon's control pipe there would put the standby inside MPS.
	os.WriteFile(filepath.Join(pipe, "control"), nil, 0o600)
	if _, err := OutsideEnv(runDir); err == nil {
		t.Fatal("OutsideEnv accepted a pipe dir with a control pipe")
	}
	if _, err := OutsideEnv(""); err == nil {
		t.Fatal("OutsideEnv accepted an empty run dir")
	}
}
