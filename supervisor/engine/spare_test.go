package engine

import (
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"go.uber.org/goleak"
)

func spareSpec(t *testing.T) (Spec, string) {
	spec := helperSpec(t, "spare")
	out := filepath.Join(t.TempDir(), "activation.json")
	spec.Env = append(spec.Env, "FRMPS_SPARE_OUT="+out)
	return spec, out
}

func waitReady(t *testing.T, s *Spare) {
	t.Helper()
	waitFor(t, s.Ready(), "spare never said it was ready")
}

func TestSpareActivation(t *testing.T) {
	defer goleak.VerifyNone(t)
	spec, out := spareSpec(t)
	s, err := StartSpare(spec, hclog.NewNullLogger())
	if err != nil {
		t.Fatal(err)
	}
	waitReady(t, s)
	if !strings.HasPrefix(s.ReadyLine(), SpareReadyMark) {
		t.Fatalf("ready line %q", s.ReadyLine())
	}
	env := append(slices.Clone(spec.Env), "CUDA_MPS_PIPE_DIRECTORY=/run/mps/pipe")
	logPath := filepath.Join(filepath.Dir(spec.LogPath), "standby-7.log")
	p, err := s.Activate("standby", []string{"serve", "--role", "standby"}, env, logPath)
	if err != nil {
		t.Fatal(err)
	}
	if p.PID() != s.PID() || p.LogPath() != logPath {
		t.Fatalf("activated process pid %d log %s", p.PID(), p.LogPath())
	}
	var got struct {
		Argv []string          `json:"argv"`
		Env  map[string]string `json:"env"`
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		raw, err := os.ReadFile(out)
		if err == nil && json.Unmarshal(raw, &got) == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the spare never got its activation: %v", err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if !slices.Equal(got.Argv, []string{"serve", "--role", "standby"}) || got.Env["CUDA_MPS_PIPE_DIRECTORY"] != "/run/mps/pipe" || got.Env["FRMPS_X"] != "42" {
		t.Fatalf("activation %+v", got)
	}
	if _, err := s.Activate("active", nil, env, ""); err == nil {
		t.Fatal("a spare was activated twice")
	}
	_ = p.Kill()
	wait(t, p)
	// One log, renamed: the spare's launch line, its ready line and what it
	// said as the engine.
	if _, err := os.Stat(spec.LogPath); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the spare's log %s is still there: %v", spec.LogPath, err)
	}
	raw, err := os.ReadFile(logPath)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"launching", SpareReadyMark, "activated", "exited: killed by signal 9"} {
		if !strings.Contains(string(raw), want) {
			t.Fatalf("log lacks %q:\n%s", want, raw)
		}
	}
}

func TestSpareRefusesAnEnvironmentItHasConsumed(t *testing.T) {
	defer goleak.VerifyNone(t)
	spec, _ := spareSpec(t)
	s, err := StartSpare(spec, hclog.NewNullLogger())
	if err != nil {
		t.Fatal(err)
	}
	for _, env := range [][]string{
		append(slices.Clone(spec.Env), "LD_PRELOAD=/x.so"),                                                           // added
		slices.DeleteFunc(slices.Clone(spec.Env), func(kv string) bool { return strings.HasPrefix(kv, "FRMPS_X=") }), // removed
		append(slices.Clone(spec.Env), "FRMPS_X=43"),                                                                 // changed (the last one wins)
	} {
		if _, err := s.Activate("standby", []string{"serve"}, env, ""); !errors.Is(err, ErrSpareEnv) {
			t.Fatalf("env %v: error %v, want ErrSpareEnv", env, err)
		}
	}
	if err := s.CheckEnv(append(slices.Clone(spec.Env), "CUDA_MPS_PIPE_DIRECTORY=/a", "CUDA_MPS_LOG_DIRECTORY=/b")); err != nil {
		t.Fatal(err)
	}
	// Refused activations leave it unused: sent away, it exits 0 by itself.
	s.Close(20 * time.Second)
	wait(t, s.Process())
	if ws := s.WaitStatus(); !ws.Exited() || ws.ExitStatus() != 0 {
		t.Fatalf("spare sent away: %v, want exit 0", ws)
	}
}

func TestSpareCloseKillsOneThatDoesNotRead(t *testing.T) {
	defer goleak.VerifyNone(t)
	spec := helperSpec(t, "block") // never reads its stdin, like a spare still importing
	s, err := StartSpare(spec, hclog.NewNullLogger())
	if err != nil {
		t.Fatal(err)
	}
	s.Close(50 * time.Millisecond)
	wait(t, s.Process())
	if ws := s.WaitStatus(); !ws.Signaled() {
		t.Fatalf("status %v, want killed", ws)
	}
	if _, err := s.Activate("standby", []string{"serve"}, spec.Env, ""); err == nil {
		t.Fatal("activated a spare that was sent away")
	}
}

func TestPythonCLISpareCommandLines(t *testing.T) {
	a := PythonCLI{Engine: "vllm", Python: "/venv/bin/python"}
	path, args, err := a.SpareCommand(SpareOptions{ModulesFile: "/run/engine-modules.txt", Model: "/models/q"})
	if err != nil || path != "/venv/bin/python" ||
		!slices.Equal(args, []string{"-m", "frmps_engine.cli", "spare", "--engine", "vllm", "--modules", "/run/engine-modules.txt", "--model", "/models/q"}) {
		t.Fatalf("spare command %s %v %v", path, args, err)
	}
	inv := Invocation{Role: RoleStandby, Model: "m", ControlSocket: "/c", GenerationSocket: "/g", Device: "cuda"}
	serve, err := a.ServeArgs(inv)
	if err != nil {
		t.Fatal(err)
	}
	_, full, _ := a.Command(inv)
	if !slices.Equal(serve, full[2:]) || serve[0] != "serve" {
		t.Fatalf("serve args %v (command %v)", serve, full)
	}
	if _, err := a.ServeArgs(Invocation{Role: "x"}); err == nil {
		t.Fatal("a bad invocation was accepted")
	}
}
