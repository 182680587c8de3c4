package supervisor

import (
	"fmt"
	"path/filepath"
	"slices"
	"time"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
	"github.com/frmps/frmps/supervisor/failover"
)

// What the loop does for the failover machine: step feeds it an event and
// execute carries out its actions, each through the owner it concerns (the
// pair, the failover run, failback, the ring, spares, the MPS daemon).
// Everything here runs on the loop goroutine.

// step feeds the machine and executes its actions.
func (s *Supervisor) step(ev failover.Event) {
	tr := s.machine.Handle(ev)
	if tr.Ignored {
		return
	}
	s.mu.Lock()
	s.state, s.stateCause = tr.To, tr.Cause
	s.mu.Unlock()
	s.crashLoopOpen.Store(s.machine.CrashLoopOpen())
	s.metrics.crashLoop(s.machine.CrashLoopOpen())
	if tr.From != tr.To || len(tr.Actions) > 0 {
		lvl := s.log.Info
		if tr.To == failover.CrashLoop || tr.To == failover.ServingDegraded {
			lvl = s.log.Error
		}
		lvl("state", "from", tr.From, "to", tr.To, "event", ev.Kind, "cause", tr.Cause, "actions", fmt.Sprint(tr.Actions))
	}
	s.execute(tr.Actions, ev)
	s.failback.noteStep(tr, s.machine.Handover())
	if tr.From == failover.HandingOver && tr.To != failover.HandingOver {
		if started, ok := s.failback.end(tr, s.pair.active); ok {
			s.failovers.awaitHandover(started, s.failback.noteFirstToken)
		}
	}
	if tr.To == failover.CrashLoop {
		s.unpublish(fmt.Errorf("%w: crash loop: %s", ErrUnavailable, tr.Cause))
		if !s.machine.EverServed() {
			s.giveUp(fmt.Errorf("no engine ever served: %s", tr.Cause))
		}
	}
	s.syncFailback()
}

func (s *Supervisor) execute(acts []failover.Action, ev failover.Event) {
	for _, a := range acts {
		switch a.Kind {
		case failover.FenceActive:
			a := s.pair.active
			// died() fenced a dead active already (a second Kill is harmless; with one
			// rank its group goes after this step, off the Resume's path); this also
			// fences an active given up without a death (a yielded engine not resumed).
			if a == nil || !a.groupPending {
				s.pair.fence(a)
			}
			if s.failovers.resuming(a) {
				s.failovers.abort(ev)
			}
			if !s.failovers.replacing(a) { // a failover's record classifies its own
				s.pair.classifyDeath(a)
			}
		case failover.FenceStandby:
			if sb := s.pair.dropStandby(); s.failovers.resuming(sb) {
				s.failovers.abort(ev)
			}
		case failover.DrainRing:
			s.ring.drain()
			s.failovers.drained()
		case failover.SendResume:
			if s.failovers.run == nil && s.machine.Handover() == failover.Resuming {
				s.failovers.begin(&failoverRun{kind: resumeHandover, target: s.pair.standby, detected: time.Now(), cause: "failback handover"})
			}
			s.sendResume()
		case failover.ResumeYielded:
			s.failovers.begin(&failoverRun{kind: resumeRestore, target: s.pair.active, detected: time.Now(), cause: "failback failed: restore the yielded engine"})
			s.sendResume()
		case failover.SendHandoff:
			s.cmdSeq++
			if why := s.failback.sendHandoff(s.pair.active, s.pair.standby, s.cmdSeq); why != "" {
				s.raise(failover.Event{Kind: failover.HandoffFailed, At: time.Now(), Cause: why})
			}
		case failover.Swap:
			s.pair.swap()
			s.failback.swapped()
			s.publish(s.pair.active)
		case failover.Promote:
			s.pair.promote()
			s.publish(s.pair.active)
		case failover.Publish:
			s.pair.serve()
			s.publish(s.pair.active)
		case failover.Unpublish:
			s.unpublish(nil)
			s.pair.dropDeadActive()
		case failover.StartActive, failover.StartStandby:
			role := failover.Active
			if a.Kind == failover.StartStandby {
				role = failover.Standby
			}
			s.pair.cancelStart(role)
			if a.Delay > 0 {
				s.pair.startLater(role, a.Delay)
			} else {
				s.start(role)
			}
		case failover.CheckMPS:
			s.mps.check()
		case failover.StopAll:
			s.stopAll(ev.Cause)
		}
	}
}

