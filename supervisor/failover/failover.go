// Package failover is the supervisor's failover state machine: a pure
// function of (state, event) that returns the next state, why it changed,
// and the actions the executor must carry out. It does no I/O and reads no
// clock (events carry their time), so every transition is table-tested.
//
// Lifecycle of a deployment:
//
//	starting ──active ready──► rearming ──standby ready──► serving_ready
//	serving_ready ──active died──► failing_over ──resume acked──► rearming
//	serving_ready ──standby died──► rearming (restart standby, with backoff)
//	failing_over ──resume failed / standby died──► starting (cold start: a new
//	        active reloads the weights; nothing can be resumed)
//	rearming ──active died──► starting (the standby was not ready to take over)
//	serving_degraded: serving, but no standby (its restarts tripped the breaker)
//	crash_loop: nothing serves and the breaker forbids restarting the active
//	any ──shutdown──► stopped (absorbing)
//
// Failback: after a failover the promoted active runs outside MPS and the
// fresh standby is placed inside it. The executor then raises HandoverDue
// (its policy: when, and how it backs off), and the pair swaps in a planned
// handover that reuses the failover's resume path with a fresh sync:
//
//	serving_ready ──handover due──► handing_over: the active yields (Handoff)
//	handing_over ──handoff done──► the standby is resumed ──resume acked──►
//	        serving_ready with the roles swapped (the yielded engine is the standby)
//
// A fault during the handover is survived like any other: before the active
// has yielded, its death is a failover to the standby; once it has yielded it
// sleeps with the pools mapped, so if the standby dies instead the yielded
// engine is resumed (phase "restore"). Only when both are gone is there a
// cold start.
package failover

import (
	"fmt"
	"time"
)

// State is the deployment's failover state.
type State int

const (
	Starting        State = iota // the active is being launched (first start or cold restart)
	ServingReady                 // the active serves and a standby is asleep, ready to take over
	ServingDegraded              // the active serves with no standby, and none is being started
	FailingOver                  // the active died; the standby is being resumed
	Rearming                     // the active serves; a fresh standby is being started
	CrashLoop                    // nothing serves: the active's restarts tripped the breaker
	Stopped                      // shut down (absorbing)
	HandingOver                  // a planned handover (failback): the active yields, the standby is resumed
)

var stateNames = [...]string{"starting", "serving_ready", "serving_degraded", "failing_over", "rearming", "crash_loop", "stopped", "handing_over"}

func (s State) String() string {
	if s < 0 || int(s) >= len(stateNames) {
		return fmt.Sprintf("state(%d)", int(s))
	}
	return stateNames[s]
}

// Serving reports whether an engine can take requests in this state.
func (s State) Serving() bool {
	return s == ServingReady || s == ServingDegraded || s == Rearming
}

// HandoverPhase is where a planned handover stands.
type HandoverPhase int

const (
	NoHandover HandoverPhase = iota
	Yielding                 // Handoff sent: the active finishes its step, publishes, moves its streams, sleeps
	Resuming                 // the active sleeps; the standby is being resumed
	Restoring                // the standby is gone: the yielded active is resumed (or still yielding first)
)

var phaseNames = [...]string{"none", "yielding", "resuming", "restoring"}

func (p HandoverPhase) String() string {
	if p < 0 || int(p) >= len(phaseNames) {
		return fmt.Sprintf("phase(%d)", int(p))
	}
	return phaseNames[p]
}

// Role of an engine slot.
type Role int

const (
	Active Role = iota
	Standby
)

func (r Role) String() string {
	if r == Active {
		return "active"
	}
	return "standby"
}

// EventKind enumerates what the executor reports to the machine.
type EventKind int

