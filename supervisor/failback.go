package supervisor

import (
	"fmt"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"

	"google.golang.org/protobuf/proto"

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

// handoverRun is the planned handover in progress.
type handoverRun struct {
	started   time.Time
	handoffID uint64
	timer     *time.Timer
	yielded   time.Time // the active's Handoff reply
	swapped   bool      // Swap ran: the handover succeeded
	failure   string    // why it went to restoring, if it did
}

// failback owns the schedule of handovers and the handover in progress
// (loop-owned), and what Status shows of them (under mu). It decides and
// records; the loop moves the engines and feeds the machine.
type failback struct {
	// enabled: MPS runs and failback is not turned off (set before the loop).
	enabled bool
	delay   time.Duration // Config.FailbackDelay
	base    time.Duration // Config.FailbackBaseBackoff
	max     time.Duration // Config.FailbackMaxBackoff
	timeout time.Duration // Config.HandoffTimeout
	log     hclog.Logger
	metrics *metrics
	post    func(event) // to the loop, from the timers

	handover  *handoverRun
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

	mu     sync.Mutex
	status *frmpsv1.Failback
	// firstToken: the last handover's Handoff sent -> first resumed token.
	firstToken float64
}

// lost notes that an active inside MPS died at at (the placement is lost
// until a handover restores it).
func (fb *failback) lost(at time.Time) {
	if fb.lostAt.IsZero() {
		fb.lostAt = at
	}
}

// schedule arms the handover timer when want (the placement is inverted in
// serving_ready), and drops it otherwise. Called after every event.
func (fb *failback) schedule(want bool) {
	want = want && fb.enabled
	if !want {
		if fb.timer != nil {
			fb.timer.Stop()
			fb.timer = nil
			fb.due = time.Time{}
		}
		return
	}
	if fb.timer != nil {
		return
	}
	delay := fb.backoff()
	fb.seq++
	seq := fb.seq
	fb.due = time.Now().Add(delay)
	fb.timer = time.AfterFunc(delay, func() { fb.post(event{kind: evHandoverDue, id: seq, at: time.Now()}) })
}

// backoff is the wait before the next handover: FailbackDelay, or after
// failed ones the base backoff doubled per consecutive failure, capped.
func (fb *failback) backoff() time.Duration {
	if fb.failures == 0 {
		return fb.delay
	}
	delay := fb.base
	for i := 1; i < fb.failures && delay < fb.max; i++ {
		delay *= 2
	}
	return min(delay, fb.max)
}

// fire takes the timer's event (evHandoverDue): true when it is the timer
// armed now, which it then disarms.
func (fb *failback) fire(ev event) bool {
	if fb.timer == nil || ev.id != fb.seq {
		return false
	}
	fb.timer, fb.due = nil, time.Time{}
	return true
}

// sendHandoff asks the active a to yield (action SendHandoff), as command
// id; "" when sent, else why the handover failed.
func (fb *failback) sendHandoff(a, standby *slot, id uint64) (failed string) {
	ho := &handoverRun{started: time.Now(), handoffID: id}
	fb.handover = ho
	var conn ControlConn
	if a != nil {
		conn = a.getConn()
	}
	if conn == nil {
		return "the active has no control connection"
	}
	ho.timer = time.AfterFunc(fb.timeout, func() { fb.post(event{kind: evHandoffTimeout, id: id, at: time.Now()}) })
	if err := conn.Send(&frmpsv1.Envelope{Id: id, Msg: &frmpsv1.Envelope_Handoff{Handoff: &frmpsv1.Handoff{}}}, nil); err != nil {
		ho.timer.Stop()
		return "send handoff: " + err.Error()
	}
	fb.log.Info("failback: handing over", "from_pid", a.proc.PID(), "to_pid", standby.proc.PID())
	return ""
}

// reply takes the active's answer to Handoff (evReply from active): the
// machine event it makes, or ok false if ev is not that answer.
func (fb *failback) reply(ev event, active *slot) (fev failover.Event, ok bool) {
	ho := fb.handover
	if ho == nil || ho.handoffID != ev.id || ev.slot != active {
		return fev, false
	}
	ho.timer.Stop()
	if !ev.reply.GetOk() {
		return failover.Event{Kind: failover.HandoffFailed, At: ev.at, Cause: ev.reply.GetError()}, true
	}
	ho.yielded = ev.at
	ev.slot.setState("ready") // asleep with the pools mapped, as a standby
	fb.metrics.up(failover.Active, false)
	return failover.Event{Kind: failover.HandoffDone, At: ev.at, Cause: fmt.Sprintf("yielded in %s", time.Duration(ev.reply.GetTookNs()))}, true
}

// timedOut: Handoff got no reply in time (evHandoffTimeout): the active,
// which has not yielded, is wedged.
func (fb *failback) timedOut(ev event) bool {
	ho := fb.handover
	return ho != nil && ho.handoffID == ev.id && ho.yielded.IsZero()
}

// swapped notes that the roles were swapped: the handover succeeded.
func (fb *failback) swapped() {
	if fb.handover != nil {
		fb.handover.swapped = true
	}
}

// noteStep remembers why a handover turned to restoring the yielded engine.
func (fb *failback) noteStep(tr failover.Transition, phase failover.HandoverPhase) {
	if ho := fb.handover; ho != nil && ho.failure == "" && tr.To == failover.HandingOver && phase == failover.Restoring {
		ho.failure = tr.Cause
	}
}

// end records how a handover ended once the machine left HandingOver; the
// active is the engine serving after it. ok: the roles were swapped, and
// started is when the handover began (its first resumed token ends the
// clients' pause).
func (fb *failback) end(tr failover.Transition, active *slot) (started time.Time, ok bool) {
	ho := fb.handover
	if ho == nil {
		return time.Time{}, false
	}
	fb.handover = nil
	if ho.timer != nil {
		ho.timer.Stop()
	}
	now := time.Now()
	fb.lastAt, fb.lastDur = now, now.Sub(ho.started)
	if !ho.swapped {
		fb.failures++
		fb.failed++
		fb.lastErr = tr.Cause
		if ho.failure != "" {
			fb.lastErr = ho.failure
		}
		fb.metrics.failback(false, fb.lastDur)
		fb.log.Warn("failback did not complete", "cause", tr.Cause, "consecutive_failures", fb.failures)
		return time.Time{}, false
	}
	fb.failures, fb.lastErr = 0, ""
	fb.succeeded++
	fb.metrics.failback(true, fb.lastDur)
	restored := time.Duration(0)
	if !fb.lostAt.IsZero() {
		restored = now.Sub(fb.lostAt)
		fb.lostAt = time.Time{}
		fb.metrics.placementRestored(restored)
	}
	if restored > 0 {
		fb.log.Info("failback done: the active runs in MPS again", "duration", fb.lastDur, "active_pid", active.proc.PID(),
			"placement_restored_after", restored)
	} else { // no failover lost the placement before this handover
		fb.log.Info("failback done: the active runs in MPS", "duration", fb.lastDur, "active_pid", active.proc.PID())
	}
	return ho.started, true
}

// noteFirstToken records the last handover's time to its first resumed token.
func (fb *failback) noteFirstToken(seconds float64) {
	fb.mu.Lock()
	defer fb.mu.Unlock()
	fb.firstToken = seconds
	if fb.status != nil {
		fb.status.LastFirstTokenSeconds = seconds
	}
}

// sync publishes the policy's state for Status, in machine state st and
// handover phase; placementOK says whether the active runs in MPS.
func (fb *failback) sync(st failover.State, phase failover.HandoverPhase, placementOK bool) {
	v := &frmpsv1.Failback{
		Enabled: fb.enabled, Succeeded: fb.succeeded, Failed: fb.failed,
		ConsecutiveFailures: uint32(fb.failures), LastError: fb.lastErr, LastDurationSeconds: fb.lastDur.Seconds(),
		PlacementOk: placementOK,
	}
	if !fb.lastAt.IsZero() {
		v.LastUnixNanos = fb.lastAt.UnixNano()
	}
	switch {
	case !v.Enabled:
		v.State = "disabled"
	case st == failover.HandingOver:
		v.State = "handing_over:" + phase.String()
	case fb.timer != nil:
		v.State = "scheduled"
		v.NextAttemptUnixNanos = fb.due.UnixNano()
	case v.PlacementOk:
		v.State = "idle"
	default:
		v.State = "waiting" // placement inverted, standby not ready yet (or not serving_ready)
	}
	fb.mu.Lock()
	v.LastFirstTokenSeconds = fb.firstToken
	fb.status = v
	fb.mu.Unlock()
	fb.metrics.placement(v.PlacementOk)
}

// shown is what Status shows of failback (a copy; nil before the first sync).
func (fb *failback) shown() *frmpsv1.Failback {
	fb.mu.Lock()
	defer fb.mu.Unlock()
	if fb.status == nil {
		return nil
	}
	return proto.Clone(fb.status).(*frmpsv1.Failback)
}
