package failover

import (
	"slices"
	"strings"
	"testing"
	"time"
)

var t0 = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

var testBreaker = BreakerConfig{MaxRestarts: 3, Window: 10 * time.Second, BaseBackoff: 100 * time.Millisecond, MaxBackoff: 1 * time.Second}

// machineIn drives a fresh machine into state s through real events, so the
// table below only tests reachable situations.
func machineIn(t *testing.T, s State) *Machine {
	t.Helper()
	m, err := New(testBreaker)
	if err != nil {
		t.Fatal(err)
	}
	steps := map[State][]EventKind{
		Starting:        nil,
		Rearming:        {ActiveReady},
		ServingReady:    {ActiveReady, StandbyReady},
		FailingOver:     {ActiveReady, StandbyReady, ActiveDied},
		ServingDegraded: {ActiveReady},
		CrashLoop:       nil,
		Stopped:         {Shutdown},
	}[s]
	for _, k := range steps {
		m.Handle(Event{Kind: k, Cause: "setup", At: t0})
	}
	switch s {
	case ServingDegraded:
		m.Handle(Event{Kind: BreakerTripped, Role: Standby, Cause: "setup", At: t0})
	case CrashLoop:
		m.Handle(Event{Kind: BreakerTripped, Role: Active, Cause: "setup", At: t0})
	}
	if got, _ := m.State(); got != s {
		t.Fatalf("setup reached %s, want %s", got, s)
	}
	return m
}

func kinds(acts []Action) []ActionKind {
	out := make([]ActionKind, len(acts))
	for i, a := range acts {
		out[i] = a.Kind
	}
	return out
}

func TestTransitions(t *testing.T) {
	tests := []struct {
		from      State
		ev        EventKind
		cause     string
		to        State
		wantCause string // substring of the recorded cause
		actions   []ActionKind
		ignored   bool
	}{
		{Starting, ActiveReady, "", Rearming, "active ready", []ActionKind{Publish, StartStandby}, false},
		{Starting, ActiveDied, "exit code 1", Starting, "active died while starting: exit code 1", []ActionKind{FenceActive, Unpublish, CheckMPS, StartActive}, false},
		{Starting, StandbyReady, "", Starting, "deployment starting", nil, true},
		{Starting, ResumeAcked, "", Starting, "deployment starting", nil, true},
		{Starting, Shutdown, "SIGTERM", Stopped, "shutdown: SIGTERM", []ActionKind{Unpublish, StopAll}, false},

		{Rearming, StandbyReady, "", ServingReady, "standby ready", nil, false},
		{Rearming, StandbyDied, "segfault", Rearming, "standby died, restarting: segfault", []ActionKind{FenceStandby, StartStandby}, false},
		{Rearming, RearmFailed, "sleep not sent", Rearming, "standby died, restarting: sleep not sent", []ActionKind{FenceStandby, StartStandby}, false},
		{Rearming, ActiveDied, "socket EOF", Starting, "active died before the standby was ready: socket EOF", []ActionKind{FenceActive, FenceStandby, Unpublish, CheckMPS, StartActive}, false},
		{Rearming, ResumeAcked, "", Rearming, "active ready", nil, true},
		{Rearming, Shutdown, "ctx", Stopped, "shutdown: ctx", []ActionKind{Unpublish, StopAll}, false},

		{ServingReady, ActiveDied, "socket EOF", FailingOver, "active died: socket EOF", []ActionKind{FenceActive, DrainRing, SendResume}, false},
		{ServingReady, StandbyDied, "signal 9", Rearming, "standby died, restarting: signal 9", []ActionKind{FenceStandby, StartStandby}, false},
		{ServingReady, RearmFailed, "x", Rearming, "standby died, restarting: x", []ActionKind{FenceStandby, StartStandby}, false},
		{ServingReady, ActiveReady, "", ServingReady, "standby ready", nil, true},
		{ServingReady, BreakerTripped, "manual", ServingDegraded, "breaker tripped for standby: manual", []ActionKind{FenceStandby}, false},
		{ServingReady, Shutdown, "ctx", Stopped, "shutdown: ctx", []ActionKind{Unpublish, StopAll}, false},

		{FailingOver, ResumeAcked, "socket EOF", Rearming, "failed over, re-arming: socket EOF", []ActionKind{Promote, CheckMPS, StartStandby}, false},
		{FailingOver, ResumeFailed, "timeout", Starting, "takeover failed: resume_failed: timeout", []ActionKind{FenceStandby, Unpublish, CheckMPS, StartActive}, false},
		{FailingOver, StandbyDied, "signal 9", Starting, "takeover failed: standby_died: signal 9", []ActionKind{FenceStandby, Unpublish, CheckMPS, StartActive}, false},
		{FailingOver, ActiveDied, "late exit", FailingOver, "active died", nil, true},
		{FailingOver, Shutdown, "ctx", Stopped, "shutdown: ctx", []ActionKind{Unpublish, StopAll}, false},

		{ServingDegraded, ActiveDied, "xid 79", Starting, "active died with no standby: xid 79", []ActionKind{FenceActive, Unpublish, CheckMPS, StartActive}, false},
		{ServingDegraded, StandbyReady, "", ServingDegraded, "breaker tripped", nil, true},

		{CrashLoop, ActiveReady, "", CrashLoop, "breaker tripped for active", nil, true},
		{CrashLoop, ActiveDied, "", CrashLoop, "breaker tripped for active", nil, true},
		{CrashLoop, Shutdown, "ctx", Stopped, "shutdown: ctx", []ActionKind{Unpublish, StopAll}, false},

		{Stopped, ActiveReady, "", Stopped, "shutdown", nil, true},
		{Stopped, Shutdown, "again", Stopped, "shutdown: setup", nil, true},
		{Stopped, ActiveDied, "", Stopped, "shutdown", nil, true},
	}
	for _, tc := range tests {
		t.Run(tc.from.String()+"/"+tc.ev.String(), func(t *testing.T) {
			m := machineIn(t, tc.from)
			role := Standby
			if tc.from == Starting {
				role = Active
			}
			tr := m.Handle(Event{Kind: tc.ev, Role: role, Cause: tc.cause, At: t0.Add(time.Second)})
			if tr.From != tc.from || tr.To != tc.to || tr.Ignored != tc.ignored {
				t.Fatalf("got %s -> %s ignored=%v, want %s -> %s ignored=%v (cause %q)", tr.From, tr.To, tr.Ignored, tc.from, tc.to, tc.ignored, tr.Cause)
			}
			if !strings.Contains(tr.Cause, tc.wantCause) {
				t.Errorf("cause %q, want it to contain %q", tr.Cause, tc.wantCause)
			}
			if got := kinds(tr.Actions); !slices.Equal(got, tc.actions) {
				t.Errorf("actions %v, want %v", got, tc.actions)
			}
			st, cause := m.State()
			if st != tc.to || cause != tr.Cause {
				t.Errorf("machine says %s (%q), transition says %s (%q)", st, cause, tc.to, tr.Cause)
			}
		})
	}
}