const (
	ActiveReady    EventKind = iota // the active finished its handshake and serves
	StandbyReady                    // the standby mapped the brokered pools and sleeps (re-arm done)
	ActiveDied                      // control-socket EOF, process exit, or a drill
	StandbyDied                     // the standby died (also: failed to launch or hand-shake)
	ResumeAcked                     // the standby acknowledged Resume: it is the active now
	ResumeFailed                    // Resume was refused, timed out or could not be sent
	RearmFailed                     // the standby could not be armed (e.g. Sleep could not be sent)
	BreakerTripped                  // the executor declares a crash loop (Event.Role says whose)
	Shutdown                        // stop everything
	HandoverDue                     // the executor's failback policy: swap the pair now (planned handover)
	HandoffDone                     // the active yielded: its requests are published and it sleeps
	HandoffFailed                   // the active refused to yield and still serves
	// StandbyNotAdmitted: a standby launched into MPS died at start-up
	// while the MPS server recovers from a fault that killed the active (the
	// server refuses or breaks new clients for some seconds after it reset a
	// device). Outside Rearming it counts as StandbyDied.
	StandbyNotAdmitted
)

// MPSRetryDelay spaces the relaunches of a standby the recovering MPS server
// did not admit. They do not count against the breaker: the executor sends
// StandbyNotAdmitted only within a bounded window after the fault, and deaths
// after it count as usual.
const MPSRetryDelay = time.Second

var eventNames = [...]string{"active_ready", "standby_ready", "active_died", "standby_died", "resume_acked", "resume_failed", "rearm_failed", "breaker_tripped", "shutdown",
	"handover_due", "handoff_done", "handoff_failed", "standby_not_admitted"}

func (k EventKind) String() string {
	if k < 0 || int(k) >= len(eventNames) {
		return fmt.Sprintf("event(%d)", int(k))
	}
	return eventNames[k]
}

// Event is one input to the machine.
type Event struct {
	Kind  EventKind
	Role  Role      // BreakerTripped only
	Cause string    // why, free text (e.g. "socket EOF", "exit code 1", "drill: operator")
	At    time.Time // when the executor saw it; drives the breaker window
	// Refused (ActiveDied): the engine exited with the engines' refusal code
	// before it was ready: it refused its options. Before anything has served
	// that is a configuration error no restart mends: the breaker opens at once.
	Refused bool
}

// ActionKind enumerates what the executor must do. Actions are data so the
// executor can be tested apart from the decisions.
type ActionKind int

const (
	FenceActive   ActionKind = iota // kill the active's whole process group (idempotent)
	FenceStandby                    // kill the standby's whole process group (idempotent)
	DrainRing                       // consume every committed ring record into the snapshot
	SendResume                      // build the resume set and send Resume to the standby
	Promote                         // the standby becomes the active: the backend's engine, generation+1
	Publish                         // the (new) active serves: the backend's engine, generation+1
	StartActive                     // launch an active (after Delay); it loads weights
	StartStandby                    // launch a standby (after Delay) that maps the brokered pools
	CheckMPS                        // check the MPS daemon, restart it if it does not answer
	Unpublish                       // no engine serves: callers wait or get ErrUnavailable
	StopAll                         // shut down children, MPS, sockets, ring, run dir
	SendHandoff                     // ask the active to yield (planned handover)
	Swap                            // the resumed standby becomes the active (generation+1); the yielded active, if alive, the standby
	ResumeYielded                   // build the resume set and send Resume to the yielded active (it sleeps with the pools mapped)
)

var actionNames = [...]string{"fence_active", "fence_standby", "drain_ring", "send_resume", "promote", "publish", "start_active", "start_standby", "check_mps", "unpublish", "stop_all",
	"send_handoff", "swap", "resume_yielded"}

func (k ActionKind) String() string {
	if k < 0 || int(k) >= len(actionNames) {
		return fmt.Sprintf("action(%d)", int(k))
	}
	return actionNames[k]
}

// Action is one step for the executor, in order.
type Action struct {
	Kind  ActionKind
	Delay time.Duration // StartActive/StartStandby: backoff before launching
}

func (a Action) String() string {
	if a.Delay > 0 {
		return fmt.Sprintf("%s(after %s)", a.Kind, a.Delay)
	}
	return a.Kind.String()
}

