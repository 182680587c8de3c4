package deploy_test

import (
	"bytes"
	"errors"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// After the quick start (`make demo` builds bin/frmps and .venv), the README's
// commands work as written from a plain shell: no FRMPS_PYTHON, no
// PYTHONPATH, no activated virtualenv. (`frmps serve --no-mps` as written is
// TestDashboardAndRulesMatchMetrics's frmps when run by `make deploy-test`.)
func TestFirstRunCommands(t *testing.T) {
	bin := frmpsBinary(t)
	if !inCheckout(bin) {
		t.Skip("FRMPS_BIN is not this checkout's bin/frmps (make deploy-test passes it)")
	}
	run := func(args ...string) (string, string, error) {
		cmd := exec.Command(bin, args...)
		cmd.Dir = repoRoot
		cmd.Env = userEnv()
		var stdout, stderr bytes.Buffer
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		err := cmd.Run()
		return stdout.String(), stderr.String(), err
	}
	if out, errOut, err := run("bench", "list"); err != nil || !strings.Contains(out, "recovery") {
		t.Errorf("bin/frmps bench list: %v\n%s%s", err, out, errOut)
	}
	if out, _, err := run("version"); err != nil || out == "" {
		t.Errorf("bin/frmps version: %v", err)
	}
	// A wrong interpreter: one line, exit status 1, before anything starts.
	_, errOut, err := run("serve", "--no-mps", "--port", "0", "--admin-addr", "127.0.0.1:0", "--python", filepath.Join(t.TempDir(), "python3"))
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 1 || strings.Count(strings.TrimSpace(errOut), "\n") != 0 || !strings.Contains(errOut, "cannot run the engine") {
		t.Errorf("serve with a missing interpreter: %v\n%s", err, errOut)
	}
}
