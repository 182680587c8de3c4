package supervisor

import (
	"context"
	"errors"
	"fmt"
	"io"
	"syscall"
	"time"

	"github.com/hashicorp/go-hclog"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
	"github.com/frmps/frmps/supervisor/engine"
	"github.com/frmps/frmps/supervisor/failover"
	"github.com/frmps/frmps/supervisor/leftover"
)

// The supervisor is written against these narrow interfaces; the real
// implementations (control sockets, ring reader, MPS daemon, death
// classifier) are bound in deps_real.go, test doubles in the tests.

// Process is a launched engine process.
type Process interface {
	PID() int
	// Done is closed once the process exited and its group was fenced.
	Done() <-chan struct{}
	WaitStatus() syscall.WaitStatus // valid after Done
	LastStderr() []string
	// Kill fences the whole process group; idempotent, does not wait.
	Kill() error
	// KillLeader fences the leader only (SIGKILL to its pid): at one rank the
	// only process that writes the pools, the ring and the streams. The rest of
	// the group dies with it (Done waits for that) or by Kill; idempotent, does
	// not wait.
	KillLeader() error
	LogPath() string
}

// Launcher starts engine processes.
type Launcher interface {
	Launch(role failover.Role, inv engine.Invocation, env []string, logPath string) (Process, error)
}

// ControlConn is one engine's control connection.
type ControlConn interface {
	Send(env *frmpsv1.Envelope, fds []int) error
	Recv() (*frmpsv1.Envelope, []int, error) // received fds are the caller's; io.EOF on close
	Close() error
}

// ControlListener accepts the control connection of one expected pid.
type ControlListener interface {
	Accept(ctx context.Context, expectPID int) (ControlConn, error)
	Close() error // also removes the socket file
}

// Broker holds the shared pool fds for the life of the deployment.
type Broker interface {
	Put(pools []*frmpsv1.Pool, fds []int) error // takes ownership of fds
	Pools() []*frmpsv1.Pool
	FDs() []int // borrowed
	Close() error
}

// Ring consumes the forward-state ring into a snapshot. Not safe for
// concurrent use; the supervisor serialises access.
type Ring interface {
	Poll() (applied int, err error) // never blocks; ErrResync-wrapped errors are not fatal
	Lag() uint64
	Resyncs() uint64
	Snapshot(key uint64) (*frmpsv1.RequestSnapshot, bool)
	Len() int
	Close() error
}

// MPS is the MPS control daemon the active runs under: frmps's own, or the
// operator's, which frmps joins and never starts, stops or restarts.
type MPS interface {
	Check(ctx context.Context) error
	// Recover brings a daemon that does not answer back: frmps's own is
	// restarted, the operator's is waited for.
	Recover(ctx context.Context) error
	Stop(ctx context.Context) error // the operator's is left running
	ClientEnv() []string
	Owned() bool
}

// HelloExpect is what a Hello must match beyond the protocol version.
type HelloExpect struct {
	Role  frmpsv1.Role
	PID   int
	Model string
	Pools []*frmpsv1.Pool // nil = any
}

// FrontDoor is the part of the OpenAI front door the failover needs.
type FrontDoor interface {
	OpenRequests() []*frmpsv1.ResumeRequest
}

// FrontendStatuser is a front door that runs as a process of its own
// (--frontend vllm): Status reports its state. FrontendStatus must not block.
type FrontendStatuser interface {
	FrontendStatus() *frmpsv1.FrontendStatus
}

// Deps binds the supervisor to its collaborators.
type Deps struct {
	Launcher      Launcher
	Listen        func(path string) (ControlListener, error)
	ValidateHello func(h *frmpsv1.Hello, want HelloExpect) error
	NewBroker     func() Broker
	// OpenRing creates the ring file (O_EXCL, 0600) and a reader on it.
	OpenRing func(path string, capacity uint64) (Ring, error)
	// StartMPS starts frmps's own daemon, or joins the operator's (Config.MPSPipeDir).
	StartMPS   func(ctx context.Context, runDir string, log hclog.Logger) (MPS, error)
	OutsideEnv func(runDir string) ([]string, error)
	// RunWait reads the run-queue wait (time runnable but not running) of
	// each thread of a process; ok false when it cannot. nil = CPU waits are
	// never excused (hang.go).
	RunWait func(pid int) (byThread map[int]time.Duration, ok bool)
	// CheckComputeMode refuses a GPU on which the standby cannot hold its own
	// context (visible: the engines' CUDA_VISIBLE_DEVICES); nil = no check.
	CheckComputeMode func(ctx context.Context, visible string) error
	// StopLeftoverMPS stops the private MPS daemon of a supervisor that
	// died (Config.StateDir); nil leaves such a run dir in place.
	StopLeftoverMPS leftover.StopMPS
	// Classify names a death: a metric-label class and a detail.
	Classify func(ws syscall.WaitStatus, lastStderr []string, reported *frmpsv1.Fault) (class, detail string)
	// DialGeneration connects to an engine's generation API (lazily).
	DialGeneration func(endpoint string) (frmpsv1.GenerationClient, io.Closer, error)
	// PrimeFault faults once on device (an index the env's CUDA_VISIBLE_DEVICES
	// sees) in a throwaway process with env (an MPS client's); its output and
	// nil when the fault happened (Config.PrimeFaultPath). nil: not available.
	PrimeFault func(ctx context.Context, env []string, device int) (string, error)
	// Spares starts engines ahead of need (spare.go); nil: engines always
	// start cold.
	Spares SpareLauncher
}

