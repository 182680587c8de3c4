package main

import (
	"bytes"
	"errors"
	"os"
	"strings"
	"testing"

	"github.com/frmps/frmps/internal/testenv"
	"github.com/frmps/frmps/supervisor/engine"
)

// enginePython is a Python with frmps_engine importable (make test sets
// FRMPS_PYTHON and PYTHONPATH).
func enginePython(t *testing.T) string {
	t.Helper()
	py := os.Getenv("FRMPS_PYTHON")
	if py == "" {
		testenv.Missing(t, "FRMPS_PYTHON is not set (a Python with frmps_engine importable; make go-test sets it)")
	}
	return py
}

// The engine side owns engine names: serve asks it once, in the interpreter
// check before anything starts, and passes its reason on.
func TestEngineNameIsCheckedByTheEngineSide(t *testing.T) {
	py := enginePython(t)
	check := func(python, name string) error {
		_, err := engine.PythonCLI{Engine: name, Python: python}.Preflight(t.Context(), nil)
		return err
	}
	for _, name := range []string{"ref", "vllm", "frmps_engine.sdk.testing.fake_engine:FakeAdapter"} {
		if err := check(py, name); err != nil && !strings.Contains(err.Error(), "No module named 'vllm'") {
			t.Errorf("%s refused: %v", name, err)
		}
	}
	for name, want := range map[string]string{
		"tgi":                              `--engine "tgi": unknown engine 'tgi': want ref, vllm, or an adapter factory as package.module:Factory`,
		"-x":                               `unknown engine '-x'`,
		"nosuch.engines:Factory":           `--engine "nosuch.engines:Factory": engine 'nosuch.engines:Factory': cannot import nosuch.engines`,
		"frmps_engine.sdk.adapters:NoSuch": `module frmps_engine.sdk.adapters has no NoSuch`,
		"frmps_engine.sdk.adapters:KNOWN":  `frmps_engine.sdk.adapters:KNOWN is a dict, not a callable factory`,
	} {
		err := check(py, name)
		var nameErr *engine.EngineNameError
		if !errors.As(err, &nameErr) || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: got %v, want an EngineNameError containing %q", name, err, want)
		}
	}
	err := check("/nonexistent/python3", "ref")
	if nameErr := (*engine.EngineNameError)(nil); errors.As(err, &nameErr) || err == nil || !strings.Contains(err.Error(), `python interpreter "/nonexistent/python3" cannot run the engine`) {
		t.Errorf("missing interpreter: %v", err)
	}
}

func TestServeRefusesAnUnknownEngineBeforeStarting(t *testing.T) {
	o := defaultServeOptions()
	o.Engine, o.Python, o.RunDir, o.StateDir = "tgi", enginePython(t), t.TempDir()+"/run", ""
	var log bytes.Buffer
	err := runServe(t.Context(), o, &log)
	if err == nil || !strings.Contains(err.Error(), "unknown engine 'tgi'") {
		t.Fatalf("runServe: %v", err)
	}
	if _, statErr := os.Stat(o.RunDir); !os.IsNotExist(statErr) {
		t.Errorf("run dir created before the engine check: %v", statErr)
	}
	if log.Len() != 0 {
		t.Errorf("serve logged before refusing: %s", log.String())
	}
}
