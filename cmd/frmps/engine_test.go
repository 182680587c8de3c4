package main

import (
	"bytes"
	"os"
	"strings"
	"testing"

	"github.com/frmps/frmps/internal/testenv"
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

// The engine side owns engine names: serve asks it once, before anything
// starts, and passes its reason on.
func TestEngineNameIsCheckedByTheEngineSide(t *testing.T) {
	py := enginePython(t)
	for _, name := range []string{"ref", "vllm", "frmps_engine.sdk.testing.fake_engine:FakeAdapter"} {
		if err := checkEngine(t.Context(), pythonEnv{Python: py}, name); err != nil {
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
		err := checkEngine(t.Context(), pythonEnv{Python: py}, name)
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: got %v, want an error containing %q", name, err, want)
		}
	}
	if err := checkEngine(t.Context(), pythonEnv{Python: "/nonexistent/python3"}, "ref"); err == nil || !strings.Contains(err.Error(), `--engine "ref": run /nonexistent/python3`) {
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