// Transition is the result of one event: where the machine went, why, and
// what to do. From == To is allowed (e.g. a standby restart while rearming).
// Ignored is set for events that mean nothing in the current state (for
// example a late StandbyReady after shutdown); no actions then.
type Transition struct {
	From, To State
	Event    Event
	Cause    string
	Actions  []Action
	Ignored  bool
}

// BreakerConfig bounds restarts: a role that dies more than MaxRestarts times
// within Window is not restarted any more, nor is one whose last
// MaxRestarts+1 launches in a row all died before they were ready, however
// long each took to fail (a start that fails after 20 s of imports never
// fills a 60 s window). Restarts after a death wait
// BaseBackoff·2^(deaths in window − 1), capped at MaxBackoff.
type BreakerConfig struct {
	MaxRestarts int
	Window      time.Duration
	BaseBackoff time.Duration
	MaxBackoff  time.Duration
}

// DefaultBreaker is what `frmps serve` uses unless told otherwise.
var DefaultBreaker = BreakerConfig{MaxRestarts: 5, Window: 60 * time.Second, BaseBackoff: 100 * time.Millisecond, MaxBackoff: 10 * time.Second}

// Validate reports a configuration the machine cannot work with.
func (c BreakerConfig) Validate() error {
	switch {
	case c.MaxRestarts < 1:
		return fmt.Errorf("max restarts must be at least 1, got %d", c.MaxRestarts)
	case c.Window <= 0:
		return fmt.Errorf("restart window must be positive, got %s", c.Window)
	case c.BaseBackoff < 0 || c.MaxBackoff < c.BaseBackoff:
		return fmt.Errorf("backoff must satisfy 0 <= base (%s) <= max (%s)", c.BaseBackoff, c.MaxBackoff)
	}
	return nil
}

// Machine is the state machine. Not safe for concurrent use: the executor
// owns it from one goroutine.
type Machine struct {
	cfg    BreakerConfig
	state  State
	cause  string
	deaths [2][]time.Time // per role, within the window
	open   [2]bool        // breaker open per role: that role is not restarted
	openBy [2]string
	// unready counts per role the launches in a row that died before they
	// were ready (reset when one is); they trip the breaker whatever their pace.
	unready [2]int
	served  bool // an engine has served at some point (a serving state was entered)
	// The planned handover in progress (state HandingOver).
	phase       HandoverPhase
	yieldedDead bool // the yielded active died while the standby was being resumed
}

// New returns a machine in Starting; the executor launches the first active
// (Initial's actions) right away.
func New(cfg BreakerConfig) (*Machine, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("breaker config: %w", err)
	}
	return &Machine{cfg: cfg, state: Starting, cause: "deployment starting"}, nil
}

// Initial is what the executor does when the machine is created.
func (m *Machine) Initial() []Action { return []Action{{Kind: StartActive}} }

// State returns the current state and why the machine entered it.
func (m *Machine) State() (State, string) { return m.state, m.cause }

// Handover returns the phase of the planned handover (NoHandover outside HandingOver).
func (m *Machine) Handover() HandoverPhase { return m.phase }

// BreakerOpen reports whether a role's restarts are blocked, and why.
func (m *Machine) BreakerOpen(r Role) (bool, string) { return m.open[r], m.openBy[r] }

// EverServed reports whether an engine has served at some point. A breaker
// that opens before then is a deployment that never started: the executor
// gives up rather than wait in crash_loop for nothing.
func (m *Machine) EverServed() bool { return m.served }

// CrashLoopOpen reports whether any role's breaker is open.
func (m *Machine) CrashLoopOpen() bool { return m.open[Active] || m.open[Standby] }

