package supervisor

import (
	"fmt"
	"time"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
	"github.com/frmps/frmps/supervisor/failover"
)

// Failback: after a failover the promoted engine runs outside MPS, where it
// time-slices against every MPS tenant, and the fresh standby is placed
// inside MPS (placement: an engine goes into MPS unless the other engine is
// there). Once that standby is ready the pair swaps in a planned handover
// (the failover state machine's HandingOver): the active yields (Handoff:
// it publishes a fresh sync, moves its streams and sleeps), the standby is
// resumed with no token to replay, and the yielded engine stays as the
// standby. Policy: the first handover is due FailbackDelay after the standby
// is ready; after a failed one the next waits FailbackBaseBackoff doubled per
// consecutive failure, up to FailbackMaxBackoff.

// handoverRun is the planned handover in progress (loop-owned).
type handoverRun struct {
	started   time.Time
	handoffID uint64
	timer     *time.Timer
	yielded   time.Time // the active's Handoff reply
	swapped   bool      // Swap ran: the handover succeeded
	failure   string    // why it went to restoring, if it did
}

// failbackPolicy is the loop-owned schedule of handovers.
type failbackPolicy struct {
	timer     *time.Timer
	seq       uint64
	due       time.Time
	failures  int // consecutive failed handovers
	succeeded uint64
	failed    uint64
	lastErr   string
	lastAt    time.Time
	lastDur   time.Duration
	// lostAt: when an active inside MPS died, until a failback puts an active back
	// inside MPS (frmps_placement_restore_seconds); zero while the placement holds.
	lostAt time.Time
}

// placementInverted: the active runs outside MPS and a ready standby inside.
func (s *Supervisor) placementInverted() bool {
	a, sb := s.active, s.standby
	return a != nil && sb != nil && !a.dead && !sb.dead && !a.inMPS && sb.inMPS && sb.state == "ready"
}

// maybeScheduleHandover arms the failback timer when the placement is
// inverted in serving_ready, and drops it otherwise. Called after every event.
func (s *Supervisor) maybeScheduleHandover() {
	st, _ := s.machine.State()
	want := s.mps != nil && !s.cfg.NoFailback && st == failover.ServingReady && s.placementInverted()
	p := &s.failback
	if !want {
		if p.timer != nil {
			p.timer.Stop()
			p.timer = nil
			p.due = time.Time{}
		}
		return
	}
	if p.timer != nil {
		return
	}
	delay := s.cfg.FailbackDelay
	if p.failures > 0 {
		delay = s.cfg.FailbackBaseBackoff
		for i := 1; i < p.failures && delay < s.cfg.FailbackMaxBackoff; i++ {
			delay *= 2
		}
		delay = min(delay, s.cfg.FailbackMaxBackoff)
	}
	p.seq++
	seq := p.seq
	p.due = time.Now().Add(delay)
	p.timer = time.AfterFunc(delay, func() { s.post(event{kind: evHandoverDue, id: seq, at: time.Now()}) })
	s.syncFailback()
}

// handoverDue starts the handover if the policy's timer is current and the
// placement is still inverted.
func (s *Supervisor) handoverDue(ev event) {
	p := &s.failback
	if p.timer == nil || ev.id != p.seq {
		return
	}
	p.timer, p.due = nil, time.Time{}
	if !s.placementInverted() {
		return
	}
	s.step(failover.Event{Kind: failover.HandoverDue, At: ev.at,
		Cause: fmt.Sprintf("active pid %d outside MPS, standby pid %d inside", s.active.proc.PID(), s.standby.proc.PID())})
}

// sendHandoff asks the active to yield (action SendHandoff).
func (s *Supervisor) sendHandoff() {
	a := s.active
	s.resumeSeq++
	ho := &handoverRun{started: time.Now(), handoffID: s.resumeSeq}
	s.handover = ho
	var conn ControlConn
	if a != nil {
		conn = a.getConn()
	}
	if conn == nil {
		s.raise(failover.Event{Kind: failover.HandoffFailed, At: time.Now(), Cause: "the active has no control connection"})
		return
	}
	id := ho.handoffID
	ho.timer = time.AfterFunc(s.cfg.HandoffTimeout, func() { s.post(event{kind: evHandoffTimeout, id: id, at: time.Now()}) })
	if err := conn.Send(&frmpsv1.Envelope{Id: id, Msg: &frmpsv1.Envelope_Handoff{Handoff: &frmpsv1.Handoff{}}}, nil); err != nil {
		ho.timer.Stop()
		s.raise(failover.Event{Kind: failover.HandoffFailed, At: time.Now(), Cause: "send handoff: " + err.Error()})
		return
	}
	s.log.Info("failback: handing over", "from_pid", a.proc.PID(), "to_pid", s.standby.proc.PID())
}

