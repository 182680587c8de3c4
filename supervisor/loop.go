package supervisor

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"time"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
	"github.com/frmps/frmps/supervisor/deathcause"
	"github.com/frmps/frmps/supervisor/failover"
)

// The event loop. Run's goroutine owns every field of Supervisor marked
// loop-owned; everything in this file runs on it. Other goroutines reach it
// only through post (events) and the fields guarded by s.mu.

type evKind int

const (
	evReady         evKind = iota // slot finished its handshake
	evDied                        // socket EOF, process exit, refused handshake
	evReply                       // a Reply on a slot's control socket
	evStartDue                    // a delayed start's backoff elapsed
	evResumeTimeout               // Resume got no reply in time
	evDrill                       // admin: kill the active on purpose
	evMPSChecked                  // CheckMPS finished
	evShutdown
	evStep           // a machine event raised while executing actions (no re-entrant steps)
	evHandoverDue    // the failback policy's timer fired
	evHandoffTimeout // Handoff got no reply in time
	evPing           // Alive: the loop answers
	evMPSTeardown    // the MPS server tears a client's context down (mps.ServerLog)
	evSpareReady     // the spare's imports are done (spare.go)
	evSpareDied      // the spare process exited
	evSpareDue       // the backoff after a failed spare elapsed
)

type event struct {
	kind  evKind
	slot  *slot
	role  failover.Role
	cause string
	at    time.Time
	reply *frmpsv1.Reply
	id    uint64
	err   error
	resp  chan error // evDrill, evPing
	pid   int        // evMPSTeardown: the client the server tears down
	fev   failover.Event
	spare Spare // evSpareReady, evSpareDied
}

func (s *Supervisor) handle(ev event) {
	switch ev.kind {
	case evReady:
		if ev.slot.dead || !s.isLive(ev.slot) {
			return
		}
		if err := s.dialGeneration(ev.slot); err != nil {
			s.died(ev.slot, err.Error(), ev.at, "")
			return
		}
		ev.slot.setState("ready")
		if ev.slot.role == failover.Active {
			s.metrics.up(failover.Active, true)
			s.step(failover.Event{Kind: failover.ActiveReady, At: ev.at, Cause: "handshake done"})
		} else {
			s.metrics.up(failover.Standby, true)
			s.step(failover.Event{Kind: failover.StandbyReady, At: ev.at, Cause: "asleep with the brokered pools"})
		}
	case evDied:
		s.died(ev.slot, ev.cause, ev.at, "")
	case evReply:
		if fev, ok := s.failback.reply(ev, s.active); ok {
			s.step(fev)
			break
		}
		fev, acked, ok := s.failovers.answer(ev)
		if !ok {
			return // a stale or unsolicited reply
		}
		s.step(fev)
		if acked != nil {
			s.failovers.finish(acked, ev.at, ev.reply)
		}
	case evResumeTimeout:
		if s.failovers.timedOut(ev) {
			s.step(failover.Event{Kind: failover.ResumeFailed, At: ev.at, Cause: fmt.Sprintf("no reply to resume within %s", s.cfg.ResumeTimeout)})
		}
	case evStartDue:
		if t := s.startAfter[ev.role]; t == nil || ev.id != s.startSeq[ev.role] {
			return // cancelled after it fired
		}
		s.startAfter[ev.role] = nil
		s.start(ev.role)
	case evMPSChecked:
		s.mps.checked(ev.err)
		for _, r := range []failover.Role{failover.Active, failover.Standby} {
			if s.wantStart[r] {
				s.wantStart[r] = false
				s.start(r)
			}
		}
	case evDrill:
		st, _ := s.machine.State()
		if st != failover.ServingReady || s.active == nil {
			ev.resp <- fmt.Errorf("no failover possible in state %s: it needs a ready standby", st)
			return
		}
		ev.resp <- nil
		s.log.Info("failover drill: killing the active", "pid", s.active.proc.PID(), "reason", ev.cause)
		s.died(s.active, "drill: "+ev.cause, ev.at, classDrill)
	case evShutdown:
		s.step(failover.Event{Kind: failover.Shutdown, At: ev.at, Cause: ev.cause})
	case evStep:
		s.step(ev.fev)
	case evHandoverDue:
		if s.failback.fire(ev) && s.placementInverted() {
			s.step(failover.Event{Kind: failover.HandoverDue, At: ev.at,
				Cause: fmt.Sprintf("active pid %d outside MPS, standby pid %d inside", s.active.proc.PID(), s.standby.proc.PID())})
		}
	case evHandoffTimeout:
		if s.failback.timedOut(ev) {
			s.died(s.active, fmt.Sprintf("stalled: no reply to handoff within %s", s.cfg.HandoffTimeout), ev.at, classStalled)
		}
	case evPing:
		ev.resp <- nil
	case evMPSTeardown:
		// The server writes these lines while it handles a fatal GPU error, having
		// stopped its clients' work: the active's context is lost already, and it
		// would notice only at its next CUDA call's error (tens to hundreds of ms
		// later). Fenced now, it can no longer write the KV cache the standby takes.
		if sl := s.active; s.mps.tearsDown(sl, ev) {
			s.died(sl, "MPS server: "+ev.cause, ev.at, classMPSFault)
			s.log.Warn("the MPS server tore the active's context down; failing over", "pid", sl.proc.PID(), "client", ev.pid, "line", ev.cause)
		}
	case evSpareReady:
		s.spares.ready(ev)
	case evSpareDied:
		s.spares.died(ev)
	case evSpareDue:
		s.spares.due(ev)
	}
	s.reap()
	s.syncShown()
	s.scheduleFailback()
	st, _ := s.machine.State()
	s.spares.fill(st)
}

