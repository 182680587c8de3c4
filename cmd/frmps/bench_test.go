package main

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

func TestBenchArgv(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want []string
	}{
		{[]string{"list"}, []string{"-m", "bench", "list"}},
		{[]string{"recovery"}, []string{"-m", "bench", "recovery", "--frmps", "/x/frmps"}},
		{[]string{"recovery", "--models", "qwen2.5-14b", "--python", "py2", "--frmps", "mine"},
			[]string{"-m", "bench", "recovery", "--frmps", "/x/frmps", "--models", "qwen2.5-14b", "--python", "py2", "--frmps", "mine"}},
	} {
		if got := benchArgv("/x/frmps", tc.args); !reflect.DeepEqual(got, tc.want) {
			t.Errorf("benchArgv(%q) = %q, want %q", tc.args, got, tc.want)
		}
	}
}

func TestBenchPythonPutsTheCheckoutRootOnPythonPath(t *testing.T) {
	root, exe := checkout(t, true)
	src := filepath.Join(root, "vllmpatch", "src")
	py := findPython("", exe, []string{"PYTHONPATH=/x"})
	// No bench package in the checkout: nothing added.
	if got := lookupEnv(benchPython(py, exe).Env, "PYTHONPATH"); got != src+":/x" {
		t.Fatalf("without bench/: PYTHONPATH %q, want %q", got, src+":/x")
	}
	main := filepath.Join(root, "bench", "__main__.py")
	if err := os.MkdirAll(filepath.Dir(main), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(main, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	got := benchPython(py, exe)
	if pp := lookupEnv(got.Env, "PYTHONPATH"); pp != root+":"+src+":/x" {
		t.Fatalf("PYTHONPATH %q, want %q", pp, root+":"+src+":/x")
	}
	if got.Python != py.Python || got.Source != py.Source {
		t.Fatalf("interpreter changed: %+v", got)
	}
	// Not a checkout: the environment is left as it was.
	elsewhere := filepath.Join(t.TempDir(), "bin", "frmps")
	if pp := lookupEnv(benchPython(findPython("", elsewhere, []string{"PYTHONPATH=/x"}), elsewhere).Env, "PYTHONPATH"); pp != "/x" {
		t.Fatalf("installed binary: PYTHONPATH %q, want /x", pp)
	}
}

// fakePython writes a script that records its arguments and exits with $FAKE_RC.
func fakePython(t *testing.T) (script, argsFile string) {
	dir := t.TempDir()
	argsFile = filepath.Join(dir, "args")
	script = filepath.Join(dir, "python")
	body := "#!/bin/sh\nfor a in \"$@\"; do printf '%s\\n' \"$a\"; done > " + argsFile + "\necho driver-output\nexit ${FAKE_RC:-0}\n"
	if err := os.WriteFile(script, []byte(body), 0o755); err != nil {
		t.Fatal(err)
	}
	return script, argsFile
}

func TestBenchRunsDriverWithFlagsAfterExperimentUntouched(t *testing.T) {
	py, argsFile := fakePython(t)
	cmd := newBenchCmd()
	var out bytes.Buffer
	cmd.SetOut(&out)
	cmd.SetErr(&out)
	cmd.SetArgs([]string{"--python", py, "since-sync", "--ks", "1,16", "--cpu", "--help"})
	if err := cmd.Execute(); err != nil {
		t.Fatal(err)
	}
	raw, err := os.ReadFile(argsFile)
	if err != nil {
		t.Fatal(err)
	}
	got := strings.Split(strings.TrimSpace(string(raw)), "\n")
	self, _ := os.Executable()
	want := []string{"-m", "bench", "since-sync", "--frmps", self, "--ks", "1,16", "--cpu", "--help"}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("driver got %q, want %q", got, want)
	}
	if !strings.Contains(out.String(), "driver-output") {
		t.Fatalf("driver output not passed through: %q", out.String())
	}
}

func TestBenchPassesTheDriversExitStatus(t *testing.T) {
	py, _ := fakePython(t)
	t.Setenv("FAKE_RC", "3")
	cmd := newBenchCmd()
	cmd.SetOut(&bytes.Buffer{})
	cmd.SetArgs([]string{"--python", py, "recovery"})
	err := cmd.Execute()
	var ee exitError
	if !errors.As(err, &ee) || ee.code != 3 {
		t.Fatalf("want exit status 3, got %v", err)
	}
}

func TestBenchNeedsAnExperimentAndAPython(t *testing.T) {
	cmd := newBenchCmd()
	cmd.SetOut(&bytes.Buffer{})
	cmd.SetErr(&bytes.Buffer{})
	cmd.SetArgs(nil)
	if err := cmd.Execute(); err == nil {
		t.Fatal("no experiment accepted")
	}
	cmd = newBenchCmd()
	cmd.SetOut(&bytes.Buffer{})
	cmd.SetArgs([]string{"--python", filepath.Join(t.TempDir(), "missing"), "list"})
	if err := cmd.Execute(); err == nil || !strings.Contains(err.Error(), "Python") {
		t.Fatalf("missing interpreter: %v", err)
	}
}

func TestBenchPythonFromEnvironment(t *testing.T) {
	py, argsFile := fakePython(t)
	t.Setenv("FRMPS_PYTHON", py)
	cmd := newBenchCmd()
	cmd.SetOut(&bytes.Buffer{})
	cmd.SetArgs([]string{"list"})
	if err := cmd.Execute(); err != nil {
		t.Fatal(err)
	}
	if raw, err := os.ReadFile(argsFile); err != nil || !strings.Contains(string(raw), "list") {
		t.Fatalf("FRMPS_PYTHON not used: %v %q", err, raw)
	}
}

// fakeMPSControl is the mps package's test double of nvidia-cuda-mps-control.
func fakeMPSControl(t *testing.T) string {
	t.Helper()
	bin, err := filepath.Abs(filepath.Join("..", "..", "supervisor", "mps", "testdata", "nvidia-cuda-mps-control"))
	if err != nil {
		t.Fatal(err)
	}
	return bin
}

func runBenchMPS(t *testing.T, args ...string) (string, error) {
	t.Helper()
	cmd := newBenchCmd()
	var out, errOut bytes.Buffer
	cmd.SetOut(&out)
	cmd.SetErr(&errOut)
	cmd.SetArgs(append([]string{"mps"}, args...))
	err := cmd.Execute()
	if err != nil {
		err = fmt.Errorf("%w (stderr: %s)", err, errOut.String())
	}
	return out.String(), err
}

func daemonPID(t *testing.T, pipeDir string) int {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join(pipeDir, "nvidia-cuda-mps-control.pid"))
	if err != nil {
		return 0
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(raw)))
	if err != nil {
		t.Fatal(err)
	}
	return pid
}

