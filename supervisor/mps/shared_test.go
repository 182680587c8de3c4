package mps

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

// operatorDaemon starts the fake control daemon the way an operator would,
// outside frmps, and returns its pipe and log directories. It is quit at the
// end of the test.
func operatorDaemon(t *testing.T) (pipeDir, logDir string, bin string) {
	t.Helper()
	bin, err := filepath.Abs("testdata/nvidia-cuda-mps-control")
	if err != nil {
		t.Fatal(err)
	}
	t.Setenv("FAKE_MPS_MODE", "ok")
	base := t.TempDir()
	pipeDir, logDir = filepath.Join(base, "pipe"), filepath.Join(base, "log")
	for _, d := range []string{pipeDir, logDir} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	operator(t, bin, pipeDir, logDir, "-d", "")
	t.Cleanup(func() {
		operator(t, bin, pipeDir, logDir, "", "quit")
		checkNoProcessesIn(t, base)
	})
	return pipeDir, logDir, bin
}

// operator runs one control command as the operator would.
func operator(t *testing.T, bin, pipeDir, logDir, arg, stdin string) {
	t.Helper()
	var cmd *exec.Cmd
	if arg != "" {
		cmd = exec.Command(bin, arg)
	} else {
		cmd = exec.Command(bin)
	}
	cmd.Env = append(os.Environ(), "CUDA_MPS_PIPE_DIRECTORY="+pipeDir, "CUDA_MPS_LOG_DIRECTORY="+logDir)
	cmd.Stdin = strings.NewReader(stdin + "\n")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Logf("operator %s %q: %v: %s", arg, stdin, err, out)
	}
}

func pidOf(t *testing.T, pipeDir string) int {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(pipeDir, pidFile))
	if err != nil {
		return 0
	}
	pid, _ := strconv.Atoi(strings.TrimSpace(string(b)))
	return pid
}

func fakeStarts(t *testing.T, logDir string) int {
	b, _ := os.ReadFile(filepath.Join(logDir, "fake-starts"))
	return strings.Count(string(b), "start")
}

func TestJoinLeavesTheOperatorsDaemonAlone(t *testing.T) {
	pipeDir, logDir, bin := operatorDaemon(t)
	pid := pidOf(t, pipeDir)
	ctx := context.Background()
	fdsBefore := openFDs(t)
	s, err := Join(ctx, SharedConfig{ControlBinary: bin, PipeDir: pipeDir, LogDir: logDir}, nil)
	if err != nil {
		t.Fatalf("Join: %v", err)
	}
	if s.Owned() {
		t.Fatal("a joined daemon claims to be frmps's own")
	}
	want := []string{"CUDA_MPS_PIPE_DIRECTORY=" + pipeDir, "CUDA_MPS_LOG_DIRECTORY=" + logDir}
	if got := s.ClientEnv(); !slices.Equal(got, want) {
		t.Fatalf("ClientEnv %v, want %v", got, want)
	}
	if err := s.Check(ctx); err != nil {
		t.Fatalf("Check: %v", err)
	}
	if err := s.Recover(ctx); err != nil {
		t.Fatalf("Recover of a healthy daemon: %v", err)
	}
	if err := s.Stop(ctx); err != nil {
		t.Fatalf("Stop: %v", err)
	}
	if !alive(pid) || pidOf(t, pipeDir) != pid || fakeStarts(t, logDir) != 1 {
		t.Fatalf("the operator's daemon was touched: pid %d alive %v, pid file %d, %d starts", pid, alive(pid), pidOf(t, pipeDir), fakeStarts(t, logDir))
	}
	if err := s.Check(ctx); err != nil {
		t.Fatalf("Check after Stop: %v", err)
	}
	if after := openFDs(t); after != fdsBefore {
		t.Fatalf("fd leak: %d before, %d after", fdsBefore, after)
	}
	// Without a log directory the active gets the pipe directory only.
	s2, err := Join(ctx, SharedConfig{ControlBinary: bin, PipeDir: pipeDir}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if got := s2.ClientEnv(); !slices.Equal(got, want[:1]) {
		t.Fatalf("ClientEnv %v", got)
	}
}

// After a fault the daemon may not answer for a while: Recover waits for it
// (here the operator restarts it) and never starts one itself; a daemon that
// stays away is reported once the wait is over.
func TestSharedRecoverWaitsAndNeverRestarts(t *testing.T) {
	pipeDir, logDir, bin := operatorDaemon(t)
	ctx := context.Background()
	s, err := Join(ctx, SharedConfig{ControlBinary: bin, PipeDir: pipeDir, WaitTimeout: 300 * time.Millisecond}, nil)
	if err != nil {
		t.Fatal(err)
	}
	operator(t, bin, pipeDir, logDir, "", "quit")
	if err := s.Check(ctx); !errors.Is(err, ErrNotAnswering) {
		t.Fatalf("Check of a quit daemon: %v", err)
	}
	err = s.Recover(ctx)
	if !errors.Is(err, ErrNotAnswering) || !strings.Contains(err.Error(), "frmps does not restart it") {
		t.Fatalf("Recover of a daemon that stays away: %v", err)
	}
	if n := fakeStarts(t, logDir); n != 1 {
		t.Fatalf("%d daemon starts, want the operator's one: frmps started a daemon", n)
	}
	s.wait = 10 * time.Second
	done := make(chan error, 1)
	go func() { done <- s.Recover(ctx) }()
	time.Sleep(200 * time.Millisecond)
	operator(t, bin, pipeDir, logDir, "-d", "")
	if err := <-done; err != nil {
		t.Fatalf("Recover after the operator restarted the daemon: %v", err)
	}
	if n := fakeStarts(t, logDir); n != 2 {
		t.Fatalf("%d daemon starts, want the operator's two", n)
	}
}

func TestJoinRefuses(t *testing.T) {
	pipeDir, _, bin := operatorDaemon(t)
	ctx := context.Background()
	base := t.TempDir()
	link := filepath.Join(base, "link")
	if err := os.Symlink(pipeDir, link); err != nil {
		t.Fatal(err)
	}
	open := filepath.Join(base, "open")
	if err := os.Mkdir(open, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(open, 0o777); err != nil {
		t.Fatal(err)
	}
	empty := filepath.Join(base, "empty")
	if err := os.Mkdir(empty, 0o700); err != nil {
		t.Fatal(err)
	}
	stale := filepath.Join(base, "stale") // a control socket file but no daemon
	if err := os.Mkdir(stale, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(stale, "control"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, dir, bin string
		want           error
		inMsg          string
	}{
		{"relative path", "pipe", bin, ErrBadPipeDir, "not an absolute path"},
		{"missing", filepath.Join(base, "nope"), bin, ErrBadPipeDir, "no such file"},
		{"symlink", link, bin, ErrBadPipeDir, "not a directory"},
		{"writable by everyone", open, bin, ErrBadPipeDir, "writable by every user"},
		{"no daemon ever", empty, bin, ErrBadPipeDir, "no control socket"},
		{"daemon gone", stale, bin, ErrNotAnswering, "nvidia-cuda-mps-control -d"},
		{"no control binary", pipeDir, filepath.Join(base, "nvidia-cuda-mps-control"), ErrBinaryMissing, "not found"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Join(ctx, SharedConfig{ControlBinary: tc.bin, PipeDir: tc.dir}, nil)
			if !errors.Is(err, tc.want) || !strings.Contains(err.Error(), tc.inMsg) {
				t.Fatalf("got %v, want %v saying %q", err, tc.want, tc.inMsg)
			}
		})
	}
}
