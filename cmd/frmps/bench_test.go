package main

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

func TestBenchArgv(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want []string
	}{
		{[]string{"list"}, []string{"-m", "frmps_engine.bench", "list"}},
		{[]string{"recovery"}, []string{"-m", "frmps_engine.bench", "recovery", "--frmps", "/x/frmps"}},
		{[]string{"recovery", "--models", "qwen2.5-14b", "--python", "py2", "--frmps", "mine"},
			[]string{"-m", "frmps_engine.bench", "recovery", "--frmps", "/x/frmps", "--models", "qwen2.5-14b", "--python", "py2", "--frmps", "mine"}},
	} {
		if got := benchArgv("/x/frmps", tc.args); !reflect.DeepEqual(got, tc.want) {
			t.Errorf("benchArgv(%q) = %q, want %q", tc.args, got, tc.want)
		}
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
	want := []string{"-m", "frmps_engine.bench", "since-sync", "--frmps", self, "--ks", "1,16", "--cpu", "--help"}
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
