package engine

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/hashicorp/go-hclog"
)

// A spare is an engine process started ahead of need: the interpreter up and
// the engine's imports done, its GPU untouched, waiting on stdin for the
// command line it is to serve (frmps_engine/sdk/spare.py). The CUDA driver
// reads the MPS pipe directory when it initialises, so a spare can still be
// placed inside or outside MPS when it is activated.

// SpareReadyMark starts the line a spare prints once its imports are done.
const SpareReadyMark = "frmps-spare: ready"

// SpareExitDriverInitialised: the spare's preload initialised the CUDA
// driver, so no spare of this engine can be placed; start engines cold.
const SpareExitDriverInitialised = 5

// ActivationVars are the only environment variables an activation may
// change: read by the CUDA driver when it initialises, never at import time.
// The spare enforces the same list.
var ActivationVars = []string{"CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"}

// ErrSpareEnv: the activation would change a variable the spare has consumed.
var ErrSpareEnv = errors.New("activation changes the environment beyond the MPS variables")

// SpareAdapter is an Adapter whose engines can be started as spares.
type SpareAdapter interface {
	Adapter
	// SpareCommand starts a spare of this engine.
	SpareCommand(opts SpareOptions) (path string, args []string, err error)
	// ServeArgs is the command line a spare serves for inv: what Command
	// runs, without the interpreter's own arguments.
	ServeArgs(inv Invocation) ([]string, error)
}

var _ SpareAdapter = PythonCLI{}

const pythonModule = "frmps_engine.cli"

// SpareOptions: what a spare may prepare ahead of its activation.
type SpareOptions struct {
	// ModulesFile lists the modules a served engine had loaded (read if present).
	ModulesFile string
	// Model the engines serve: the engine's preload hook may read what does not
	// touch the GPU (its tokenizer, for instance).
	Model string
}

// SpareCommand implements SpareAdapter.
func (a PythonCLI) SpareCommand(opts SpareOptions) (string, []string, error) {
	py := a.Python
	if py == "" {
		py = "python3"
	}
	args := []string{"-m", pythonModule, "spare", "--engine", a.Engine}
	if opts.ModulesFile != "" {
		args = append(args, "--modules", opts.ModulesFile)
	}
	if opts.Model != "" {
		args = append(args, "--model", opts.Model)
	}
	return py, args, nil
}

// ServeArgs implements SpareAdapter.
func (a PythonCLI) ServeArgs(inv Invocation) ([]string, error) {
	_, args, err := a.Command(inv)
	if err != nil {
		return nil, err
	}
	if len(args) < 2 || args[0] != "-m" || args[1] != pythonModule {
		return nil, fmt.Errorf("engine command %v does not run %s", args, pythonModule)
	}
	return args[2:], nil
}

// Spare is a started spare. Safe for concurrent use.
type Spare struct {
	proc  *Process
	env   []string
	ready chan struct{}

	mu        sync.Mutex
	readyOnce sync.Once
	readyLine string
	activated bool
}

// StartSpare starts a spare (spec.Env is its environment; spec.Stdin is
// set here).
func StartSpare(spec Spec, log hclog.Logger) (*Spare, error) {
	s := &Spare{env: slices.Clone(spec.Env), ready: make(chan struct{})}
	spec.Stdin = true
	spec.OnStdout = func(line string) {
		if strings.HasPrefix(line, SpareReadyMark) {
			s.readyOnce.Do(func() {
				s.mu.Lock()
				s.readyLine = line
				s.mu.Unlock()
				close(s.ready)
			})
		}
	}
	p, err := Start(spec, log)
	if err != nil {
		return nil, err
	}
	s.proc = p
	return s, nil
}

// Process of the spare (before and after activation: the same process).
func (s *Spare) Process() *Process { return s.proc }

// Ready is closed once the spare's imports are done.
func (s *Spare) Ready() <-chan struct{} { return s.ready }