func TestStartingBreakerTrippedIsCrashLoop(t *testing.T) {
	m := machineIn(t, Starting)
	tr := m.Handle(Event{Kind: BreakerTripped, Role: Active, Cause: "mps does not start", At: t0})
	if tr.To != CrashLoop || !slices.Equal(kinds(tr.Actions), []ActionKind{FenceActive, Unpublish}) {
		t.Fatalf("got %s %v", tr.To, tr.Actions)
	}
	if open, why := m.BreakerOpen(Active); !open || !strings.Contains(why, "mps does not start") {
		t.Fatalf("breaker open=%v why=%q", open, why)
	}
	if !m.CrashLoopOpen() {
		t.Fatal("CrashLoopOpen false")
	}
}

// A standby that keeps dying is restarted with doubling backoff, then no more.
func TestStandbyCrashLoopBackoff(t *testing.T) {
	m := machineIn(t, Rearming)
	var delays []time.Duration
	for i := range testBreaker.MaxRestarts {
		tr := m.Handle(Event{Kind: StandbyDied, Cause: "exit code 1", At: t0.Add(time.Duration(i) * time.Second)})
		if tr.To != Rearming {
			t.Fatalf("death %d: went to %s (%s)", i+1, tr.To, tr.Cause)
		}
		delays = append(delays, tr.Actions[len(tr.Actions)-1].Delay)
	}
	if want := []time.Duration{100 * time.Millisecond, 200 * time.Millisecond, 400 * time.Millisecond}; !slices.Equal(delays, want) {
		t.Fatalf("backoffs %v, want %v", delays, want)
	}
	tr := m.Handle(Event{Kind: StandbyDied, Cause: "exit code 1", At: t0.Add(3 * time.Second)})
	if tr.To != ServingDegraded || !slices.Equal(kinds(tr.Actions), []ActionKind{FenceStandby}) {
		t.Fatalf("after %d deaths: %s %v", testBreaker.MaxRestarts+1, tr.To, tr.Actions)
	}
	if !strings.Contains(tr.Cause, "standby died 4 times within 10s") {
		t.Fatalf("cause %q", tr.Cause)
	}
	if open, _ := m.BreakerOpen(Standby); !open {
		t.Fatal("standby breaker not open")
	}
	if open, _ := m.BreakerOpen(Active); open {
		t.Fatal("active breaker open")
	}
}