// start launches a new engine for role where the machine and the MPS daemon
// allow it now; a start into a daemon whose check is in progress waits for it.
func (s *Supervisor) start(role failover.Role) {
	if st, _ := s.machine.State(); st == failover.Stopped || st == failover.CrashLoop {
		return
	}
	if cur := s.pair.slotOf(role); cur != nil && !cur.dead {
		s.log.Error("not starting a second engine for a role", "role", role, "pid", cur.proc.PID())
		return
	}
	inMPS := s.placeInMPS(role)
	if inMPS && s.mps.busy {
		s.pair.waitForMPS(role) // launch into a daemon known to answer
		return
	}
	if role == failover.Active && s.mps.err != nil {
		s.raise(failover.Event{Kind: failover.BreakerTripped, Role: failover.Active, At: time.Now(), Cause: "MPS daemon does not answer: " + s.mps.err.Error()})
		return
	}
	s.pair.start(role, inMPS, func() ([]string, error) { return s.launchEnv(inMPS) })
}

// launchEnv is the environment of an engine launched inside MPS or outside it.
func (s *Supervisor) launchEnv(inMPS bool) ([]string, error) {
	env := s.engineEnv()
	if !s.mps.on() {
		return env, nil
	}
	if inMPS {
		return append(env, s.mps.clientEnv()...), nil
	}
	out, err := s.deps.OutsideEnv(s.runDir)
	if err != nil {
		return nil, fmt.Errorf("outside-MPS env: %w", err)
	}
	return append(env, out...), nil
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
	other := s.pair.standby
	if role == failover.Standby {
		other = s.pair.active
		if s.mps.err != nil || s.cfg.NoFailback {
			return false
		}
	}
	return other == nil || other.dead || !other.inMPS
}

// scheduleFailback arms the failback timer when the placement is inverted
// in serving_ready, and drops it otherwise. Called after every event.
func (s *Supervisor) scheduleFailback() {
	st, _ := s.machine.State()
	armed := s.failback.timer != nil
	s.failback.schedule(st == failover.ServingReady && s.pair.inverted())
	if !armed && s.failback.timer != nil {
		s.syncFailback()
	}
}

// syncFailback publishes the failback policy's state for Status.
func (s *Supervisor) syncFailback() {
	st, _ := s.machine.State()
	s.failback.sync(st, s.machine.Handover(), s.pair.placementOK(s.mps.on()))
}

// resumeSet is the open requests a Resume carries, each with the ring's
// snapshot of it.
func (s *Supervisor) resumeSet() []*frmpsv1.ResumeRequest {
	if s.frontDoor == nil {
		return nil
	}
	reqs := s.frontDoor.OpenRequests()
	s.ring.snapshots(reqs)
	return reqs
}

// sendResume sends the resume in progress its Resume (actions SendResume,
// ResumeYielded); a Resume that cannot go is a failed resume.
func (s *Supervisor) sendResume() {
	next := func() uint64 { s.cmdSeq++; return s.cmdSeq }
	if why := s.failovers.sendResume(s.resumeSet, next, s.ring.path); why != "" {
		s.raise(failover.Event{Kind: failover.ResumeFailed, At: time.Now(), Cause: why})
	}
}

// stopAll shuts the children down: Shutdown with a grace period, then the
// group kill. The loop exits after this.
func (s *Supervisor) stopAll(cause string) {
	s.setUnavailable(fmt.Errorf("%w: stopped (%s)", ErrUnavailable, cause))
	s.pair.stopStarts()
	s.failovers.stop()
	s.pair.shutdown(s.cfg.ShutdownGrace)
	s.spares.stop()
	s.wg.Wait()
	s.metrics.up(failover.Active, false)
	s.metrics.up(failover.Standby, false)
	s.log.Info("deployment stopped", "cause", cause)
}
