package main

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

func TestServingArgv(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want []string
	}{
		{[]string{"report", "res"}, []string{"-m", "bench.serving", "report", "res"}},
		{[]string{"sweep", "--model", "m"}, []string{"-m", "bench.serving", "sweep", "--frmps", "/x/frmps", "--model", "m"}},
		{[]string{"faults", "--frmps", "mine"}, []string{"-m", "bench.serving", "faults", "--frmps", "/x/frmps", "--frmps", "mine"}},
	} {
		if got := servingArgv("/x/frmps", tc.args); !reflect.DeepEqual(got, tc.want) {
			t.Errorf("servingArgv(%q) = %q, want %q", tc.args, got, tc.want)
		}
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"sweep"}, ""},
		{[]string{"sweep", "--python", "a", "--python=b"}, "b"},
		{[]string{"sweep", "--python=b", "--python", "c"}, "c"},
		{[]string{"sweep", "--", "--python", "c"}, ""},
		{[]string{"sweep", "--python"}, ""},
	} {
		if got := pythonArg(tc.args); got != tc.want {
			t.Errorf("pythonArg(%q) = %q, want %q", tc.args, got, tc.want)
		}
	}
}

func TestBenchServingRunsTheCheckoutsDriver(t *testing.T) {
	py, argsFile := fakePython(t)
	root := t.TempDir()
	old := servingRootFor
	servingRootFor = func(string) (string, error) { return root, nil }
	t.Cleanup(func() { servingRootFor = old })
	// The fake interpreter also records PYTHONPATH, which must start with the checkout.
	envFile := filepath.Join(t.TempDir(), "env")
	body, err := os.ReadFile(py)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(py, []byte(strings.Replace(string(body), "echo driver-output",
		"echo \"$PYTHONPATH\" > "+envFile+"\necho driver-output", 1)), 0o755); err != nil {
		t.Fatal(err)
	}
	cmd := newBenchCmd()
	var out bytes.Buffer
	cmd.SetOut(&out)
	cmd.SetErr(&out)
	cmd.SetArgs([]string{"serving", "sweep", "--python", py, "--rates", "2,inf", "--dry-run"})
	if err := cmd.Execute(); err != nil {
		t.Fatal(err)
	}
	raw, err := os.ReadFile(argsFile)
	if err != nil {
		t.Fatal(err)
	}
	self, _ := os.Executable()
	want := []string{"-m", "bench.serving", "sweep", "--frmps", self, "--python", py, "--rates", "2,inf", "--dry-run"}
	if got := strings.Split(strings.TrimSpace(string(raw)), "\n"); !reflect.DeepEqual(got, want) {
		t.Fatalf("driver got %q, want %q", got, want)
	}
	pp, _ := os.ReadFile(envFile)
	if !strings.HasPrefix(string(pp), root) {
		t.Fatalf("PYTHONPATH %q does not start with the checkout %q", pp, root)
	}
	if !strings.Contains(out.String(), "driver-output") {
		t.Fatalf("driver output not passed through: %q", out.String())
	}

	t.Setenv("FAKE_RC", "2")
	cmd = newBenchCmd()
	cmd.SetOut(&bytes.Buffer{})
	cmd.SetArgs([]string{"serving", "report", "--python", py, "res"})
	var ee exitError
	if err := cmd.Execute(); !errors.As(err, &ee) || ee.code != 2 {
		t.Fatalf("want the driver's exit status 2, got %v", err)
	}
}

func TestBenchServingRefusesWithoutACheckoutOrASubcommand(t *testing.T) {
	if _, err := servingRootFor(filepath.Join(t.TempDir(), "bin", "frmps")); err == nil ||
		!strings.Contains(err.Error(), "source checkout") {
		t.Fatalf("a binary outside a checkout: %v", err)
	}
	cmd := newBenchCmd()
	cmd.SetOut(&bytes.Buffer{})
	cmd.SetErr(&bytes.Buffer{})
	cmd.SetArgs([]string{"serving"})
	if err := cmd.Execute(); err == nil || !strings.Contains(err.Error(), "sweep, faults or report") {
		t.Fatalf("no subcommand: %v", err)
	}
	var out bytes.Buffer
	cmd = newBenchCmd()
	cmd.SetOut(&out)
	cmd.SetArgs([]string{"serving", "--help"})
	if err := cmd.Execute(); err != nil || !strings.Contains(out.String(), "vllm bench serve") {
		t.Fatalf("help: %v %q", err, out.String())
	}
}