// Deaths of ready engines spread wider than the window never trip the
// breaker, and the backoff falls back to the base.
func TestDeathsOutsideWindowForgotten(t *testing.T) {
	m := machineIn(t, Rearming)
	for i := range 20 {
		at := t0.Add(time.Duration(i) * 11 * time.Second)
		m.Handle(Event{Kind: StandbyReady, At: at})
		tr := m.Handle(Event{Kind: StandbyDied, Cause: "x", At: at.Add(time.Second)})
		if tr.To != Rearming {
			t.Fatalf("death %d tripped: %s", i, tr.Cause)
		}
		if d := tr.Actions[len(tr.Actions)-1].Delay; d != testBreaker.BaseBackoff {
			t.Fatalf("death %d backoff %s", i, d)
		}
	}
}

func TestBackoffCapped(t *testing.T) {
	cfg := BreakerConfig{MaxRestarts: 50, Window: time.Hour, BaseBackoff: time.Second, MaxBackoff: 5 * time.Second}
	m, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	var last time.Duration
	for i := range 10 {
		tr := m.Handle(Event{Kind: ActiveDied, Cause: "x", At: t0.Add(time.Duration(i) * time.Second)})
		last = tr.Actions[len(tr.Actions)-1].Delay
	}
	if last != 5*time.Second {
		t.Fatalf("backoff %s, want the 5s cap", last)
	}
}

// Repeated failovers count against the active: after the limit the machine
// still fails over (the standby is ready) but stops re-arming, and the next
// active death ends in crash_loop rather than a restart storm.
func TestRepeatedFailoversTripActiveBreaker(t *testing.T) {
	m := machineIn(t, ServingReady)
	at := t0
	for i := range testBreaker.MaxRestarts {
		at = at.Add(time.Second)
		m.Handle(Event{Kind: ActiveDied, Cause: "fault", At: at})
		tr := m.Handle(Event{Kind: ResumeAcked, Cause: "fault", At: at})
		if tr.To != Rearming {
			t.Fatalf("failover %d: %s (%s)", i+1, tr.To, tr.Cause)
		}
		m.Handle(Event{Kind: StandbyReady, At: at})
	}
	m.Handle(Event{Kind: ActiveDied, Cause: "fault", At: at})
	tr := m.Handle(Event{Kind: ResumeAcked, Cause: "fault", At: at})
	if tr.To != ServingDegraded || !slices.Equal(kinds(tr.Actions), []ActionKind{Promote, CheckMPS}) {
		t.Fatalf("got %s %v (%s)", tr.To, tr.Actions, tr.Cause)
	}
	tr = m.Handle(Event{Kind: ActiveDied, Cause: "fault", At: at})
	if tr.To != CrashLoop || !slices.Equal(kinds(tr.Actions), []ActionKind{FenceActive, Unpublish}) {
		t.Fatalf("got %s %v (%s)", tr.To, tr.Actions, tr.Cause)
	}
	if tr.To.Serving() {
		t.Fatal("crash_loop must not serve")
	}
}

func TestBadConfig(t *testing.T) {
	for _, c := range []BreakerConfig{
		{MaxRestarts: 0, Window: time.Second},
		{MaxRestarts: 1, Window: 0},
		{MaxRestarts: 1, Window: time.Second, BaseBackoff: 2 * time.Second, MaxBackoff: time.Second},
	} {
		if _, err := New(c); err == nil {
			t.Errorf("New(%+v) accepted", c)
		}
	}
}

func TestNamesTotal(t *testing.T) {
	for s := Starting; s <= Stopped; s++ {
		if strings.HasPrefix(s.String(), "state(") {
			t.Errorf("state %d has no name", s)
		}
	}
	if State(99).String() != "state(99)" || EventKind(-1).String() != "event(-1)" || ActionKind(99).String() != "action(99)" {
		t.Error("out-of-range names")
	}
}