// recordDeath notes a death of role r at t and returns the backoff before a
// restart, or ok=false when the breaker is (now) open. neverReady: the dead
// engine had not become ready.
func (m *Machine) recordDeath(r Role, t time.Time, cause string, neverReady bool) (backoff time.Duration, ok bool) {
	if m.open[r] {
		return 0, false
	}
	if neverReady {
		m.unready[r]++
	}
	kept := m.deaths[r][:0]
	for _, d := range m.deaths[r] {
		if t.Sub(d) < m.cfg.Window {
			kept = append(kept, d)
		}
	}
	kept = append(kept, t)
	m.deaths[r] = kept
	n := len(kept)
	if n > m.cfg.MaxRestarts {
		m.open[r] = true
		m.openBy[r] = fmt.Sprintf("%s died %d times within %s (last: %s)", r, n, m.cfg.Window, cause)
		return 0, false
	}
	if neverReady && m.unready[r] > m.cfg.MaxRestarts {
		m.open[r] = true
		m.openBy[r] = fmt.Sprintf("%s never became ready in %d launches in a row (last: %s)", r, m.unready[r], cause)
		return 0, false
	}
	return m.backoff(r), true
}

// Handle applies one event and returns the transition.
func (m *Machine) Handle(ev Event) Transition {
	tr := m.next(ev)
	tr.From, tr.Event = m.state, ev
	if !tr.Ignored {
		m.state, m.cause = tr.To, tr.Cause
		if tr.To.Serving() {
			m.served = true
		}
		switch ev.Kind {
		case ActiveReady:
			m.unready[Active] = 0
		case StandbyReady:
			m.unready[Standby] = 0
		}
		if tr.To != HandingOver {
			m.phase, m.yieldedDead = NoHandover, false
		}
	} else {
		tr.To, tr.Cause = m.state, m.cause
	}
	return tr
}

func ignored() Transition { return Transition{Ignored: true} }

func (m *Machine) next(ev Event) Transition {
	if m.state == Stopped {
		return ignored()
	}
	if ev.Kind == Shutdown {
		return Transition{To: Stopped, Cause: "shutdown: " + ev.Cause, Actions: []Action{{Kind: Unpublish}, {Kind: StopAll}}}
	}
	if ev.Kind == BreakerTripped {
		return m.trip(ev)
	}
	if ev.Kind == StandbyNotAdmitted {
		if m.state != Rearming {
			ev.Kind = StandbyDied
		} else {
			return Transition{To: Rearming, Cause: "standby not admitted by the recovering MPS server, relaunching: " + ev.Cause,
				Actions: []Action{{Kind: FenceStandby}, {Kind: StartStandby, Delay: MPSRetryDelay}}}
		}
	}
	switch m.state {
	case Starting:
		switch ev.Kind {
		case ActiveReady:
			return m.armStandby("active ready", []Action{{Kind: Publish}})
		case ActiveDied:
			return m.coldStart(ev, "active died while starting: "+ev.Cause, []Action{{Kind: FenceActive}})
		}
	case ServingReady:
		switch ev.Kind {
		case ActiveDied:
			return failOver(ev)
		case StandbyDied, RearmFailed:
			return m.restartStandby(ev)
		case HandoverDue:
			m.phase = Yielding
			return Transition{To: HandingOver, Cause: "failback: handing over to the standby: " + ev.Cause,
				Actions: []Action{{Kind: SendHandoff}}}
		}
	case HandingOver:
		return m.handover(ev)
	case Rearming:
		switch ev.Kind {
		case StandbyReady:
			return Transition{To: ServingReady, Cause: "standby ready"}
		case StandbyDied, RearmFailed:
			return m.restartStandby(ev)
		case ActiveDied:
			// The standby has not mapped the pools yet: it cannot take over.
			return m.coldStart(ev, "active died before the standby was ready: "+ev.Cause,
				[]Action{{Kind: FenceActive}, {Kind: FenceStandby}})
		}
	case ServingDegraded:
		switch ev.Kind {
		case ActiveDied:
			return m.coldStart(ev, "active died with no standby: "+ev.Cause, []Action{{Kind: FenceActive}})
		}
	case FailingOver:
		switch ev.Kind {
		case ResumeAcked:
			// The active's death counts against the breaker: a request that kills
			// every engine must not fail over forever.
			_, ok := m.recordDeath(Active, ev.At, ev.Cause, false)
			acts := []Action{{Kind: Promote}, {Kind: CheckMPS}}
			if !ok {
				return Transition{To: ServingDegraded, Cause: "failed over; not re-arming: " + m.openBy[Active], Actions: acts}
			}
			return m.armStandby("failed over, re-arming: "+ev.Cause, acts)
		case ResumeFailed, StandbyDied:
			return m.coldStart(ev, "takeover failed: "+ev.Kind.String()+": "+ev.Cause,
				[]Action{{Kind: FenceStandby}, {Kind: Unpublish}, {Kind: CheckMPS}})
		}
	case CrashLoop:
		// Nothing runs and nothing restarts; only shutdown gets out.
	}
	return ignored()
}