// SpareLauncher starts spares (engine processes started ahead of need, their
// imports done, the GPU untouched) and makes them engines.
type SpareLauncher interface {
	// StartSpare starts one with env, logging to logPath.
	StartSpare(env []string, logPath string, opts engine.SpareOptions) (Spare, error)
	// ActivateSpare makes sp the engine of role for inv, with env (which may
	// differ from the spare's own only in engine.ActivationVars).
	ActivateSpare(sp Spare, role failover.Role, inv engine.Invocation, env []string, logPath string) (Process, error)
}

// Spare is a started spare (engine.Spare).
type Spare interface {
	PID() int
	Done() <-chan struct{}
	Ready() <-chan struct{}
	ReadyLine() string
	WaitStatus() syscall.WaitStatus
	LastStderr() []string
	CheckEnv(env []string) error
	// Close sends it away unused: it exits, or is killed after grace.
	Close(grace time.Duration)
}

func (d Deps) missing() string {
	switch {
	case d.Launcher == nil:
		return "Launcher"
	case d.Listen == nil:
		return "Listen"
	case d.NewBroker == nil:
		return "NewBroker"
	case d.OpenRing == nil:
		return "OpenRing"
	case d.Classify == nil:
		return "Classify"
	case d.DialGeneration == nil:
		return "DialGeneration"
	case d.ValidateHello == nil:
		return "ValidateHello"
	}
	return ""
}

// ProcessLauncher launches real processes through an engine adapter.
type ProcessLauncher struct {
	Adapter engine.Adapter
	Log     hclog.Logger
}

var _ Launcher = ProcessLauncher{}

func (l ProcessLauncher) Launch(role failover.Role, inv engine.Invocation, env []string, logPath string) (Process, error) {
	path, args, err := l.Adapter.Command(inv)
	if err != nil {
		return nil, err
	}
	p, err := engine.Start(engine.Spec{Name: role.String(), Path: path, Args: args, Env: env, LogPath: logPath}, l.Log)
	if err != nil {
		return nil, err
	}
	return p, nil
}

var _ Process = (*engine.Process)(nil)

var (
	_ SpareLauncher = ProcessLauncher{}
	_ Spare         = (*engine.Spare)(nil)
)

// StartSpare implements SpareLauncher.
func (l ProcessLauncher) StartSpare(env []string, logPath string, opts engine.SpareOptions) (Spare, error) {
	sa, ok := l.Adapter.(engine.SpareAdapter)
	if !ok {
		return nil, fmt.Errorf("engine %s cannot be started ahead of need", l.Adapter.Name())
	}
	path, args, err := sa.SpareCommand(opts)
	if err != nil {
		return nil, err
	}
	sp, err := engine.StartSpare(engine.Spec{Name: "spare", Path: path, Args: args, Env: env, LogPath: logPath}, l.Log)
	if err != nil {
		return nil, err
	}
	return sp, nil
}

// ActivateSpare implements SpareLauncher.
func (l ProcessLauncher) ActivateSpare(sp Spare, role failover.Role, inv engine.Invocation, env []string, logPath string) (Process, error) {
	sa, ok := l.Adapter.(engine.SpareAdapter)
	es, ok2 := sp.(*engine.Spare)
	if !ok || !ok2 {
		return nil, errors.New("not a spare of this launcher")
	}
	args, err := sa.ServeArgs(inv)
	if err != nil {
		return nil, err
	}
	p, err := es.Activate(role.String(), args, env, logPath)
	if err != nil {
		return nil, err
	}
	return p, nil
}