// handoverIn drives a machine into HandingOver at phase p through real events.
func handoverIn(t *testing.T, p HandoverPhase, yieldedDead bool) *Machine {
	t.Helper()
	m := machineIn(t, ServingReady)
	m.Handle(Event{Kind: HandoverDue, Cause: "setup", At: t0})
	switch p {
	case Resuming:
		m.Handle(Event{Kind: HandoffDone, Cause: "setup", At: t0})
	case Restoring:
		m.Handle(Event{Kind: StandbyDied, Cause: "setup", At: t0})
	}
	if yieldedDead {
		m.Handle(Event{Kind: ActiveDied, Cause: "setup", At: t0})
	}
	if st, _ := m.State(); st != HandingOver || m.Handover() != p {
		t.Fatalf("setup reached %s/%s, want handing_over/%s", st, m.Handover(), p)
	}
	return m
}

func TestHandoverTransitions(t *testing.T) {
	tests := []struct {
		phase       HandoverPhase
		yieldedDead bool
		ev          EventKind
		to          State
		toPhase     HandoverPhase
		wantCause   string
		actions     []ActionKind
		ignored     bool
	}{
		{Yielding, false, HandoffDone, HandingOver, Resuming, "the active yielded; resuming the standby", []ActionKind{DrainRing, SendResume}, false},
		{Yielding, false, HandoffFailed, ServingReady, NoHandover, "handover refused: x", nil, false},
		{Yielding, false, ActiveDied, FailingOver, NoHandover, "active died: x", []ActionKind{FenceActive, DrainRing, SendResume}, false},
		{Yielding, false, StandbyDied, HandingOver, Restoring, "standby died during the handover: x", []ActionKind{FenceStandby}, false},
		{Yielding, false, ResumeAcked, HandingOver, Yielding, "", nil, true},
		{Yielding, false, Shutdown, Stopped, NoHandover, "shutdown: x", []ActionKind{Unpublish, StopAll}, false},

		{Resuming, false, ResumeAcked, ServingReady, NoHandover, "failback done: placement restored", []ActionKind{Swap}, false},
		{Resuming, false, ResumeFailed, HandingOver, Restoring, "failback failed, resuming the yielded engine: resume_failed: x", []ActionKind{FenceStandby, DrainRing, ResumeYielded}, false},
		{Resuming, false, StandbyDied, HandingOver, Restoring, "failback failed, resuming the yielded engine: standby_died: x", []ActionKind{FenceStandby, DrainRing, ResumeYielded}, false},
		{Resuming, false, ActiveDied, HandingOver, Resuming, "the yielded engine died: x", []ActionKind{FenceActive}, false},
		{Resuming, true, ResumeAcked, Rearming, NoHandover, "the yielded engine died, re-arming", []ActionKind{Swap, StartStandby}, false},
		{Resuming, true, StandbyDied, Starting, NoHandover, "failback failed and the yielded engine is gone: x", []ActionKind{FenceStandby, FenceActive, Unpublish, CheckMPS, StartActive}, false},
		{Resuming, false, HandoffDone, HandingOver, Resuming, "", nil, true},

		{Restoring, false, HandoffDone, HandingOver, Restoring, "the active yielded with no standby; resuming it", []ActionKind{DrainRing, ResumeYielded}, false},
		{Restoring, false, HandoffFailed, Rearming, NoHandover, "refused to yield and serves on", []ActionKind{StartStandby}, false},
		{Restoring, false, ResumeAcked, Rearming, NoHandover, "the yielded engine serves again", []ActionKind{Publish, StartStandby}, false},
		{Restoring, false, ResumeFailed, Starting, NoHandover, "could not be resumed: x", []ActionKind{FenceActive, Unpublish, CheckMPS, StartActive}, false},
		{Restoring, false, ActiveDied, Starting, NoHandover, "could not be resumed: x", []ActionKind{FenceActive, Unpublish, CheckMPS, StartActive}, false},
		{Restoring, false, StandbyReady, HandingOver, Restoring, "", nil, true},
	}
	for _, tc := range tests {
		name := tc.phase.String() + "/" + tc.ev.String()
		if tc.yieldedDead {
			name += "/yielded-dead"
		}
		t.Run(name, func(t *testing.T) {
			m := handoverIn(t, tc.phase, tc.yieldedDead)
			tr := m.Handle(Event{Kind: tc.ev, Cause: "x", At: t0.Add(time.Second)})
			if tr.Ignored != tc.ignored {
				t.Fatalf("ignored = %v, want %v", tr.Ignored, tc.ignored)
			}
			if tr.To != tc.to || m.Handover() != tc.toPhase {
				t.Fatalf("went to %s/%s, want %s/%s", tr.To, m.Handover(), tc.to, tc.toPhase)
			}
			if !tc.ignored && !strings.Contains(tr.Cause, tc.wantCause) {
				t.Errorf("cause %q, want it to contain %q", tr.Cause, tc.wantCause)
			}
			if got := kinds(tr.Actions); !slices.Equal(got, tc.actions) {
				t.Errorf("actions %v, want %v", got, tc.actions)
			}
		})
	}
}