// failOver resumes the standby after the active's death.
func failOver(ev Event) Transition {
	return Transition{To: FailingOver, Cause: "active died: " + ev.Cause,
		Actions: []Action{{Kind: FenceActive}, {Kind: DrainRing}, {Kind: SendResume}}}
}

// handover drives a planned handover (state HandingOver) by phase.
func (m *Machine) handover(ev Event) Transition {
	switch m.phase {
	case Yielding:
		switch ev.Kind {
		case HandoffDone:
			m.phase = Resuming
			return Transition{To: HandingOver, Cause: "failback: the active yielded; resuming the standby",
				Actions: []Action{{Kind: DrainRing}, {Kind: SendResume}}}
		case HandoffFailed:
			// It refused and still serves: nothing changed (the executor backs off).
			return Transition{To: ServingReady, Cause: "failback: handover refused: " + ev.Cause}
		case ActiveDied:
			return failOver(ev)
		case StandbyDied, RearmFailed:
			// The active is yielding: once asleep it is resumed itself.
			m.phase = Restoring
			m.recordDeath(Standby, ev.At, ev.Cause, false)
			return Transition{To: HandingOver, Cause: "failback: standby died during the handover: " + ev.Cause,
				Actions: []Action{{Kind: FenceStandby}}}
		}
	case Resuming:
		switch ev.Kind {
		case ResumeAcked:
			if m.yieldedDead {
				return m.armStandby("failback: the standby took over; the yielded engine died, re-arming", []Action{{Kind: Swap}})
			}
			return Transition{To: ServingReady, Cause: "failback done: placement restored", Actions: []Action{{Kind: Swap}}}
		case ResumeFailed, StandbyDied:
			if m.yieldedDead {
				return m.coldStart(ev, "failback failed and the yielded engine is gone: "+ev.Cause,
					[]Action{{Kind: FenceStandby}, {Kind: FenceActive}})
			}
			m.phase = Restoring
			m.recordDeath(Standby, ev.At, ev.Cause, false)
			return Transition{To: HandingOver, Cause: "failback failed, resuming the yielded engine: " + ev.Kind.String() + ": " + ev.Cause,
				Actions: []Action{{Kind: FenceStandby}, {Kind: DrainRing}, {Kind: ResumeYielded}}}
		case ActiveDied:
			// The yielded engine sleeps and serves nothing; the standby's resume goes on.
			m.yieldedDead = true
			return Transition{To: HandingOver, Cause: "failback: the yielded engine died: " + ev.Cause,
				Actions: []Action{{Kind: FenceActive}}}
		}
	case Restoring:
		switch ev.Kind {
		case HandoffDone:
			return Transition{To: HandingOver, Cause: "failback: the active yielded with no standby; resuming it",
				Actions: []Action{{Kind: DrainRing}, {Kind: ResumeYielded}}}
		case HandoffFailed:
			return m.afterRestore("failback: the active refused to yield and serves on", nil)
		case ResumeAcked:
			return m.afterRestore("failback: the yielded engine serves again", []Action{{Kind: Publish}})
		case ResumeFailed, ActiveDied:
			return m.coldStart(ev, "failback: the yielded engine could not be resumed: "+ev.Cause,
				[]Action{{Kind: FenceActive}})
		}
	}
	return ignored()
}

