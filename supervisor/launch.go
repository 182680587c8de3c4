package supervisor

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"syscall"
	"time"

	"github.com/frmps/frmps/supervisor/engine"
	"github.com/frmps/frmps/supervisor/failover"
)

// Launching engines: the loop's side (a slot, its listener, its process, a
// delayed start, where it runs). Runs on the loop goroutine; the engine's own
// goroutine (engines.go) takes over once the process is started.

// cancelStart drops a pending delayed start of role.
func (s *Supervisor) cancelStart(role failover.Role) {
	if t := s.startAfter[role]; t != nil {
		t.Stop()
		s.startAfter[role] = nil
	}
	s.wantStart[role] = false
}

// start launches a new engine for role. A failure to launch is a death.
func (s *Supervisor) start(role failover.Role) {
	if st, _ := s.machine.State(); st == failover.Stopped || st == failover.CrashLoop {
		return
	}
	if cur := s.slotOf(role); cur != nil && !cur.dead {
		s.log.Error("not starting a second engine for a role", "role", role, "pid", cur.proc.PID())
		return
	}
	inMPS := s.placeInMPS(role)
	if inMPS && s.mps.busy {
		s.wantStart[role] = true // launch into a daemon known to answer
		return
	}
	if role == failover.Active && s.mps.err != nil {
		s.raise(failover.Event{Kind: failover.BreakerTripped, Role: failover.Active, At: time.Now(), Cause: "MPS daemon does not answer: " + s.mps.err.Error()})
		return
	}
	if role == failover.Active {
		// A cold start: the new active allocates fresh pools, so the old
		// layout and fds go.
		if old := s.broker; old != nil && len(old.Pools()) > 0 {
			s.mu.Lock()
			s.broker = s.deps.NewBroker()
			s.mu.Unlock()
			if err := old.Close(); err != nil {
				s.log.Warn("close fd broker", "error", err)
			}
		}
	}
	s.nextID++
	id := s.nextID
	inv := s.invocation(role, id)
	sl := &slot{id: id, role: role, started: time.Now(), state: "starting", inMPS: inMPS, genSocket: inv.GenerationSocket, ctlSocket: inv.ControlSocket}
	sl.restartNo = s.metrics.started(role)
	fail := func(err error) {
		sl.proc = deadProcess{}
		sl.listener = nopListener{}
		sl.cancel = func() {}
		if role == failover.Active {
			s.active = sl
		} else {
			s.standby = sl
		}
		s.enqueue(event{kind: evDied, slot: sl, cause: "launch failed: " + err.Error(), at: time.Now()})
	}
	env := s.engineEnv()
	if s.mps.on() {
		if inMPS {
			env = append(env, s.mps.clientEnv()...)
		} else {
			out, err := s.deps.OutsideEnv(s.runDir)
			if err != nil {
				fail(fmt.Errorf("outside-MPS env: %w", err))
				return
			}
			env = append(env, out...)
		}
	}
	l, err := s.deps.Listen(inv.ControlSocket)
	if err != nil {
		fail(fmt.Errorf("listen on control socket: %w", err))
		return
	}
	logPath := filepath.Join(s.logDir, fmt.Sprintf("%s-%d.log", role, id))
	proc, fromSpare := s.spares.launch(role, inv, env, logPath)
	if !fromSpare {
		if proc, err = s.deps.Launcher.Launch(role, inv, env, logPath); err != nil {
			_ = l.Close()
			fail(err)
			return
		}
	}
	s.metrics.launched(fromSpare)
	sl.fromSpare = fromSpare
	ctx, cancel := context.WithCancel(context.Background())
	sl.proc, sl.listener, sl.cancel = proc, l, cancel
	if role == failover.Active {
		s.active = sl
	} else {
		s.standby = sl
	}
	s.slots[sl] = struct{}{}
	s.log.Info("engine launched", "role", role, "pid", proc.PID(), "log", proc.LogPath(), "in_mps", sl.inMPS, "from_spare", fromSpare)
	s.wg.Add(2)
	go func() {
		defer s.wg.Done()
		select {
		case <-proc.Done():
			s.post(event{kind: evDied, slot: sl, cause: "process exited: " + describeExit(proc.WaitStatus()), at: time.Now()})
		case <-s.stopped:
		}
	}()
	go func() {
		defer s.wg.Done()
		s.runEngine(ctx, sl)
	}()
}

// engineEnv is the environment every engine and every spare starts from.
func (s *Supervisor) engineEnv() []string {
	env := slices.Clone(s.cfg.BaseEnv)
	return append(env, "FRMPS_MODULES_FILE="+s.modulesFile())
}

// modulesFile: where the first served engine lists its modules for spares.
func (s *Supervisor) modulesFile() string { return filepath.Join(s.runDir, "engine-modules.txt") }

// placeInMPS decides where a new engine of role runs: inside MPS unless the
// other engine is there (after a failover the promoted active runs outside,
// so its fresh standby goes in, and failback swaps them). A standby stays out
// while the daemon is known broken, or when failback is off; an active waits
// for the daemon (or trips the breaker) in start.
func (s *Supervisor) placeInMPS(role failover.Role) bool {
	if !s.mps.on() {
		return false
	}
	other := s.slotOf(failover.Standby)
	if role == failover.Standby {
		other = s.slotOf(failover.Active)
		if s.mps.err != nil || s.cfg.NoFailback {
			return false
		}
	}
	return other == nil || other.dead || !other.inMPS
}

