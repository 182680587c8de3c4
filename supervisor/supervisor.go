// Package supervisor runs an active/standby pair of engine processes and
// keeps one of them serving: it launches them, shakes hands over their
// control sockets, brokers the shared pool fds, consumes the forward-state
// ring, detects deaths, and executes the failover state machine's actions.
//
// One goroutine (the loop in Run) owns all state that changes; engine
// connections, process exits, timers and admin requests reach it as events,
// which it dispatches to the owner of each concern: the engines (pair), the
// failover run (failovers), failback, spares, the ring's consumer, hang
// detection, the MPS daemon. Each owner keeps its own state; what other
// goroutines read of it sits under the owner's own lock. The front door
// reads the serving engine through Current, the admin API through Status
// and TriggerFailover.
package supervisor

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/prometheus/client_golang/prometheus"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
	"github.com/frmps/frmps/supervisor/failover"
	"github.com/frmps/frmps/supervisor/leftover"
)

// ErrUnavailable: no engine can serve now and none is coming (crash loop,
// stopped).
var ErrUnavailable = errors.New("no engine available")

// Supervisor runs one deployment. Create with New, then Run once.
type Supervisor struct {
	cfg     Config
	deps    Deps
	log     hclog.Logger
	metrics *metrics
	machine *failover.Machine

	events  chan event
	stopped chan struct{} // closed when the loop has exited
	// gaveUp is closed when the breaker opened before any engine served
	// (GaveUp); gaveUpErr says why (set once, before the close).
	gaveUp    chan struct{}
	gaveUpErr error
	ran       atomic.Bool

	// The owners: each keeps its own state (loop-owned unless its type says
	// otherwise) and the loop dispatches events to them.
	pair      pair         // the engines: launch and the active/standby pair (pair.go)
	failovers failovers    // the resume in progress and the failover records (failover_run.go)
	failback  failback     // the failback policy and the handover in progress (failback.go)
	spares    spares       // the spare processes (spare.go)
	ring      ringConsumer // the forward-state ring's consumer (ring.go)
	hang      hangWatch    // hang detection of the serving active (hang.go)
	mps       mpsDaemon    // the MPS daemon the engines run in (mpsdaemon.go)
	limit     modelLimit   // the served model's context limit (modellimit.go)

	// Loop-owned.
	pending []event
	cmdSeq  uint64         // the id of the last command (Resume, Handoff) sent to an engine
	wg      sync.WaitGroup // the owners' goroutines (engines, spares' watchers, checks), waited for at shutdown

	// Set before the loop starts (SetFrontDoor, SetWatchdog, setup) and read
	// while it runs; cleanup clears the dirs after it ends.
	frontDoor     FrontDoor
	watchdog      Watchdog
	watchdogEvery time.Duration
	deployID      string
	stateDir      *leftover.Dir // nil: no launch record
	runDir        string
	logDir        string

	// Read by Current/Status from other goroutines.
	mu            sync.Mutex
	current       *slot
	generation    uint64
	changed       chan struct{}
	unavailable   error
	state         failover.State
	stateCause    string
	crashLoopOpen atomic.Bool
}

// New checks cfg and prepares a supervisor bound to the real collaborators.
func New(cfg Config, log hclog.Logger, reg prometheus.Registerer) (*Supervisor, error) {
	deps, err := defaultDeps(cfg, log)
	if err != nil {
		return nil, err
	}
	return NewWithDeps(cfg, deps, log, reg)
}

// NewWithDeps is New with explicit collaborators (tests, other engines).
func NewWithDeps(cfg Config, deps Deps, log hclog.Logger, reg prometheus.Registerer) (*Supervisor, error) {
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, fmt.Errorf("supervisor config: %w", err)
	}
	if m := deps.missing(); m != "" {
		return nil, fmt.Errorf("supervisor deps: %s is not set", m)
	}
	if !cfg.NoMPS && (deps.StartMPS == nil || deps.OutsideEnv == nil) {
		return nil, errors.New("supervisor deps: MPS is enabled but StartMPS/OutsideEnv are not set")
	}
	machine, err := failover.New(cfg.Breaker)
	if err != nil {
		return nil, err
	}
	if log == nil {
		log = hclog.NewNullLogger()
	}
	m, err := newMetrics(reg, cfg.Model)
	if err != nil {
		return nil, err
	}
	idb := make([]byte, 8)
	_, _ = rand.Read(idb)
	s := &Supervisor{
		cfg: cfg, deps: deps, log: log, metrics: m, machine: machine,
		events: make(chan event, 64), stopped: make(chan struct{}), gaveUp: make(chan struct{}),
		changed:  make(chan struct{}),
		deployID: hex.EncodeToString(idb),
	}
	s.limit.configured = cfg.MaxModelLen
	s.pair = pair{cfg: &s.cfg, deps: deps, log: log, metrics: m, post: s.post, enqueue: s.enqueue, stopped: s.stopped,
		wg: &s.wg, spares: &s.spares, limit: &s.limit, deployID: s.deployID, beat: cfg.hangPolicy().beatInterval(),
		slots: map[*slot]struct{}{}}
	s.ring.log, s.ring.every = log, cfg.PollInterval
	s.failovers = failovers{timeout: cfg.ResumeTimeout, syncEvery: cfg.SyncEvery, maxRecords: cfg.MaxFailoverRecords,
		log: log, metrics: m, post: s.post, wg: &s.wg, classify: s.pair.classify}
	s.mps = mpsDaemon{log: log, post: s.post, wg: &s.wg, window: cfg.MPSRecoveryWindow, noFaultWatch: cfg.NoMPSFaultWatch,
		state: "disabled"}
	s.failback = failback{delay: cfg.FailbackDelay, base: cfg.FailbackBaseBackoff, max: cfg.FailbackMaxBackoff,
		timeout: cfg.HandoffTimeout, log: log, metrics: m, post: s.post}
	s.hang = hangWatch{policy: cfg.hangPolicy(), runWait: deps.RunWait}
	s.spares = spares{launcher: deps.Spares, model: cfg.Model, log: log, metrics: m,
		post: s.post, stopped: s.stopped, wg: &s.wg, env: s.engineEnv, modules: s.modulesFile,
		logPath: s.pair.spareLogPath}
	if cfg.sparesOn() {
		s.spares.size = cfg.spareCount()
	}
	s.state, s.stateCause = machine.State()
	m.ringLagFn(func() float64 { return float64(s.ring.lag.Load()) })
	m.ringResyncsFn(func() float64 { return float64(s.ring.resyncs.Load()) })
	return s, nil
}