// reap forgets retired slots whose process is gone (a handful at most),
// and removes their socket files: nothing listens on them any more.
func (s *Supervisor) reap() {
	for sl := range s.slots {
		if s.isLive(sl) {
			continue
		}
		select {
		case <-sl.proc.Done():
			delete(s.slots, sl)
			for _, p := range []string{sl.genSocket, sl.ctlSocket} {
				if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
					s.log.Warn("remove a dead engine's socket", "path", p, "error", err)
				}
			}
		default:
		}
	}
}

// checkStall fences the serving active when hang detection judges it wedged
// (hang.go): its heartbeats stopped, or its step in progress overran its bound.
func (s *Supervisor) checkStall(now time.Time) {
	sl := s.active
	if sl == nil || sl.dead {
		return
	}
	if st, _ := s.machine.State(); !st.Serving() {
		return
	}
	class, detail := s.hang.judge(sl, now)
	if class == "" {
		return
	}
	s.log.Error("active engine is wedged; fencing it", "pid", sl.proc.PID(), "class", class, "detail", detail)
	s.died(sl, detail, now, class)
}

// raise queues a machine event from inside an action.
func (s *Supervisor) raise(ev failover.Event) { s.enqueue(event{kind: evStep, fev: ev}) }

func (s *Supervisor) slotOf(r failover.Role) *slot {
	if r == failover.Active {
		return s.active
	}
	return s.standby
}

func (s *Supervisor) isLive(sl *slot) bool { return sl == s.active || sl == s.standby }

