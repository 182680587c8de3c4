package engine

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/frmps/frmps/internal/testenv"
)

// fakeAdapters is the TEST DOUBLE of frmps_engine.sdk.adapters: it knows ref and vllm.
const fakeAdapters = `class AdapterError(Exception):
    pass
def resolve(engine):
    if engine not in ("ref", "vllm"):
        raise AdapterError(f"unknown engine {engine!r}")
    return engine, None
`

// fakePackage writes a stand-in frmps_engine (TEST DOUBLE: the modules the
// preflight imports, empty but for adapters) and returns its PYTHONPATH entry.
func fakePackage(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	for _, f := range []string{"frmps_engine/__init__.py", "frmps_engine/cli.py", "frmps_engine/sdk/__init__.py", "frmps_engine/sdk/runner.py", "frmps_engine/sdk/adapters.py"} {
		p := filepath.Join(dir, f)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		var body []byte
		if strings.HasSuffix(f, "adapters.py") {
			body = []byte(fakeAdapters)
		}
		if err := os.WriteFile(p, body, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

func python3(t *testing.T) string {
	t.Helper()
	py, err := exec.LookPath("python3")
	if err != nil {
		testenv.Missing(t, "python3 is not in PATH")
	}
	return py
}

func TestPreflight(t *testing.T) {
	py := python3(t)
	pkg := fakePackage(t)
	env := []string{"PATH=" + os.Getenv("PATH"), "PYTHONPATH=" + pkg}
	where, err := PythonCLI{Engine: "ref", Python: py}.Preflight(context.Background(), env)
	if err != nil || where != filepath.Join(pkg, "frmps_engine", "__init__.py") {
		t.Fatalf("ref: %q %v", where, err)
	}
	for _, tc := range []struct {
		name   string
		cli    PythonCLI
		env    []string
		reason string
	}{
		{"no engine package", PythonCLI{Engine: "ref", Python: py}, []string{"PYTHONPATH=" + t.TempDir()}, "ModuleNotFoundError: No module named 'frmps_engine'"},
		{"vllm missing", PythonCLI{Engine: "vllm", Python: py}, env, "No module named 'vllm'"},
		{"no interpreter", PythonCLI{Engine: "ref", Python: filepath.Join(t.TempDir(), "python")}, env, "no such file or directory"},
		{"unknown engine", PythonCLI{Engine: "tgi", Python: py}, env, `--engine "tgi": unknown engine 'tgi'`},
	} {
		_, err := tc.cli.Preflight(context.Background(), tc.env)
		if err == nil || !strings.Contains(err.Error(), tc.reason) || strings.Contains(err.Error(), "\n") {
			t.Errorf("%s: %v, want one line with %q", tc.name, err, tc.reason)
		}
		var nameErr *EngineNameError
		if isName := errors.As(err, &nameErr); isName != (tc.name == "unknown engine") {
			t.Errorf("%s: EngineNameError %v: %v", tc.name, isName, err)
		}
	}
}

// The project's own interpreter (FRMPS_PYTHON, as `make test` sets it) passes.
func TestPreflightProjectPython(t *testing.T) {
	py := os.Getenv("FRMPS_PYTHON")
	if py == "" {
		testenv.Missing(t, "set FRMPS_PYTHON (and PYTHONPATH=vllmpatch/src) to check the project's interpreter")
	}
	where, err := PythonCLI{Engine: "ref", Python: py}.Preflight(context.Background(), os.Environ())
	if err != nil || !strings.HasSuffix(where, filepath.Join("frmps_engine", "__init__.py")) {
		t.Fatalf("%q %v", where, err)
	}
}

func TestPreflightTimesOut(t *testing.T) {
	script := filepath.Join(t.TempDir(), "python")
	if err := os.WriteFile(script, []byte("#!/bin/sh\nexec sleep 30\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err := PythonCLI{Engine: "ref", Python: script}.Preflight(ctx, nil)
	if err == nil || !strings.Contains(err.Error(), "did not finish importing") {
		t.Fatalf("%v", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("took %s", d)
	}
}

// Check reports whether vLLM is installed (what --engine auto picks from),
// without importing it.
func TestCheckReportsVLLM(t *testing.T) {
	py := python3(t)
	pkg := fakePackage(t)
	env := []string{"PATH=" + os.Getenv("PATH"), "PYTHONPATH=" + pkg}
	for _, engine := range []string{"auto", "ref"} {
		r, err := PythonCLI{Engine: engine, Python: py}.Check(context.Background(), env)
		if err != nil || r.VLLM != "" || !strings.Contains(r.VLLMWhy, "not installed") || r.Package != filepath.Join(pkg, "frmps_engine", "__init__.py") {
			t.Fatalf("%s, no vLLM: %+v %v", engine, r, err)
		}
	}
	// A TEST DOUBLE vLLM: an installed distribution whose import would fail
	// (the check must not import it).
	site := t.TempDir()
	for f, body := range map[string]string{
		"vllm/__init__.py":                    "raise SystemExit('vllm was imported')\n",
		"vllm-0.26.0.dist-info/METADATA":      "Metadata-Version: 2.1\nName: vllm\nVersion: 0.26.0\n",
		"vllm-0.26.0.dist-info/RECORD":        "",
		"vllm-0.26.0.dist-info/top_level.txt": "vllm\n",
	} {
		p := filepath.Join(site, f)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	env = []string{"PATH=" + os.Getenv("PATH"), "PYTHONPATH=" + pkg + ":" + site}
	for _, engine := range []string{"auto", "vllm"} {
		r, err := PythonCLI{Engine: engine, Python: py}.Check(context.Background(), env)
		if err != nil || r.VLLM != "0.26.0" || r.VLLMWhy != "" {
			t.Fatalf("%s, vLLM 0.26.0 installed: %+v %v", engine, r, err)
		}
	}
	if _, err := (PythonCLI{Engine: "tgi", Python: py}).Check(context.Background(), env); err == nil {
		t.Fatal("an unknown engine passed the check")
	}
}