func TestBenchMPSStartPrintsTheClientEnvironmentAndStopEndsTheDaemon(t *testing.T) {
	ctl := fakeMPSControl(t)
	run := t.TempDir()
	out, err := runBenchMPS(t, "start", "--run-dir", run, "--mps-control", ctl)
	if err != nil {
		t.Fatal(err)
	}
	pipe, logd := filepath.Join(run, "mps", "pipe"), filepath.Join(run, "mps", "log")
	t.Cleanup(func() { _, _ = runBenchMPS(t, "stop", "--run-dir", run, "--mps-control", ctl) })
	want := "CUDA_MPS_PIPE_DIRECTORY=" + pipe + "\nCUDA_MPS_LOG_DIRECTORY=" + logd + "\n"
	if out != want {
		t.Fatalf("start printed %q, want %q", out, want)
	}
	for _, d := range []string{filepath.Join(run, "mps"), pipe, logd} {
		fi, err := os.Stat(d)
		if err != nil {
			t.Fatal(err)
		}
		if !fi.IsDir() || fi.Mode().Perm() != 0o700 {
			t.Fatalf("%s: mode %v; want a 0700 directory", d, fi.Mode())
		}
	}
	pid := daemonPID(t, pipe)
	if pid <= 0 || syscall.Kill(pid, 0) != nil {
		t.Fatalf("no running daemon after start (pid %d)", pid)
	}
	if _, err := runBenchMPS(t, "stop", "--run-dir", run, "--mps-control", ctl); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for syscall.Kill(pid, 0) == nil && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if syscall.Kill(pid, 0) == nil {
		t.Fatalf("daemon pid %d still alive after stop", pid)
	}
	// Nothing left to stop: not an error.
	if _, err := runBenchMPS(t, "stop", "--run-dir", run, "--mps-control", ctl); err != nil {
		t.Fatalf("second stop: %v", err)
	}
}

func TestBenchMPSRefusesUnsafeOrMissingDirectories(t *testing.T) {
	ctl := fakeMPSControl(t)
	if _, err := runBenchMPS(t, "start", "--mps-control", ctl); err == nil || !strings.Contains(err.Error(), "--run-dir is required") {
		t.Fatalf("no --run-dir: %v", err)
	}
	if _, err := runBenchMPS(t, "start", "--run-dir", filepath.Join(t.TempDir(), "missing"), "--mps-control", ctl); err == nil {
		t.Fatal("a missing run dir was accepted")
	}
	// The daemon's directory planted as a symlink: the supervisor's check refuses it.
	run, elsewhere := t.TempDir(), t.TempDir()
	if err := os.Symlink(elsewhere, filepath.Join(run, "mps")); err != nil {
		t.Fatal(err)
	}
	if _, err := runBenchMPS(t, "start", "--run-dir", run, "--mps-control", ctl); err == nil || !strings.Contains(err.Error(), "is not a directory") {
		t.Fatalf("symlinked mps dir: %v", err)
	}
	if ents, _ := os.ReadDir(elsewhere); len(ents) != 0 {
		t.Fatalf("start wrote through the symlink: %v", ents)
	}
	// An outside-MPS pipe dir with a control socket in it is a daemon's: refused.
	run = t.TempDir()
	out, err := runBenchMPS(t, "outside-env", "--run-dir", run)
	if err != nil {
		t.Fatal(err)
	}
	pipe := filepath.Join(run, "mps-outside", "pipe")
	if !strings.Contains(out, "CUDA_MPS_PIPE_DIRECTORY="+pipe+"\n") {
		t.Fatalf("outside-env printed %q", out)
	}
	if fi, err := os.Stat(pipe); err != nil || fi.Mode().Perm() != 0o700 {
		t.Fatalf("outside pipe dir: %v %v", err, fi)
	}
	if err := os.WriteFile(filepath.Join(pipe, "control"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := runBenchMPS(t, "outside-env", "--run-dir", run); err == nil || !strings.Contains(err.Error(), "has a control pipe") {
		t.Fatalf("outside pipe dir with a daemon's control socket: %v", err)
	}
}