// dialGeneration prepares the client of a ready engine's generation API
// (lazily connected), so promoting it later costs nothing.
func (s *Supervisor) dialGeneration(sl *slot) error {
	sl.mu.Lock()
	endpoint := sl.hello.GetGenerationEndpoint()
	sl.mu.Unlock()
	if endpoint == "" {
		endpoint = "unix://" + sl.genSocket
	}
	c, closer, err := s.deps.DialGeneration(endpoint)
	if err != nil {
		return fmt.Errorf("generation API %s: %w", endpoint, err)
	}
	sl.gen, sl.genC = c, closer
	return nil
}

// describeExit names how a process ended (an engine, a spare).
func describeExit(ws syscall.WaitStatus) string {
	switch {
	case ws.Signaled():
		return fmt.Sprintf("killed by signal %d", int(ws.Signal()))
	case ws.Exited():
		return fmt.Sprintf("exit code %d", ws.ExitStatus())
	}
	return "unknown status"
}

// deadProcess stands in for an engine that never started.
type deadProcess struct{}

func (deadProcess) PID() int                       { return 0 }
func (deadProcess) Done() <-chan struct{}          { return closedCh }
func (deadProcess) WaitStatus() syscall.WaitStatus { return 0 }
func (deadProcess) LastStderr() []string           { return nil }
func (deadProcess) Kill() error                    { return nil }
func (deadProcess) KillLeader() error              { return nil }
func (deadProcess) LogPath() string                { return "" }

type nopListener struct{}

func (nopListener) Accept(context.Context, int) (ControlConn, error) {
	return nil, errors.New("no listener")
}

func (nopListener) Close() error { return nil }

func (s *Supervisor) invocation(role failover.Role, id int) engine.Invocation {
	r := engine.RoleActive
	if role == failover.Standby {
		r = engine.RoleStandby
	}
	return engine.Invocation{
		Role:                 r,
		Model:                s.cfg.Model,
		ControlSocket:        filepath.Join(s.runDir, fmt.Sprintf("ctl-%d.sock", id)),
		GenerationSocket:     filepath.Join(s.runDir, fmt.Sprintf("gen-%d.sock", id)),
		Memory:               s.cfg.Memory,
		Device:               s.cfg.Device,
		NumBlocks:            s.launchBlocks(),
		MaxModelLen:          s.cfg.MaxModelLen,
		GPUMemoryUtilization: s.cfg.GPUMemoryUtilization,
		TensorParallelSize:   s.cfg.TensorParallelSize,
		ExtraArgs:            s.cfg.EngineArgs,
		CoreInput:            s.cfg.EngineCoreInput,
		CoreOutput:           s.cfg.EngineCoreOutput,
	}
}

var closedCh = func() chan struct{} { c := make(chan struct{}); close(c); return c }()

// placementInverted: the active runs outside MPS and a ready standby inside.
func (s *Supervisor) placementInverted() bool {
	a, sb := s.active, s.standby
	return a != nil && sb != nil && !a.dead && !sb.dead && !a.inMPS && sb.inMPS && sb.state == "ready"
}

// placementOK: the active runs in MPS and the standby (if any) outside it,
// or MPS is off.
func (s *Supervisor) placementOK() bool {
	if !s.mps.on() {
		return true
	}
	a, sb := s.active, s.standby
	if a == nil || a.dead || !a.inMPS {
		return false
	}
	return sb == nil || sb.dead || !sb.inMPS
}

// scheduleFailback arms the failback timer when the placement is inverted
// in serving_ready, and drops it otherwise. Called after every event.
func (s *Supervisor) scheduleFailback() {
	st, _ := s.machine.State()
	armed := s.failback.timer != nil
	s.failback.schedule(st == failover.ServingReady && s.placementInverted())
	if !armed && s.failback.timer != nil {
		s.syncFailback()
	}
}

// syncFailback publishes the failback policy's state for Status.
func (s *Supervisor) syncFailback() {
	st, _ := s.machine.State()
	s.failback.sync(st, s.machine.Handover(), s.placementOK())
}

// swap makes the resumed standby the active and the yielded active the
// standby (action Swap).
func (s *Supervisor) swap() {
	yielded, next := s.active, s.standby
	s.active, s.standby = next, nil
	next.mu.Lock()
	next.role = failover.Active
	next.beats.stepSince = time.Now() // it slept until now
	next.mu.Unlock()
	next.setState("serving")
	if yielded != nil && !yielded.dead {
		yielded.mu.Lock()
		yielded.role = failover.Standby
		yielded.beats = beats{} // asleep: judged afresh once it serves again
		yielded.mu.Unlock()
		s.standby = yielded
	} else if yielded != nil {
		s.retire(yielded)
	}
	s.metrics.up(failover.Active, true)
	s.metrics.up(failover.Standby, s.standby != nil)
	s.failback.swapped()
	s.publish(s.active)
}