// died handles the first report of a slot's death; later ones are ignored.
// class names the death when it is known without looking at the exit
// (a drill, a stall): the fence's SIGKILL would otherwise be the cause.
func (s *Supervisor) died(sl *slot, cause string, at time.Time, class string) {
	handled := time.Now()
	if sl == nil || sl.dead || !s.isLive(sl) {
		return
	}
	sl.dead = true
	// An active that dies before it was ready while nothing has served yet:
	// nobody waits on its fence (no standby, no requests), so first let it
	// exit on its own, for its exit code (the engines' refusal of their
	// options) and its stderr's reason, which the SIGKILL would hide.
	sl.mu.Lock()
	starting := sl.state == "starting"
	refusedHello := sl.refused != ""
	sl.mu.Unlock()
	var refusedStart bool
	if sl.role == failover.Active && starting && !s.machine.EverServed() {
		var why string
		refusedStart, why = s.startFailure(sl)
		refusedStart = refusedStart || refusedHello
		if why != "" && !strings.Contains(cause, why) {
			cause += ": " + why
		}
	}
	// A dead active is fenced in every state the machine takes its death up in
	// (FenceActive): do it first, before the log lines and the machine's step
	// below, all on the way to the standby's Resume. (On the GPU host moving
	// them did not shorten that way: its 0.5-1.6 ms are the SIGKILL itself,
	// see fenceFirst.)
	var fenced time.Time
	if sl.role == failover.Active {
		s.fenceFirst(sl)
		fenced = time.Now()
	}
	sl.mu.Lock()
	wasReady := sl.state == "ready" || sl.state == "serving"
	refused := sl.refused != ""
	if refused && !strings.HasPrefix(cause, "hello refused") {
		cause = sl.refused + " (" + cause + ")"
	}
	sl.state = "dead"
	sl.deathCause = cause
	sl.mu.Unlock()
	sl.deathClass = class
	s.mu.Lock()
	s.lastDead[sl.role] = sl
	s.mu.Unlock()
	s.metrics.up(sl.role, false)
	if refused {
		s.log.Error("engine refused", "role", sl.role, "pid", sl.proc.PID(), "cause", cause)
	} else {
		s.log.Warn("engine died", "role", sl.role, "pid", sl.proc.PID(), "cause", cause)
	}
	kind := failover.StandbyDied
	switch {
	case sl.role == failover.Active:
		kind = failover.ActiveDied
		if sl.inMPS {
			s.mps.activeDied(at)
			s.failback.lost(at)
		}
	case !wasReady && !refused && s.mps.notAdmitted(sl, at):
		kind = failover.StandbyNotAdmitted
		s.log.Warn("standby in MPS died at start-up while the MPS server recovers from the active's death; relaunching it without counting it against the breaker",
			"pid", sl.proc.PID(), "since_active_death", at.Sub(s.mps.lastDeath).Round(time.Millisecond), "cause", cause)
	}
	st, _ := s.machine.State()
	if kind == failover.ActiveDied && (st == failover.ServingReady || s.machine.Handover() == failover.Yielding) {
		s.failovers.begin(&failoverRun{kind: resumeFailover, target: s.standby, detected: at, handled: handled, fenced: fenced,
			cause: cause, old: sl, class: class})
	}
	s.step(failover.Event{Kind: kind, At: at, Cause: cause, Refused: refusedStart})
	if sl.groupPending { // after the step's Resume, if it sent one
		sl.groupPending = false
		s.fence(sl)
		s.failovers.groupFenced(sl)
	}
}

// startExitWait bounds how long died waits for an active that died before
// it was ready to exit on its own (its control socket closes as it exits).
const startExitWait = time.Second

// startFailure waits (bounded) for an engine that failed to start to exit,
// and says whether it exited with the engines' refusal code and the line of
// its stderr that says why.
func (s *Supervisor) startFailure(sl *slot) (refused bool, why string) {
	select {
	case <-sl.proc.Done():
	case <-time.After(startExitWait):
		return false, ""
	}
	ws := sl.proc.WaitStatus()
	return ws.Exited() && ws.ExitStatus() == engineExitRefused, deathcause.Reason(sl.proc.LastStderr())
}