// handoffReply handles the active's answer to Handoff; false if ev is not it.
func (s *Supervisor) handoffReply(ev event) bool {
	ho := s.handover
	if ho == nil || ho.handoffID != ev.id || ev.slot != s.active {
		return false
	}
	ho.timer.Stop()
	if !ev.reply.GetOk() {
		s.step(failover.Event{Kind: failover.HandoffFailed, At: ev.at, Cause: ev.reply.GetError()})
		return true
	}
	ho.yielded = ev.at
	ev.slot.setState("ready") // asleep with the pools mapped, as a standby
	s.metrics.up(failover.Active, false)
	s.step(failover.Event{Kind: failover.HandoffDone, At: ev.at, Cause: fmt.Sprintf("yielded in %s", time.Duration(ev.reply.GetTookNs()))})
	return true
}

// handoffTimeout: an active that does not yield in time is wedged: fence it,
// which the machine turns into a failover to the standby.
func (s *Supervisor) handoffTimeout(ev event) {
	ho := s.handover
	if ho == nil || ho.handoffID != ev.id || !ho.yielded.IsZero() {
		return
	}
	s.died(s.active, fmt.Sprintf("stalled: no reply to handoff within %s", s.cfg.HandoffTimeout), ev.at, classStalled)
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
	if s.handover != nil {
		s.handover.swapped = true
	}
	s.publish(s.active)
}

// noteHandoverStep remembers why a handover turned to restoring the yielded engine.
func (s *Supervisor) noteHandoverStep(tr failover.Transition) {
	if ho := s.handover; ho != nil && ho.failure == "" && tr.To == failover.HandingOver && s.machine.Handover() == failover.Restoring {
		ho.failure = tr.Cause
	}
}

// endHandover records how a handover ended once the machine left
// HandingOver; ok when the roles were swapped.
func (s *Supervisor) endHandover(tr failover.Transition) {
	ho := s.handover
	if ho == nil {
		return
	}
	s.handover = nil
	if ho.timer != nil {
		ho.timer.Stop()
	}
	p := &s.failback
	now := time.Now()
	p.lastAt, p.lastDur = now, now.Sub(ho.started)
	if ho.swapped {
		p.failures, p.lastErr = 0, ""
		p.succeeded++
		s.metrics.failback(true, p.lastDur)
		restored := time.Duration(0)
		if !p.lostAt.IsZero() {
			restored = now.Sub(p.lostAt)
			p.lostAt = time.Time{}
			s.metrics.placementRestored(restored)
		}
		if restored > 0 {
			s.log.Info("failback done: the active runs in MPS again", "duration", p.lastDur, "active_pid", s.active.proc.PID(),
				"placement_restored_after", restored)
		} else { // no failover lost the placement before this handover
			s.log.Info("failback done: the active runs in MPS", "duration", p.lastDur, "active_pid", s.active.proc.PID())
		}
		s.noteHandoverForFirstToken(ho.started)
	} else {
		p.failures++
		p.failed++
		p.lastErr = tr.Cause
		if ho.failure != "" {
			p.lastErr = ho.failure
		}
		s.metrics.failback(false, p.lastDur)
		s.log.Warn("failback did not complete", "cause", tr.Cause, "consecutive_failures", p.failures)
	}
	s.syncFailback()
}

// noteHandoverForFirstToken: the front door's first resumed token on the new
// generation ends the client-visible pause of this handover.
func (s *Supervisor) noteHandoverForFirstToken(started time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.awaitingFirstToken == nil {
		s.awaitingFirstToken = make(map[uint64]pendingFirstToken)
	}
	s.awaitingFirstToken[s.generation] = pendingFirstToken{detected: started, set: func(v float64) {
		s.failbackFirstTokenSeconds = v
		if s.failbackStatus != nil {
			s.failbackStatus.LastFirstTokenSeconds = v
		}
	}}
}

// syncFailback publishes the policy's state for Status.
func (s *Supervisor) syncFailback() {
	p := &s.failback
	st, _ := s.machine.State()
	v := &frmpsv1.Failback{
		Enabled: s.mps != nil && !s.cfg.NoFailback, Succeeded: p.succeeded, Failed: p.failed,
		ConsecutiveFailures: uint32(p.failures), LastError: p.lastErr, LastDurationSeconds: p.lastDur.Seconds(),
		PlacementOk: s.placementOK(),
	}
	if !p.lastAt.IsZero() {
		v.LastUnixNanos = p.lastAt.UnixNano()
	}
	switch {
	case !v.Enabled:
		v.State = "disabled"
	case st == failover.HandingOver:
		v.State = "handing_over:" + s.machine.Handover().String()
	case p.timer != nil:
		v.State = "scheduled"
		v.NextAttemptUnixNanos = p.due.UnixNano()
	case v.PlacementOk:
		v.State = "idle"
	default:
		v.State = "waiting" // placement inverted, standby not ready yet (or not serving_ready)
	}
	s.mu.Lock()
	v.LastFirstTokenSeconds = s.failbackFirstTokenSeconds
	s.failbackStatus = v
	s.mu.Unlock()
	s.metrics.placement(v.PlacementOk)
}

// placementOK: the active runs in MPS and the standby (if any) outside it,
// or MPS is off.
func (s *Supervisor) placementOK() bool {
	if s.mps == nil {
		return true
	}
	a, sb := s.active, s.standby
	if a == nil || a.dead || !a.inMPS {
		return false
	}
	return sb == nil || sb.dead || !sb.inMPS
}
