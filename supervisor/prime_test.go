package supervisor

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// primeFault runs the engine side's prime-fault command with the given env and
// device; its exit status decides. A shell script stands in for the interpreter
// (a test double: it prints its arguments and exits with $PRIME_RC).
func TestPrimeFaultRunsTheEngineCommand(t *testing.T) {
	py := filepath.Join(t.TempDir(), "python")
	script := "#!/bin/sh\necho \"args: $*\"\nexit ${PRIME_RC:-0}\n"
	if err := os.WriteFile(py, []byte(script), 0o700); err != nil {
		t.Fatal(err)
	}
	out, err := primeFault(context.Background(), py, []string{"PRIME_RC=0"}, 1)
	if err != nil || out != "args: -m frmps_engine.cli prime-fault --device 1" {
		t.Fatalf("out %q, err %v", out, err)
	}
	out, err = primeFault(context.Background(), py, []string{"PRIME_RC=2"}, 0)
	if err == nil || !strings.Contains(err.Error(), "device 0") || !strings.Contains(out, "--device 0") {
		t.Fatalf("want an error with the output, got %q, %v", out, err)
	}
	if _, err := primeFault(context.Background(), filepath.Join(t.TempDir(), "missing"), nil, 0); err == nil {
		t.Fatal("a missing interpreter is an error")
	}
}
