package engine

import (
	"bytes"
	"context"
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
// imported: that takes seconds). It prints where the engine package was found.
const preflightScript = `import importlib.util, sys
import frmps_engine, frmps_engine.cli, frmps_engine.sdk.runner
from frmps_engine.sdk import adapters
try:
    adapters.resolve(sys.argv[1])
except adapters.AdapterError as e:
    print(e, file=sys.stderr)
    sys.exit(3)
if sys.argv[1] == "vllm" and importlib.util.find_spec("vllm") is None:
    raise SystemExit("ModuleNotFoundError: No module named 'vllm' (--engine vllm runs the vLLM adapter)")
print(frmps_engine.__file__)
`

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
		return "", fmt.Errorf("python interpreter %q did not finish importing the engine package in time: %w", py, ctx.Err())
	case err != nil:
		reason := lastLine(stderr.String())
		var ee *exec.ExitError
		if errors.As(err, &ee) && ee.ExitCode() == preflightNameRefused && reason != "" {
			return "", &EngineNameError{Name: a.Engine, Reason: reason}
		}
		if reason == "" || !errors.As(err, &ee) {
			reason = err.Error()
		}
		return "", fmt.Errorf("python interpreter %q cannot run the engine: %s", py, reason)
	}
	return strings.TrimSpace(stdout.String()), nil
}

// lastLine is the last non-empty line: a traceback's exception.
func lastLine(s string) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	return strings.TrimSpace(lines[len(lines)-1])
}