// engineExitRefused is the engines' exit code for "refused at start" (bad
// configuration, pool mismatch): never the MPS server's doing (ENGINE.md).
const engineExitRefused = 2

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
		if started, ok := s.failback.end(tr, s.active); ok {
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
			a := s.active
			// died() fenced a dead active already (a second Kill is harmless; with one
			// rank its group goes after this step, off the Resume's path); this also
			// fences an active given up without a death (a yielded engine not resumed).
			if a == nil || !a.groupPending {
				s.fence(a)
			}
			if s.failovers.resuming(a) {
				s.failovers.abort(ev)
			}
			if !s.failovers.replacing(a) { // a failover's record classifies its own
				s.classifyDeath(a)
			}
		case failover.FenceStandby:
			s.cancelStart(failover.Standby) // a backoff pending for the dead standby
			sb := s.standby
			s.standby = nil
			s.fence(sb)
			s.retire(sb)
			s.classifyDeath(sb)
			if s.failovers.resuming(sb) {
				s.failovers.abort(ev)
			}
		case failover.DrainRing:
			s.ring.drain()
			s.failovers.drained()
		case failover.SendResume:
			if s.failovers.run == nil && s.machine.Handover() == failover.Resuming {
				s.failovers.begin(&failoverRun{kind: resumeHandover, target: s.standby, detected: time.Now(), cause: "failback handover"})
			}
			s.sendResume()
		case failover.ResumeYielded:
			s.failovers.begin(&failoverRun{kind: resumeRestore, target: s.active, detected: time.Now(), cause: "failback failed: restore the yielded engine"})
			s.sendResume()
		case failover.SendHandoff:
			s.cmdSeq++
			if why := s.failback.sendHandoff(s.active, s.standby, s.cmdSeq); why != "" {
				s.raise(failover.Event{Kind: failover.HandoffFailed, At: time.Now(), Cause: why})
			}
		case failover.Swap:
			s.swap()
		case failover.Promote:
			old := s.active
			s.active, s.standby = s.standby, nil
			s.active.mu.Lock() // Status and the reader read role concurrently
			s.active.role = failover.Active
			s.active.beats.stepSince = time.Now() // it slept until now
			s.active.mu.Unlock()
			s.active.setState("serving")
			s.metrics.up(failover.Active, true)
			s.metrics.up(failover.Standby, false)
			s.retire(old)
			s.publish(s.active)
		case failover.Publish:
			s.active.setState("serving")
			s.metrics.up(failover.Active, true)
			s.publish(s.active)
		case failover.Unpublish:
			s.unpublish(nil)
			if a := s.active; a != nil && a.dead {
				s.active = nil
				s.retire(a)
			}
		case failover.StartActive, failover.StartStandby:
			role := failover.Active
			if a.Kind == failover.StartStandby {
				role = failover.Standby
			}
			s.cancelStart(role)
			if a.Delay > 0 {
				s.startSeq[role]++
				seq := s.startSeq[role]
				s.startAfter[role] = time.AfterFunc(a.Delay, func() { s.post(event{kind: evStartDue, role: role, id: seq, at: time.Now()}) })
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

// fenceFirst fences a dead active on the way to the standby's Resume. With
// one rank it kills the leader only, the one process that writes the pools,
// the ring and the streams, and died fences the group after the step: a
// SIGKILL costs its sender a wake-up of every thread it reaches (3-4 µs each
// on the GPU host, bench/gpu/kill_cost_probe.py), so helper processes in the
// group (compile workers, say) stay off the Resume's path. The leader's own
// threads do not: a serving vLLM engine had ~219 and its SIGKILL took
// 0.6-1.6 ms (bench/results/2026-11-28-h200x2-vllm-fence/). The ranks of a
// tensor-parallel engine are processes of its group that write the KV cache:
// the whole group then.
func (s *Supervisor) fenceFirst(sl *slot) {
	if s.cfg.TensorParallelSize > 1 {
		s.fence(sl)
		return
	}
	if err := sl.proc.KillLeader(); err != nil {
		s.log.Error("fence engine", "role", sl.role, "pid", sl.proc.PID(), "error", err)
		s.fence(sl) // the group then, at once
		return
	}
	sl.dead = true
	sl.groupPending = true
}

// fence kills a slot's process group; the slot stays until retired.
func (s *Supervisor) fence(sl *slot) {
	if sl == nil {
		return
	}
	if err := sl.proc.Kill(); err != nil {
		s.log.Error("fence engine", "role", sl.role, "pid", sl.proc.PID(), "error", err)
	}
	sl.dead = true
}

// retire closes a fenced slot's connection and socket; its goroutines end
// and its process is reaped by the launcher.
func (s *Supervisor) retire(sl *slot) {
	if sl == nil {
		return
	}
	sl.cancel()
	if c := sl.getConn(); c != nil {
		_ = c.Close()
	}
	if err := sl.listener.Close(); err != nil {
		s.log.Debug("close control listener", "error", err)
	}
	if sl.genC != nil {
		_ = sl.genC.Close()
		sl.genC = nil
	}
}

// classifyDeath names a dead engine's death from its exit once it is reaped,
// for a death no failover record classifies (a standby's; an active's while
// starting or with no standby): the control socket only says that it closed,
// or that the handshake broke, where the exit and the engine's last stderr
// line say why (a start that fails every time, say).
func (s *Supervisor) classifyDeath(sl *slot) {
	if sl == nil || !sl.dead || sl.deathClass != "" {
		return
	}
	role := sl.role
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		class, detail := s.classify(sl)
		sl.mu.Lock()
		cause := sl.deathCause
		sl.deathCause = class + ": " + detail
		sl.mu.Unlock()
		s.log.Warn("engine death", "role", role, "pid", sl.proc.PID(), "class", class, "detail", detail, "seen_as", cause,
			"log", sl.proc.LogPath())
	}()
}

// classify waits (bounded) for the fenced process to be reaped.
func (s *Supervisor) classify(sl *slot) (string, string) {
	select {
	case <-sl.proc.Done():
	case <-time.After(5 * time.Second):
		return "unknown", "engine not reaped within 5s of the fence"
	}
	sl.mu.Lock()
	fault := sl.fault
	sl.mu.Unlock()
	return s.deps.Classify(sl.proc.WaitStatus(), sl.proc.LastStderr(), fault)
}

// stopAll shuts the children down: Shutdown with a grace period, then the
// group kill. The loop exits after this.
func (s *Supervisor) stopAll(cause string) {
	s.setUnavailable(fmt.Errorf("%w: stopped (%s)", ErrUnavailable, cause))
	for r := range s.startAfter {
		if t := s.startAfter[r]; t != nil {
			t.Stop()
		}
	}
	s.failovers.stop()
	grace := s.cfg.ShutdownGrace
	for sl := range s.slots {
		c := sl.getConn()
		switch {
		case sl.dead:
		case c == nil: // not connected yet: nobody to ask politely
			s.fence(sl)
		default:
			if err := c.Send(&frmpsv1.Envelope{Msg: &frmpsv1.Envelope_Shutdown{Shutdown: &frmpsv1.Shutdown{GraceMs: uint32(grace.Milliseconds())}}}, nil); err != nil {
				s.fence(sl)
			}
		}
	}
	deadline := time.NewTimer(grace)
	defer deadline.Stop()
	for sl := range s.slots {
		select {
		case <-sl.proc.Done():
		case <-deadline.C:
			deadline.Reset(0) // the rest get no more grace
		}
	}
	for sl := range s.slots {
		s.fence(sl)
		s.retire(sl)
	}
	for sl := range s.slots {
		select {
		case <-sl.proc.Done():
		case <-time.After(10 * time.Second):
			s.log.Error("engine survived SIGKILL", "pid", sl.proc.PID())
		}
		delete(s.slots, sl)
	}
	s.active, s.standby = nil, nil
	s.spares.stop()
	s.wg.Wait()
	s.metrics.up(failover.Active, false)
	s.metrics.up(failover.Standby, false)
	s.log.Info("deployment stopped", "cause", cause)
}

// Run starts the deployment and supervises it until ctx ends, then shuts
// everything down. It returns an error when the deployment cannot start.
func (s *Supervisor) Run(ctx context.Context) (retErr error) {
	if !s.ran.CompareAndSwap(false, true) {
		return errors.New("supervisor: Run called twice")
	}
	defer close(s.stopped)
	if err := s.setup(ctx); err != nil {
		s.cleanup()
		s.setUnavailable(fmt.Errorf("%w: %v", ErrUnavailable, err))
		return err
	}
	pollCtx, stopPoll := context.WithCancel(context.Background())
	pollDone := make(chan struct{})
	go func() { defer close(pollDone); s.ring.poll(pollCtx) }()
	watchDone := s.mps.watchLog(pollCtx)
	defer func() {
		stopPoll()
		<-pollDone
		<-watchDone
		s.cleanup()
	}()

	s.log.Info("deployment starting", "model", s.cfg.Model, "engine", s.cfg.Engine, "run_dir", s.runDir, "ring", s.ring.path, "mps", !s.cfg.NoMPS)
	s.spares.sync()
	s.failback.enabled = s.mps.on() && !s.cfg.NoFailback
	s.execute(s.machine.Initial(), failover.Event{At: time.Now()})
	done := ctx.Done()
	feed, stopFeed := s.watchdogTick()
	defer stopFeed()
	var watchdog <-chan time.Time
	if p := s.hang.policy; p.enabled() {
		t := time.NewTicker(p.tick())
		defer t.Stop()
		watchdog = t.C
	}
	for {
		for len(s.pending) > 0 {
			ev := s.pending[0]
			s.pending = s.pending[1:]
			s.handle(ev)
		}
		if st, _ := s.machine.State(); st == failover.Stopped {
			return nil
		}
		select {
		case <-done:
			done = nil
			s.enqueue(event{kind: evShutdown, cause: "context done", at: time.Now()})
		case ev := <-s.events:
			s.handle(ev)
		case now := <-watchdog:
			s.checkStall(now)
			s.reap()
			s.syncShown()
		case <-feed:
			s.watchdog.Feed()
		}
	}
}

// post hands an event to the loop from another goroutine; dropped once the
// loop has exited.
func (s *Supervisor) post(ev event) {
	select {
	case s.events <- ev:
	case <-s.stopped:
	}
}

// enqueue queues an event from inside the loop.
func (s *Supervisor) enqueue(ev event) { s.pending = append(s.pending, ev) }
