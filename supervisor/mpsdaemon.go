package supervisor

import (
	"context"
	"fmt"
	"sync"
	"syscall"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/frmps/frmps/supervisor/mps"
)

// mpsDaemon owns the MPS daemon the engines run in: whether it answers (its
// check is in progress, or failed), when an active inside it last died, and
// whether its server reported a fatal GPU error (loop-owned); and the state
// Status shows of it (under mu). setup starts the daemon and cleanup stops
// it, outside the loop.
type mpsDaemon struct {
	log          hclog.Logger
	post         func(event)     // to the loop, from the check and the log watcher
	wg           *sync.WaitGroup // the check, waited for at shutdown
	window       time.Duration   // Config.MPSRecoveryWindow (< 0: off)
	noFaultWatch bool            // Config.NoMPSFaultWatch

	d    MPS  // nil: no MPS
	busy bool // a check or restart is in progress
	err  error
	// lastDeath: when an active inside MPS last died (the MPS server may still
	// be recovering; see Config.MPSRecoveryWindow).
	lastDeath time.Time
	// faulted: the MPS server said it tore the active's context down after a
	// fatal GPU error (mps_fault); the next check restarts frmps's own daemon,
	// whose server broke new clients for seconds after such a fault.
	faulted bool

	mu    sync.Mutex
	state string
}

// on: the engines run with MPS.
func (m *mpsDaemon) on() bool { return m.d != nil }

func (m *mpsDaemon) setState(st string) {
	m.mu.Lock()
	m.state = st
	m.mu.Unlock()
}

// shownState is what Status shows of the daemon.
func (m *mpsDaemon) shownState() string {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.state
}

// clientEnv is the environment that puts an engine inside MPS.
func (m *mpsDaemon) clientEnv() []string { return m.d.ClientEnv() }

// stop stops the daemon (cleanup); idempotent.
func (m *mpsDaemon) stop() {
	if m.d == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	if err := m.d.Stop(ctx); err != nil {
		m.log.Warn("stop MPS", "error", err)
	}
	cancel()
	m.d = nil
	m.setState("stopped")
}

// check checks the daemon off the loop (action CheckMPS), restarting it
// where it does not answer; evMPSChecked carries the outcome (checked).
func (m *mpsDaemon) check() {
	if m.d == nil || m.busy {
		return
	}
	m.busy = true
	d := m.d
	// After a fatal GPU error the server that handled it lives on, and clients
	// that join it in the next seconds can crash at start (H100, driver 580:
	// segfaults up to 40 s after the fault): restart our own daemon so the
	// engine launched into MPS next gets a fresh server. No client of it is
	// left (every client was torn down with the fault). The operator's
	// daemon is never restarted: there the launch is retried instead.
	fresh := m.faulted && d.Owned()
	m.faulted = false
	m.wg.Add(1)
	go func() {
		defer m.wg.Done()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		var err error
		if fresh {
			m.log.Info("restarting the MPS daemon after a fatal GPU error: a fresh server for the next engine")
			m.setState("restarting")
			if err = d.Recover(ctx); err != nil {
				m.log.Warn("MPS restart after the fault", "error", err)
			} else {
				m.setState("running (restarted after a fatal GPU error)")
			}
		}
		if err == nil {
			err = d.Check(ctx)
		}
		if err != nil {
			what, recovered := "restart MPS", "running (restarted)"
			if d.Owned() {
				m.log.Warn("MPS daemon does not answer; restarting it", "error", err)
				m.setState("restarting")
			} else {
				what, recovered = "the operator's MPS daemon", "joined (the operator's daemon answers again)"
				m.log.Warn("the operator's MPS daemon does not answer; waiting for it (frmps never restarts it)", "error", err)
				m.setState("waiting for the operator's daemon")
			}
			if err = d.Recover(ctx); err != nil {
				err = fmt.Errorf("%s: %w", what, err)
				m.log.Error("MPS daemon unusable: no active can start in it", "error", err)
				m.setState("failed: " + err.Error())
			} else {
				m.setState(recovered)
			}
		}
		m.post(event{kind: evMPSChecked, err: err, at: time.Now()})
	}()
}

// checked takes the check's outcome (evMPSChecked).
func (m *mpsDaemon) checked(err error) { m.busy, m.err = false, err }

// activeDied notes that an active inside MPS died at at.
func (m *mpsDaemon) activeDied(at time.Time) { m.lastDeath = at }

// notAdmitted: a standby launched into MPS within the recovery window of an
// MPS active's death, which did not exit with the engines' refusal code.
func (m *mpsDaemon) notAdmitted(sl *slot, at time.Time) bool {
	if !sl.inMPS || m.lastDeath.IsZero() || m.window < 0 || at.Sub(m.lastDeath) > m.window {
		return false
	}
	select {
	case <-sl.proc.Done():
		ws := sl.proc.WaitStatus()
		return !(ws.Exited() && ws.ExitStatus() == engineExitRefused)
	default:
		return true // its exit status is not known yet
	}
}

// tearsDown says whether the server's teardown (evMPSTeardown) is of the
// active's context: its leader, or a CUDA client in its process group (a TP
// rank), which dooms the active too. The next check then restarts the daemon.
func (m *mpsDaemon) tearsDown(active *slot, ev event) bool {
	if active == nil || active.dead || !active.inMPS {
		return false
	}
	pid := active.proc.PID()
	if ev.pid != pid && !inProcessGroup(ev.pid, pid) {
		return false
	}
	m.faulted = true
	return true
}

// inProcessGroup: pid is alive in the process group pgid.
func inProcessGroup(pid, pgid int) bool {
	g, err := syscall.Getpgid(pid)
	return err == nil && g == pgid
}

// watchLog follows the MPS server's log (the early fault signal) until ctx
// ends; the channel closes when the watcher has returned. Nothing to follow
// without MPS, with the watch turned off, or with an operator's daemon whose
// log directory frmps was not given.
func (m *mpsDaemon) watchLog(ctx context.Context) <-chan struct{} {
	done := make(chan struct{})
	logged, ok := m.d.(interface{ LogDir() string })
	if m.noFaultWatch || !ok || logged.LogDir() == "" {
		close(done)
		return done
	}
	path := mps.ServerLogPath(logged.LogDir())
	m.log.Debug("following the MPS server's log for early fault signals", "path", path)
	w := mps.OpenServerLog(path) // what the log holds now is history
	go func() {
		defer close(done)
		w.Watch(ctx, 0, func(t mps.Teardown) {
			m.post(event{kind: evMPSTeardown, pid: t.PID, cause: t.Line, at: t.Seen})
		})
	}()
	return done
}