// afterRestore: the active serves again after a failed handover; a new
// standby is started after the standby's backoff (its death was recorded).
func (m *Machine) afterRestore(cause string, acts []Action) Transition {
	if m.open[Standby] {
		return Transition{To: ServingDegraded, Cause: cause + "; no standby: " + m.openBy[Standby], Actions: acts}
	}
	return Transition{To: Rearming, Cause: cause, Actions: append(acts, Action{Kind: StartStandby, Delay: m.backoff(Standby)})}
}

// backoff is the delay before restarting role after its recorded deaths.
func (m *Machine) backoff(r Role) time.Duration {
	b := m.cfg.BaseBackoff
	for i := 1; i < len(m.deaths[r]) && b < m.cfg.MaxBackoff; i++ {
		b *= 2
	}
	return min(b, m.cfg.MaxBackoff)
}

// armStandby starts a fresh standby right away (it maps the brokered pools,
// no weight loading), unless the standby's breaker is open.
func (m *Machine) armStandby(cause string, acts []Action) Transition {
	if m.open[Standby] {
		return Transition{To: ServingDegraded, Cause: cause + "; no standby: " + m.openBy[Standby], Actions: acts}
	}
	return Transition{To: Rearming, Cause: cause, Actions: append(acts, Action{Kind: StartStandby})}
}

// restartStandby: a standby that dies while rearming had not become ready.
func (m *Machine) restartStandby(ev Event) Transition {
	backoff, ok := m.recordDeath(Standby, ev.At, ev.Cause, m.state == Rearming)
	fence := []Action{{Kind: FenceStandby}}
	if !ok {
		return Transition{To: ServingDegraded, Cause: "standby not restarted: " + m.openBy[Standby], Actions: fence}
	}
	return Transition{To: Rearming, Cause: "standby died, restarting: " + ev.Cause,
		Actions: append(fence, Action{Kind: StartStandby, Delay: backoff})}
}

// coldStart launches a new active that loads the weights itself: with no
// standby able to take over, open requests cannot be resumed. An active that
// dies while starting had not become ready; one that refused its options
// before anything served is not restarted (a configuration error).
func (m *Machine) coldStart(ev Event, cause string, pre []Action) Transition {
	acts := withAction(pre, Unpublish)
	if m.state == Starting && ev.Kind == ActiveDied && ev.Refused && !m.served && !m.open[Active] {
		m.open[Active] = true
		m.openBy[Active] = "the active refused its options before anything served, a configuration error: " + ev.Cause
		return Transition{To: CrashLoop, Cause: "not restarting: " + m.openBy[Active], Actions: acts}
	}
	backoff, ok := m.recordDeath(Active, ev.At, ev.Cause, m.state == Starting)
	if !ok {
		return Transition{To: CrashLoop, Cause: "not restarting: " + m.openBy[Active], Actions: acts}
	}
	// The cold active runs inside MPS: make sure the daemon answers first.
	acts = withAction(acts, CheckMPS)
	return Transition{To: Starting, Cause: cause, Actions: append(acts, Action{Kind: StartActive, Delay: backoff})}
}

// withAction appends an action of kind k unless acts already has one.
func withAction(acts []Action, k ActionKind) []Action {
	for _, a := range acts {
		if a.Kind == k {
			return acts
		}
	}
	return append(acts, Action{Kind: k})
}

func (m *Machine) trip(ev Event) Transition {
	r := ev.Role
	if !m.open[r] {
		m.open[r] = true
		m.openBy[r] = "breaker tripped for " + r.String() + ": " + ev.Cause
	}
	switch {
	case r == Standby && (m.state == Rearming || m.state == ServingReady):
		return Transition{To: ServingDegraded, Cause: m.openBy[r], Actions: []Action{{Kind: FenceStandby}}}
	case r == Active && m.state == Starting:
		return Transition{To: CrashLoop, Cause: m.openBy[r], Actions: []Action{{Kind: FenceActive}, {Kind: Unpublish}}}
	}
	// In handing_over the open breaker takes effect when the handover ends.
	// Otherwise the open breaker takes effect at the next death.
	return Transition{To: m.state, Cause: m.cause}
}
