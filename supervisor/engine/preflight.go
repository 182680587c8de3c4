package engine

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os/exec"
	"strings"
	"time"
)

// preflightScript imports what `python -m frmps_engine.cli serve` needs
// before it loads a model, asks the engine side (which owns engine names,
// frmps_engine.sdk.adapters) whether the --engine name loads (exit 3 and the
// reason when not), and for --engine vllm checks that vLLM is installed (not
// imported: that takes seconds). With --engine auto it checks the reference
// engine, and the vLLM adapter where vLLM is installed. It prints where the
// engine package was found, then one JSON line: vLLM's installed version
// ("" when not installed or its adapter does not load) and why not.
const preflightScript = `import importlib.util, json, sys
import frmps_engine, frmps_engine.cli, frmps_engine.sdk.runner
from frmps_engine.sdk import adapters
engine = sys.argv[1]
installed = importlib.util.find_spec("vllm") is not None
version, why = "", "vLLM is not installed in this interpreter"
if installed:
    try:
        from importlib.metadata import version as dist_version
        version = dist_version("vllm")
    except Exception:
        version = "unknown version"
    why = ""
try:
    adapters.resolve("ref" if engine == "auto" else engine)
except adapters.AdapterError as e:
    print(e, file=sys.stderr)
    sys.exit(3)
if engine == "auto" and installed:
    try:
        adapters.resolve("vllm")
    except adapters.AdapterError as e:
        version, why = "", f"the vLLM adapter does not load: {e}"
if engine == "vllm" and not installed:
    raise SystemExit("ModuleNotFoundError: No module named 'vllm' (--engine vllm runs the vLLM adapter)")
print(frmps_engine.__file__)
print(json.dumps({"vllm": version, "vllm_why": why}))
`

// PreflightResult is what Check found.
type PreflightResult struct {
	Package string // where the engine package (frmps_engine) was found
	// VLLM is vLLM's installed version where vLLM is installed in the
	// interpreter (found, not imported) and, for --engine auto, its adapter
	// loads; "" otherwise, with VLLMWhy saying why not.
	VLLM    string
	VLLMWhy string
}

// preflightNameRefused is the script's exit status when the engine side
// refuses the --engine name.
const preflightNameRefused = 3

// EngineNameError is Preflight's error when the interpreter works but the
// engine side does not know the --engine name (or cannot load its factory).
type EngineNameError struct {
	Name   string
	Reason string
}

func (e *EngineNameError) Error() string { return fmt.Sprintf("--engine %q: %s", e.Name, e.Reason) }

// PreflightTimeout bounds the interpreter check; a cold start of Python and
// its imports on a slow disk takes seconds, not minutes.
const PreflightTimeout = time.Minute

// Preflight runs the interpreter once with env and checks that it can start
// this adapter's engine, so that a wrong interpreter or engine name is one
// clear error before any engine is launched instead of a crash loop (an
// *EngineNameError for the name). It returns where the engine package was found.
func (a PythonCLI) Preflight(ctx context.Context, env []string) (string, error) {
	r, err := a.Check(ctx, env)
	return r.Package, err
}

// Check is Preflight with what it found about vLLM too. Engine "auto" checks
// the reference engine, and vLLM's adapter where vLLM is installed.
func (a PythonCLI) Check(ctx context.Context, env []string) (PreflightResult, error) {
	py := a.Python
	if py == "" {
		py = "python3"
	}
	ctx, cancel := context.WithTimeout(ctx, PreflightTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, py, "-c", preflightScript, a.Engine)
	cmd.Env = env
	cmd.WaitDelay = time.Second // a grandchild holding the pipes cannot hold us
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	switch {
	case ctx.Err() != nil:
		return PreflightResult{}, fmt.Errorf("python interpreter %q did not finish importing the engine package in time: %w", py, ctx.Err())
	case err != nil:
		reason := lastLine(stderr.String())
		var ee *exec.ExitError
		if errors.As(err, &ee) && ee.ExitCode() == preflightNameRefused && reason != "" {
			return PreflightResult{}, &EngineNameError{Name: a.Engine, Reason: reason}
		}
		if reason == "" || !errors.As(err, &ee) {
			reason = err.Error()
		}
		return PreflightResult{}, fmt.Errorf("python interpreter %q cannot run the engine: %s", py, reason)
	}
	out := strings.Split(strings.TrimSpace(stdout.String()), "\n")
	r := PreflightResult{Package: strings.TrimSpace(out[0])}
	var v struct {
		VLLM    string `json:"vllm"`
		VLLMWhy string `json:"vllm_why"`
	}
	if len(out) < 2 || json.Unmarshal([]byte(out[len(out)-1]), &v) != nil {
		return r, fmt.Errorf("python interpreter %q: the engine check printed %q, not the package and a JSON line", py, stdout.String())
	}
	r.VLLM, r.VLLMWhy = v.VLLM, v.VLLMWhy
	return r, nil
}

// lastLine is the last non-empty line: a traceback's exception.
func lastLine(s string) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	return strings.TrimSpace(lines[len(lines)-1])
}
