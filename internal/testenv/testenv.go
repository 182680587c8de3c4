// Package testenv decides what a test does when something it needs from the
// machine is missing: locally it skips with the reason; in CI (CI set to a
// true value, as CI services and .ci/run do) it fails, so that a test that
// never ran cannot pass as green.
package testenv

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"sync"
	"testing"
)

// InCI reports whether the CI environment variable is set to a true value.
func InCI() bool {
	ci, err := strconv.ParseBool(os.Getenv("CI"))
	return err == nil && ci
}

// Missing ends the test because a prerequisite is missing: Fatal in CI,
// Skip elsewhere. The message says what is missing and how to provide it.
func Missing(t testing.TB, format string, args ...any) {
	t.Helper()
	msg := fmt.Sprintf(format, args...)
	if InCI() {
		t.Fatalf("%s (CI is set: a test that cannot run fails)", msg)
		return
	}
	t.Skip(msg)
}

// FakeNvidiaSMI is the path of the fake nvidia-smi (a TEST DOUBLE shell script,
// supervisor/mps/testdata/nvidia-smi) answering frmps's one query with gpus
// ("0, GPU-<uuid>, Default" lines, ';'-separated); mode picks its behaviour
// (ok, fail, garbage: the script's header). Set for the test's duration.
func FakeNvidiaSMI(t testing.TB, mode, gpus string) string {
	t.Helper()
	t.Setenv("FAKE_SMI_MODE", mode)
	t.Setenv("FAKE_SMI_GPUS", gpus)
	_, file, _, ok := runtime.Caller(0)
	if !ok {
		t.Fatal("testenv: cannot locate the source tree")
	}
	return filepath.Join(filepath.Dir(file), "..", "..", "supervisor", "mps", "testdata", "nvidia-smi")
}

// LogBuffer is a log sink (the io.Writer of an hclog logger) whose text a test
// may read while the code under test still writes to it.
type LogBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *LogBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

// String is everything written so far.
func (l *LogBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}
