package main

import (
	"bytes"
	"context"
	"fmt"
	"os/exec"
	"strings"
	"time"
)

// engineCheckTimeout bounds the engine name check: it imports the adapter's
// module, not the engine.
const engineCheckTimeout = time.Minute

// checkEngine asks the engine side, which owns engine names
// (frmps_engine.sdk.adapters), whether --engine names one it can load: ref,
// vllm, or an importable package.module:Factory. It runs once, before
// anything starts, so a bad name is a clear error instead of engines that
// exit at start until the crash-loop breaker opens.
func checkEngine(ctx context.Context, py pythonEnv, name string) error {
	if ctx == nil {
		ctx = context.Background()
	}
	ctx, cancel := context.WithTimeout(ctx, engineCheckTimeout)
	defer cancel()
	var stdout, stderr bytes.Buffer
	c := exec.CommandContext(ctx, py.Python, "-m", "frmps_engine.cli", "check-engine", "--", name)
	c.Env = py.Env
	c.Stdout, c.Stderr = &stdout, &stderr
	if err := c.Run(); err != nil {
		msg := lastLine(strings.TrimSpace(stderr.String()))
		if msg == "" {
			msg = fmt.Sprintf("run %s: %v", py.Python, err)
		}
		return fmt.Errorf("--engine %q: %s", name, strings.TrimPrefix(msg, "frmps-engine: "))
	}
	return nil
}

// lastLine is the last line of s: a Python traceback ends with the error.
func lastLine(s string) string {
	if i := strings.LastIndexByte(s, '\n'); i >= 0 {
		return s[i+1:]
	}
	return s
}