// ReadyLine is what the spare printed when it became ready ("" before).
func (s *Spare) ReadyLine() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.readyLine
}

// CheckEnv says whether env differs from the spare's own environment only
// in ActivationVars.
func (s *Spare) CheckEnv(env []string) error { return CheckActivationEnv(s.env, env) }

// CheckActivationEnv says whether env differs from spareEnv, the environment
// a spare started with, only in ActivationVars (ErrSpareEnv otherwise).
func CheckActivationEnv(spareEnv, env []string) error {
	have, want := envMap(spareEnv), envMap(env)
	var bad []string
	for k := range joinKeys(have, want) {
		if have[k] != want[k] && !slices.Contains(ActivationVars, k) {
			bad = append(bad, k)
		}
	}
	if len(bad) > 0 {
		slices.Sort(bad)
		return fmt.Errorf("%w: %s", ErrSpareEnv, strings.Join(bad, ", "))
	}
	return nil
}

// Activate hands the spare its command line and environment: from here on
// it is the engine name, logging to logPath (its log file is renamed). It
// does not wait for the spare's imports. A spare is activated once.
func (s *Spare) Activate(name string, args, env []string, logPath string) (*Process, error) {
	if err := s.CheckEnv(env); err != nil {
		return nil, err
	}
	s.mu.Lock()
	if s.activated {
		s.mu.Unlock()
		return nil, errors.New("spare already activated")
	}
	s.activated = true
	s.mu.Unlock()
	p := s.proc
	line, err := json.Marshal(struct {
		Argv []string          `json:"argv"`
		Env  map[string]string `json:"env"`
	}{args, envMap(env)})
	if err != nil {
		return nil, err
	}
	w := p.takeStdin()
	if w == nil {
		return nil, errors.New("spare has exited")
	}
	// The pipe holds 64 KiB, so this does not wait for the spare's imports;
	// the deadline only guards against an environment larger than that.
	_ = w.SetWriteDeadline(time.Now().Add(2 * time.Second))
	_, werr := w.Write(append(line, '\n'))
	cerr := w.Close()
	if werr != nil || cerr != nil {
		_ = p.Kill()
		return nil, fmt.Errorf("activate spare %d: %w", p.PID(), errors.Join(werr, cerr))
	}
	p.mu.Lock()
	old := p.logPath
	if logPath != "" && logPath != old {
		if err := os.Rename(old, logPath); err == nil {
			p.logPath = logPath
		}
	}
	p.name = name
	p.elog = p.base.Named(name).With("pid", p.pid)
	p.mu.Unlock()
	return p, nil
}

// Close sends the spare away unused (end of input: it exits 0) and kills it
// if it has not exited within grace. Wait on Process().Done().
func (s *Spare) Close(grace time.Duration) {
	p := s.proc
	if w := p.takeStdin(); w != nil {
		_ = w.Close()
	}
	select {
	case <-p.Done():
	case <-time.After(grace):
		_ = p.Kill()
	}
}

func envMap(env []string) map[string]string {
	m := make(map[string]string, len(env))
	for _, kv := range env {
		k, v, _ := strings.Cut(kv, "=")
		m[k] = v // the last one wins, as in exec
	}
	return m
}

func joinKeys(a, b map[string]string) map[string]struct{} {
	out := make(map[string]struct{}, len(a)+len(b))
	for k := range a {
		out[k] = struct{}{}
	}
	for k := range b {
		out[k] = struct{}{}
	}
	return out
}

// PID of the spare.
func (s *Spare) PID() int { return s.proc.PID() }

// Done is closed once the spare (or the engine it became) has exited.
func (s *Spare) Done() <-chan struct{} { return s.proc.Done() }

// WaitStatus is the exit status; valid after Done.
func (s *Spare) WaitStatus() syscall.WaitStatus { return s.proc.WaitStatus() }

// LastStderr returns the last stderr lines, oldest first.
func (s *Spare) LastStderr() []string { return s.proc.LastStderr() }