func TestHandoverOnlyFromServingReady(t *testing.T) {
	for _, st := range []State{Starting, Rearming, FailingOver, ServingDegraded, CrashLoop, Stopped} {
		m := machineIn(t, st)
		if tr := m.Handle(Event{Kind: HandoverDue, At: t0}); !tr.Ignored {
			t.Errorf("%s: handover_due was not ignored: %+v", st, tr)
		}
	}
	m := machineIn(t, ServingReady)
	tr := m.Handle(Event{Kind: HandoverDue, Cause: "placement inverted", At: t0})
	if tr.To != HandingOver || m.Handover() != Yielding || !slices.Equal(kinds(tr.Actions), []ActionKind{SendHandoff}) {
		t.Fatalf("got %+v phase %s", tr, m.Handover())
	}
}

// A standby that keeps dying during handovers trips its breaker: the active
// then serves on without a standby instead of restarting it for ever.
func TestHandoverStandbyDeathsCountAgainstTheBreaker(t *testing.T) {
	m := machineIn(t, ServingReady)
	at := t0
	for i := range testBreaker.MaxRestarts + 1 {
		at = at.Add(time.Second)
		m.Handle(Event{Kind: HandoverDue, At: at})
		m.Handle(Event{Kind: HandoffDone, At: at})
		m.Handle(Event{Kind: StandbyDied, Cause: "mps fault", At: at})
		tr := m.Handle(Event{Kind: ResumeAcked, At: at})
		if i < testBreaker.MaxRestarts {
			if tr.To != Rearming || tr.Actions[len(tr.Actions)-1].Delay <= 0 {
				t.Fatalf("round %d: %+v", i, tr)
			}
			m.Handle(Event{Kind: StandbyReady, At: at})
			continue
		}
		if tr.To != ServingDegraded || !strings.Contains(tr.Cause, "no standby") {
			t.Fatalf("round %d: want serving_degraded, got %+v", i, tr)
		}
	}
}

// A standby the recovering MPS server did not admit is relaunched after
// MPSRetryDelay, any number of times, without opening the standby breaker;
// outside Rearming the same event counts as a death.
func TestStandbyNotAdmittedIsRetriedWithoutTheBreaker(t *testing.T) {
	m := machineIn(t, Rearming)
	for i := range 3 * testBreaker.MaxRestarts {
		tr := m.Handle(Event{Kind: StandbyNotAdmitted, Cause: "exit code 3", At: t0.Add(time.Duration(i) * time.Second)})
		if tr.To != Rearming || !slices.Equal(kinds(tr.Actions), []ActionKind{FenceStandby, StartStandby}) ||
			tr.Actions[1].Delay != MPSRetryDelay || !strings.Contains(tr.Cause, "not admitted") {
			t.Fatalf("relaunch %d: %+v", i, tr)
		}
	}
	if m.CrashLoopOpen() {
		t.Fatal("relaunches of a standby not admitted opened the breaker")
	}
	if tr := m.Handle(Event{Kind: StandbyReady, At: t0.Add(time.Minute)}); tr.To != ServingReady {
		t.Fatalf("after the relaunches: %+v", tr)
	}
	// Serving with a ready standby, the event is an ordinary standby death.
	tr := m.Handle(Event{Kind: StandbyNotAdmitted, Cause: "exit code 3", At: t0.Add(2 * time.Minute)})
	if tr.To != Rearming || !strings.Contains(tr.Cause, "standby died") {
		t.Fatalf("in ServingReady: %+v", tr)
	}
}

