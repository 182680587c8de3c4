package supervisor

import (
	"context"
	"errors"
	"fmt"
	"time"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
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
		fev, ok, err := s.pair.ready(ev)
		switch {
		case err != nil:
			s.died(ev.slot, err.Error(), ev.at, "")
		case ok:
			s.step(fev)
		}
	case evDied:
		s.died(ev.slot, ev.cause, ev.at, "")
	case evReply:
		if fev, ok := s.failback.reply(ev, s.pair.active); ok {
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
		if !s.pair.startDue(ev) {
			return // cancelled after it fired
		}
		s.start(ev.role)
	case evMPSChecked:
		s.mps.checked(ev.err)
		for _, r := range s.pair.waiting() {
			s.start(r)
		}
	case evDrill:
		st, _ := s.machine.State()
		a := s.pair.active
		if st != failover.ServingReady || a == nil {
			ev.resp <- fmt.Errorf("no failover possible in state %s: it needs a ready standby", st)
			return
		}
		ev.resp <- nil
		s.log.Info("failover drill: killing the active", "pid", a.proc.PID(), "reason", ev.cause)
		s.died(a, "drill: "+ev.cause, ev.at, classDrill)
	case evShutdown:
		s.step(failover.Event{Kind: failover.Shutdown, At: ev.at, Cause: ev.cause})
	case evStep:
		s.step(ev.fev)
	case evHandoverDue:
		if s.failback.fire(ev) && s.pair.inverted() {
			s.step(failover.Event{Kind: failover.HandoverDue, At: ev.at,
				Cause: fmt.Sprintf("active pid %d outside MPS, standby pid %d inside", s.pair.active.proc.PID(), s.pair.standby.proc.PID())})
		}
	case evHandoffTimeout:
		if s.failback.timedOut(ev) {
			s.died(s.pair.active, fmt.Sprintf("stalled: no reply to handoff within %s", s.cfg.HandoffTimeout), ev.at, classStalled)
		}
	case evPing:
		ev.resp <- nil
	case evMPSTeardown:
		// The server writes these lines while it handles a fatal GPU error, having
		// stopped its clients' work: the active's context is lost already, and it
		// would notice only at its next CUDA call's error (tens to hundreds of ms
		// later). Fenced now, it can no longer write the KV cache the standby takes.
		if sl := s.pair.active; s.mps.tearsDown(sl, ev) {
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
	s.pair.reap()
	s.pair.syncShown()
	s.scheduleFailback()
	st, _ := s.machine.State()
	s.spares.fill(st)
}

// checkStall fences the serving active when hang detection judges it wedged
// (hang.go): its heartbeats stopped, or its step in progress overran its bound.
func (s *Supervisor) checkStall(now time.Time) {
	sl := s.pair.active
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

// died handles the first report of a slot's death; later ones are ignored.
// class names the death when it is known without looking at the exit
// (a drill, a stall): the fence's SIGKILL would otherwise be the cause.
func (s *Supervisor) died(sl *slot, cause string, at time.Time, class string) {
	handled := time.Now()
	if sl == nil || sl.dead || !s.pair.isLive(sl) {
		return
	}
	sl.dead = true
	var refusedStart bool
	if sl.role == failover.Active && !s.machine.EverServed() {
		cause, refusedStart = s.pair.startFailure(sl, cause)
	}
	// A dead active is fenced in every state the machine takes its death up in
	// (FenceActive): do it first, before the log lines and the machine's step
	// below, all on the way to the standby's Resume. (On the GPU host moving
	// them did not shorten that way: its 0.5-1.6 ms are the SIGKILL itself,
	// see fenceFirst.)
	var fenced time.Time
	if sl.role == failover.Active {
		s.pair.fenceFirst(sl)
		fenced = time.Now()
	}
	cause, wasReady, refused := s.pair.buried(sl, cause, class)
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
		s.failovers.begin(&failoverRun{kind: resumeFailover, target: s.pair.standby, detected: at, handled: handled, fenced: fenced,
			cause: cause, old: sl, class: class})
	}
	s.step(failover.Event{Kind: kind, At: at, Cause: cause, Refused: refusedStart})
	if sl.groupPending { // after the step's Resume, if it sent one
		sl.groupPending = false
		s.pair.fence(sl)
		s.failovers.groupFenced(sl)
	}
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
			s.pair.reap()
			s.pair.syncShown()
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
