package main

import (
	"bytes"
	"context"
	"errors"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

// checkout lays out a source checkout: bin/frmps, vllmpatch/src/frmps_engine
// and, when venv, .venv/bin/python.
func checkout(t *testing.T, venv bool) (root, exe string) {
	t.Helper()
	root = t.TempDir()
	files := []string{"bin/frmps", "vllmpatch/src/frmps_engine/__init__.py"}
	if venv {
		files = append(files, ".venv/bin/python")
	}
	for _, f := range files {
		p := filepath.Join(root, f)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, nil, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	return root, filepath.Join(root, "bin", "frmps")
}

func TestFindPython(t *testing.T) {
	root, exe := checkout(t, true)
	src := filepath.Join(root, "vllmpatch", "src")
	_, noVenvExe := checkout(t, false)
	elsewhere := filepath.Join(t.TempDir(), "bin", "frmps")
	for _, tc := range []struct {
		name, explicit, exe string
		env                 []string
		python, source      string
		pythonPath          string // "" = not set
	}{
		{"flag wins", "/opt/py", exe, []string{"FRMPS_PYTHON=/env/py"}, "/opt/py", "--python", src},
		{"environment", "", exe, []string{"FRMPS_PYTHON=/env/py"}, "/env/py", "$FRMPS_PYTHON", src},
		{"checkout venv", "", exe, nil, filepath.Join(root, ".venv", "bin", "python"), "the checkout's .venv", src},
		{"checkout without venv", "", noVenvExe, nil, "python3", "PATH", filepath.Join(filepath.Dir(filepath.Dir(noVenvExe)), "vllmpatch", "src")},
		{"installed binary", "", elsewhere, nil, "python3", "PATH", ""},
		{"installed binary keeps PYTHONPATH", "", elsewhere, []string{"PYTHONPATH=/x"}, "python3", "PATH", "/x"},
		{"source first, user path kept", "", exe, []string{"PYTHONPATH=/x:/y"}, filepath.Join(root, ".venv", "bin", "python"), "the checkout's .venv", src + ":/x:/y"},
		{"source not repeated", "", exe, []string{"PYTHONPATH=/x:" + src}, filepath.Join(root, ".venv", "bin", "python"), "the checkout's .venv", "/x:" + src},
	} {
		t.Run(tc.name, func(t *testing.T) {
			env := append([]string{"HOME=/h"}, tc.env...)
			got := findPython(tc.explicit, tc.exe, env)
			if got.Python != tc.python || got.Source != tc.source {
				t.Errorf("python %q from %q, want %q from %q", got.Python, got.Source, tc.python, tc.source)
			}
			if pp := lookupEnv(got.Env, "PYTHONPATH"); pp != tc.pythonPath {
				t.Errorf("PYTHONPATH %q, want %q", pp, tc.pythonPath)
			}
			if n := len(slices.DeleteFunc(slices.Clone(got.Env), func(kv string) bool { return !strings.HasPrefix(kv, "PYTHONPATH=") })); n > 1 {
				t.Errorf("PYTHONPATH set %d times: %q", n, got.Env)
			}
			if !slices.Contains(got.Env, "HOME=/h") {
				t.Errorf("environment lost: %q", got.Env)
			}
		})
	}
}

// freePort returns a TCP port that was free a moment ago.
func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// A Python that cannot import the engine package is refused before anything
// starts: no listener is opened, no engine launched.
func TestServeRefusesAPythonWithoutTheEngine(t *testing.T) {
	empty := t.TempDir()
	t.Setenv("PYTHONPATH", empty)
	t.Setenv("FRMPS_PYTHON", "")
	for _, python := range []string{"python3", filepath.Join(empty, "no-such-python")} {
		if _, err := exec.LookPath(python); err != nil && python == "python3" {
			t.Log("no python3 in PATH: only the missing interpreter is tried")
			continue
		}
		o := defaultServeOptions()
		o.NoMPS, o.Python = true, python
		o.Port = freePort(t)
		o.AdminAddr = "127.0.0.1:0"
		var logs bytes.Buffer
		err := runServe(context.Background(), o, &logs)
		if err == nil || !strings.Contains(err.Error(), "cannot run the engine") || !strings.Contains(err.Error(), "--python") {
			t.Fatalf("%s: %v", python, err)
		}
		if python == "python3" && !strings.Contains(err.Error(), "No module named 'frmps_engine'") {
			t.Errorf("the reason is not the import error: %v", err)
		}
		if strings.Contains(logs.String(), "engine launched") {
			t.Errorf("an engine was launched:\n%s", logs.String())
		}
		if c, err := net.DialTimeout("tcp", "127.0.0.1:"+strconv.Itoa(o.Port), time.Second); err == nil {
			c.Close()
			t.Errorf("port %d was opened", o.Port)
		}
	}
}

// The binary says why in one line and exits 1 (the test binary re-executed
// as frmps).
func TestServeRefusalExitStatus(t *testing.T) {
	if os.Getenv("FRMPS_TEST_MAIN") == "1" {
		os.Args = append([]string{"frmps"}, strings.Fields(os.Getenv("FRMPS_TEST_ARGS"))...)
		main()
		return
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestServeRefusalExitStatus$")
	cmd.Env = append(os.Environ(), "FRMPS_TEST_MAIN=1", "PYTHONPATH="+t.TempDir(),
		"FRMPS_TEST_ARGS=serve --no-mps --admin-addr 127.0.0.1:0 --python "+filepath.Join(t.TempDir(), "no-such-python"))
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	err := cmd.Run()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 1 {
		t.Fatalf("exit %v, want status 1; stderr %s", err, stderr.String())
	}
	out := strings.TrimSpace(stderr.String())
	if strings.Count(out, "\n") != 0 || !strings.HasPrefix(out, "frmps: python interpreter") {
		t.Fatalf("want one line of reason, got:\n%s", out)
	}
}