// Launches that die before they are ready trip the breaker after
// MaxRestarts restarts in a row, however slowly each fails: here every start
// fails after longer than the window, which never trips the window's count.
// The breaker counts launches, not time.
func TestNeverReadyTripsWhateverThePace(t *testing.T) {
	slow := testBreaker.Window + time.Second
	t.Run("active", func(t *testing.T) {
		m := machineIn(t, Starting)
		launches := 1 // Initial's StartActive
		var tr Transition
		for i := 1; ; i++ {
			tr = m.Handle(Event{Kind: ActiveDied, Cause: "exit code 1: ValueError: bad option", At: t0.Add(time.Duration(i) * slow)})
			if tr.To != Starting {
				break
			}
			launches++
			if launches > 100 {
				t.Fatal("never tripped")
			}
		}
		if launches != testBreaker.MaxRestarts+1 || tr.To != CrashLoop || !strings.Contains(tr.Cause, "never became ready in 4 launches in a row") ||
			!strings.Contains(tr.Cause, "ValueError: bad option") {
			t.Fatalf("after %d launches: %s (%s)", launches, tr.To, tr.Cause)
		}
		if m.EverServed() {
			t.Fatal("EverServed with no engine ever ready")
		}
	})
	t.Run("standby", func(t *testing.T) {
		m := machineIn(t, Rearming)
		var tr Transition
		for i := 1; i <= testBreaker.MaxRestarts+1; i++ {
			tr = m.Handle(Event{Kind: StandbyDied, Cause: "x", At: t0.Add(time.Duration(i) * slow)})
		}
		if tr.To != ServingDegraded || !strings.Contains(tr.Cause, "standby never became ready in 4 launches") {
			t.Fatalf("%s (%s)", tr.To, tr.Cause)
		}
		if !m.EverServed() {
			t.Fatal("the active served: EverServed false")
		}
	})
	t.Run("a ready launch resets the count", func(t *testing.T) {
		m := machineIn(t, Starting)
		at := t0
		for range testBreaker.MaxRestarts {
			at = at.Add(slow)
			m.Handle(Event{Kind: ActiveDied, Cause: "x", At: at})
		}
		m.Handle(Event{Kind: ActiveReady, At: at})
		m.Handle(Event{Kind: StandbyReady, At: at})
		at = at.Add(slow)
		m.Handle(Event{Kind: ActiveDied, Cause: "fault", At: at}) // failing over
		tr := m.Handle(Event{Kind: ResumeFailed, Cause: "x", At: at})
		for i := range testBreaker.MaxRestarts - 1 {
			if tr.To != Starting {
				t.Fatalf("death %d after the ready one: %s (%s)", i, tr.To, tr.Cause)
			}
			at = at.Add(slow)
			tr = m.Handle(Event{Kind: ActiveDied, Cause: "x", At: at})
		}
		if tr.To != Starting {
			t.Fatalf("%s (%s)", tr.To, tr.Cause)
		}
	})
	t.Run("not admitted by MPS does not count", func(t *testing.T) {
		m := machineIn(t, Rearming)
		for i := range 3 * testBreaker.MaxRestarts {
			tr := m.Handle(Event{Kind: StandbyNotAdmitted, Cause: "x", At: t0.Add(time.Duration(i) * slow)})
			if tr.To != Rearming {
				t.Fatalf("relaunch %d: %s (%s)", i, tr.To, tr.Cause)
			}
		}
		tr := m.Handle(Event{Kind: StandbyDied, Cause: "x", At: t0})
		if tr.To != Rearming {
			t.Fatalf("%s (%s)", tr.To, tr.Cause)
		}
	})
}

// An active that refuses its options (the engines' refusal exit) before
// anything served is a configuration error: no restart. After something has
// served, a refusal counts as any death.
func TestRefusedBeforeServingIsNotRestarted(t *testing.T) {
	m := machineIn(t, Starting)
	tr := m.Handle(Event{Kind: ActiveDied, Refused: true, Cause: "engine cannot start: unrecognized arguments: --bogus", At: t0})
	if tr.To != CrashLoop || !slices.Equal(kinds(tr.Actions), []ActionKind{FenceActive, Unpublish}) ||
		!strings.Contains(tr.Cause, "refused its options") || !strings.Contains(tr.Cause, "--bogus") {
		t.Fatalf("%s %v (%s)", tr.To, tr.Actions, tr.Cause)
	}
	if open, _ := m.BreakerOpen(Active); !open || m.EverServed() {
		t.Fatalf("breaker open %v, served %v", open, m.EverServed())
	}

	m = machineIn(t, ServingReady)
	m.Handle(Event{Kind: ActiveDied, Cause: "fault", At: t0})
	m.Handle(Event{Kind: ResumeFailed, Cause: "x", At: t0}) // a cold start
	tr = m.Handle(Event{Kind: ActiveDied, Refused: true, Cause: "refused", At: t0})
	if tr.To != Starting {
		t.Fatalf("a refusal after serving: %s (%s)", tr.To, tr.Cause)
	}
}