// SetFrontDoor tells the supervisor whose open requests to resume. Call
// before Run; nil means no request is ever resumed.
func (s *Supervisor) SetFrontDoor(fd FrontDoor) { s.frontDoor = fd }

// Model is the served model's name and context limit: --max-model-len when
// given, else what the serving engine reported through its Health call (0
// until one did).
func (s *Supervisor) Model() (name string, maxModelLen int) {
	name = s.cfg.ServedModelName
	if name == "" {
		name = s.cfg.Model
	}
	return name, s.limit.get()
}

// Current blocks until an engine with generation >= minGeneration serves,
// and returns its generation client. It returns an error wrapping
// ErrUnavailable when none will (crash loop, stopped), or ctx's error.
func (s *Supervisor) Current(ctx context.Context, minGeneration uint64) (frmpsv1.GenerationClient, uint64, error) {
	for {
		s.mu.Lock()
		cur, gen, ch, unav := s.current, s.generation, s.changed, s.unavailable
		s.mu.Unlock()
		if cur != nil && gen >= minGeneration {
			return cur.gen, gen, nil
		}
		if unav != nil {
			return nil, 0, unav
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return nil, 0, fmt.Errorf("wait for an engine: %w", ctx.Err())
		}
	}
}

// Serving reports, without blocking, whether an engine takes requests now.
func (s *Supervisor) Serving() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.current != nil
}

func (s *Supervisor) setUnavailable(err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.unavailable = err
	close(s.changed)
	s.changed = make(chan struct{})
}

// publish makes sl the engine Current returns, with a new generation.
func (s *Supervisor) publish(sl *slot) {
	if !s.limit.known() && sl.gen != nil {
		s.wg.Add(1)
		go func() { defer s.wg.Done(); s.limit.learn(context.Background(), sl.gen, s.log) }()
	}
	s.failovers.published(s.generation + 1) // the loop is the only writer of generation
	s.mu.Lock()
	defer s.mu.Unlock()
	s.current = sl
	s.unavailable = nil
	s.generation++
	close(s.changed)
	s.changed = make(chan struct{})
}

func (s *Supervisor) unpublish(err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.current = nil
	s.unavailable = err
	close(s.changed)
	s.changed = make(chan struct{})
}

// NoteResumedToken is called by the front door when the first token of a
// stream resumed on engine generation gen reaches its client: the failover
// that promoted gen then records death-to-first-resumed-token. Cheap; safe
// from any goroutine.
func (s *Supervisor) NoteResumedToken(gen uint64, at time.Time) {
	s.failovers.noteResumedToken(gen, at)
}

// TriggerFailover kills the active on purpose (a drill). It fails when no
// standby is ready.
func (s *Supervisor) TriggerFailover(ctx context.Context, reason string) error {
	if reason == "" {
		reason = "operator"
	}
	reason = strings.TrimSpace(reason)
	resp := make(chan error, 1)
	select {
	case s.events <- event{kind: evDrill, cause: reason, resp: resp, at: time.Now()}:
	case <-s.stopped:
		return errors.New("supervisor stopped")
	case <-ctx.Done():
		return ctx.Err()
	}
	select {
	case err := <-resp:
		return err
	case <-s.stopped:
		return errors.New("supervisor stopped")
	case <-ctx.Done():
		return ctx.Err()
	}
}

// GaveUp is closed when the deployment gave up before it ever served: the
// crash-loop breaker opened while no engine had been ready (a configuration
// error, an engine that cannot start). Nothing is restarted after that, and
// with nothing ever served there is no deployment to keep up: the caller
// should shut down and report GiveUpErr. Once something has served, a crash
// loop keeps the supervisor up (status and metrics report it), and this
// channel never closes.
func (s *Supervisor) GaveUp() <-chan struct{} { return s.gaveUp }

// GiveUpErr is why the deployment gave up (nil until GaveUp is closed): one
// line with the breaker's cause and the dead engine's reason.
func (s *Supervisor) GiveUpErr() error {
	select {
	case <-s.gaveUp:
		return s.gaveUpErr
	default:
		return nil
	}
}

// giveUp closes GaveUp once (loop goroutine).
func (s *Supervisor) giveUp(err error) {
	select {
	case <-s.gaveUp:
	default:
		s.gaveUpErr = err
		close(s.gaveUp)
		s.log.Error("giving up: the breaker opened before any engine served", "error", err)
	}
}
