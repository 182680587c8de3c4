// Package supervisor runs an active/standby pair of engine processes and
// keeps one of them serving: it launches them, shakes hands over their
// control sockets, brokers the shared pool fds, consumes the forward-state
// ring, detects deaths, and executes the failover state machine's actions.
//
// One goroutine (the loop in Run) owns all state that changes; engine
// connections, process exits, timers and admin requests reach it as events.
// The front door reads the serving engine through Current, the admin API
// through Status and TriggerFailover.
package supervisor

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/prometheus/client_golang/prometheus"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
	"github.com/frmps/frmps/supervisor/engine"
	"github.com/frmps/frmps/supervisor/failover"
	"github.com/frmps/frmps/supervisor/leftover"
)

// Config of one deployment.
type Config struct {
	Model     string // preset name or model directory, passed to the engine
	Engine    string // --engine of the engine CLI, which validates it (frmps_engine.sdk.adapters)
	Python    string // interpreter for Python engines
	SyncEvery uint32 // ring publish interval in engine steps
	RunDir    string // created 0700, must not exist; empty: a fresh temp dir
	// LogDir keeps the engines' log files (<role>-<n>.log) after exit; empty:
	// inside RunDir, removed with it.
	LogDir       string
	RingDir      string // where the ring file goes; empty: /dev/shm if present, else RunDir
	RingCapacity uint64 // bytes
	// StateDir holds launch records (package leftover): at start the ring,
	// run dir and MPS daemon of supervisors that died without cleaning up
	// are removed, and this one's record is kept until it has cleaned up.
	// Empty: no launch record. frmps serve defaults it to
	// leftover.DefaultDir().
	StateDir string
	NoMPS    bool
	// MPSControlBinary is nvidia-cuda-mps-control (looked up in PATH when bare).
	MPSControlBinary string
	// MPSPipeDir joins the operator's MPS daemon at this pipe directory
	// instead of starting one: frmps places the active in it, checks that it
	// answers and never starts, stops or restarts it. MPSLogDir is that
	// daemon's log directory, given to the active when set.
	MPSPipeDir string
	MPSLogDir  string
	// NvidiaSMI reads the GPU's compute mode at start ("" = nvidia-smi in PATH).
	NvidiaSMI   string
	Device      string // cpu | cuda
	Memory      string // host-shm | cuda-vmm
	NumBlocks   int
	MaxModelLen int
	// EngineArgs are appended to every engine's command line (engine-specific
	// options the supervisor does not interpret).
	EngineArgs []string
	Breaker    failover.BreakerConfig
	// PollInterval between ring polls; 0 means 500µs.
	PollInterval time.Duration
	// HandshakeTimeout bounds launch → Ready; 0 means 10 minutes (weights load).
	HandshakeTimeout time.Duration
	// ResumeTimeout bounds Resume → Reply; 0 means 30s.
	ResumeTimeout time.Duration
	// ShutdownGrace is how long engines get to exit after Shutdown; 0 means 10s.
	ShutdownGrace time.Duration
	// Hang detection (hang.go) fences a serving active that is connected but
	// wedged. HeartbeatTimeout: its heartbeats stopped for this long (the
	// process is stopped or frozen as a whole); 0 means 1s; negative disables
	// hang detection. StepTimeoutFactor, StepTimeoutMin: a step that runs
	// longer than max(StepTimeoutMin, StepTimeoutFactor × the engine's own
	// estimate for it) is hung; 0 means 8 and 1s. StepTimeoutDefault bounds a
	// step the engine has no estimate for (its first serving steps, a batch far
	// larger than any it measured), and judges engines without hang reporting;
	// 0 means 60s. Engines that send no heartbeats are not judged.
	HeartbeatTimeout   time.Duration
	StepTimeoutFactor  float64
	StepTimeoutMin     time.Duration
	StepTimeoutDefault time.Duration
	// MaxFailoverRecords kept for status; 0 means 32.
	MaxFailoverRecords int
	// NoFailback keeps the pair where a failover left it (the active outside
	// MPS). By default, after a failover the fresh standby starts inside MPS
	// and the pair swaps in a planned handover once it is ready.
	NoFailback bool
	// FailbackDelay is the wait between the standby in MPS being ready and the
	// handover (0: at once).
	FailbackDelay time.Duration
	// FailbackBaseBackoff and FailbackMaxBackoff space handovers after failed
	// ones: the base doubled per consecutive failure, capped. 0 means 1s and 5m.
	FailbackBaseBackoff time.Duration
	FailbackMaxBackoff  time.Duration
	// HandoffTimeout bounds Handoff → the active's reply (it finishes one step
	// and publishes); an active that does not yield in time is fenced and the
	// standby takes over. 0 means 10s.
	HandoffTimeout time.Duration
	// BaseEnv is the environment every engine starts from; nil means os.Environ().
	BaseEnv []string
}

func (c *Config) setDefaults() {
	if c.SyncEvery == 0 {
		c.SyncEvery = DefaultSyncEvery
	}
	if c.FailbackBaseBackoff == 0 {
		c.FailbackBaseBackoff = time.Second
	}
	if c.FailbackMaxBackoff == 0 {
		c.FailbackMaxBackoff = 5 * time.Minute
	}
	if c.HandoffTimeout == 0 {
		c.HandoffTimeout = 10 * time.Second
	}
	if c.RingCapacity == 0 {
		c.RingCapacity = 8 << 20
	}
	if c.PollInterval == 0 {
		c.PollInterval = 500 * time.Microsecond
	}
	if c.HandshakeTimeout == 0 {
		c.HandshakeTimeout = 10 * time.Minute
	}
	if c.ResumeTimeout == 0 {
		c.ResumeTimeout = 30 * time.Second
	}
	if c.ShutdownGrace == 0 {
		c.ShutdownGrace = 10 * time.Second
	}
	if c.HeartbeatTimeout == 0 {
		c.HeartbeatTimeout = time.Second
	}
	if c.StepTimeoutFactor == 0 {
		c.StepTimeoutFactor = 8
	}
	if c.StepTimeoutMin == 0 {
		c.StepTimeoutMin = time.Second
	}
	if c.StepTimeoutDefault == 0 {
		c.StepTimeoutDefault = time.Minute
	}
	if c.MaxFailoverRecords == 0 {
		c.MaxFailoverRecords = 32
	}
	if c.Breaker == (failover.BreakerConfig{}) {
		c.Breaker = failover.DefaultBreaker
	}
	if c.Memory == "" {
		c.Memory = "host-shm"
	}
	if c.BaseEnv == nil {
		c.BaseEnv = os.Environ()
	}
}

func (c *Config) validate() error {
	switch {
	case c.Model == "":
		return errors.New("model is required")
	case c.Engine == "":
		return errors.New("engine is required")
	case c.Memory != "host-shm" && c.Memory != "cuda-vmm":
		return fmt.Errorf("memory %q: want host-shm or cuda-vmm", c.Memory)
	case c.Device != "" && c.Device != "cpu" && c.Device != "cuda":
		return fmt.Errorf("device %q: want cpu or cuda", c.Device)
	case c.RingCapacity < 4096:
		return fmt.Errorf("ring capacity %d is below 4096 bytes", c.RingCapacity)
	case c.FailbackDelay < 0 || c.FailbackBaseBackoff < 0 || c.FailbackMaxBackoff < c.FailbackBaseBackoff:
		return fmt.Errorf("failback timing: want 0 <= delay (%s), 0 <= base backoff (%s) <= max backoff (%s)", c.FailbackDelay, c.FailbackBaseBackoff, c.FailbackMaxBackoff)
	case c.MPSPipeDir != "" && c.NoMPS:
		return errors.New("an MPS pipe directory to join and no MPS: choose one")
	case c.MPSPipeDir != "" && !filepath.IsAbs(c.MPSPipeDir):
		return fmt.Errorf("MPS pipe directory %q: want an absolute path", c.MPSPipeDir)
	case c.MPSLogDir != "" && c.MPSPipeDir == "":
		return errors.New("an MPS log directory is for a joined daemon: give its pipe directory too")
	case c.StepTimeoutFactor < 1:
		return fmt.Errorf("step timeout factor %g: want at least 1 (a step may take what the engine expects)", c.StepTimeoutFactor)
	case c.StepTimeoutMin < 0 || c.StepTimeoutDefault < 0:
		return fmt.Errorf("step timeouts %s / %s: want positive durations", c.StepTimeoutMin, c.StepTimeoutDefault)
	}
	if err := c.Breaker.Validate(); err != nil {
		return err
	}
	return nil
}

// DefaultSyncEvery is the ring publish interval in engine steps: every step.
// The publish overlaps the device's pass, so it costs no measurable
// throughput, and a takeover then replays at most the one token sampled after
// the last sync (bench/results/2026-11-22-h100: sync overhead).
const DefaultSyncEvery = 1

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
	ran     atomic.Bool

	// Loop-owned.
	pending    []event
	nextID     int
	active     *slot
	standby    *slot
	slots      map[*slot]struct{} // every slot not yet cleaned up
	broker     Broker
	mps        MPS
	mpsBusy    bool
	mpsErr     error // the last MPS check/restart failed: no active can start in it
	startAfter [2]*time.Timer
	startSeq   [2]uint64
	wantStart  [2]bool // a start is due but waits (MPS check in progress)
	inflight   *failoverRun
	handover   *handoverRun
	failback   failbackPolicy
	resumeSeq  uint64
	frontDoor  FrontDoor
	deployID   string
	stateDir   *leftover.Dir // nil: no launch record
	ringPath   string
	runDir     string
	logDir     string
	wg         sync.WaitGroup // engine goroutines

	ringMu sync.Mutex
	ring   Ring

	// Read by Current/Status from other goroutines.
	mu          sync.Mutex
	current     *slot
	generation  uint64
	changed     chan struct{}
	unavailable error
	state       failover.State
	stateCause  string
	records     []*frmpsv1.FailoverRecord
	// awaitingFirstToken: failover records, by the generation they promoted,
	// whose first resumed token has not reached a client yet.
	awaitingFirstToken map[uint64]pendingFirstToken
	failbackStatus     *frmpsv1.Failback
	// failbackFirstTokenSeconds: the last handover's Handoff sent -> first resumed token.
	failbackFirstTokenSeconds float64
	recordSeq                 uint64
	mpsState                  string
	shown                     [2]*slot
	// detectToResume: death detected → Resume sent, for benchmarks (bounded).
	detectToResume []time.Duration
	crashLoopOpen  atomic.Bool
	ringLag        atomic.Uint64
	learnedMaxLen  atomic.Uint32
	ringResyncs    atomic.Uint64
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
		events: make(chan event, 64), stopped: make(chan struct{}),
		slots: map[*slot]struct{}{}, changed: make(chan struct{}),
		deployID: hex.EncodeToString(idb), mpsState: "disabled",
	}
	s.state, s.stateCause = machine.State()
	m.ringLagFn(func() float64 { return float64(s.ringLag.Load()) })
	m.ringResyncsFn(func() float64 { return float64(s.ringResyncs.Load()) })
	return s, nil
}

// SetFrontDoor tells the supervisor whose open requests to resume. Call
// before Run; nil means no request is ever resumed.
func (s *Supervisor) SetFrontDoor(fd FrontDoor) { s.frontDoor = fd }

// Model is the served model's name and context limit: --max-model-len when
// given, else what the serving engine reported through its Health call (0
// until one did).
func (s *Supervisor) Model() (name string, maxModelLen int) {
	if s.cfg.MaxModelLen > 0 {
		return s.cfg.Model, s.cfg.MaxModelLen
	}
	return s.cfg.Model, int(s.learnedMaxLen.Load())
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
	go func() { defer close(pollDone); s.pollRing(pollCtx) }()
	defer func() {
		stopPoll()
		<-pollDone
		s.cleanup()
	}()

	s.log.Info("deployment starting", "model", s.cfg.Model, "engine", s.cfg.Engine, "run_dir", s.runDir, "ring", s.ringPath, "mps", !s.cfg.NoMPS)
	s.execute(s.machine.Initial(), failover.Event{At: time.Now()})
	done := ctx.Done()
	var watchdog <-chan time.Time
	if p := s.cfg.hangPolicy(); p.enabled() {
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
		}
	}
}

func (s *Supervisor) setup(ctx context.Context) error {
	if s.cfg.Device == "cuda" && s.deps.CheckComputeMode != nil {
		if err := s.deps.CheckComputeMode(ctx, envValue(s.cfg.BaseEnv, "CUDA_VISIBLE_DEVICES")); err != nil {
			return fmt.Errorf("check the GPU: %w", err)
		}
	}
	if s.cfg.StateDir != "" {
		d, err := leftover.OpenDir(s.cfg.StateDir)
		if err != nil {
			return err
		}
		s.cleanLeftovers(ctx, d)
		s.stateDir = d
	}
	runDir := s.cfg.RunDir
	if runDir == "" {
		d, err := os.MkdirTemp("", "frmps-")
		if err != nil {
			return fmt.Errorf("create run dir: %w", err)
		}
		runDir = d
	} else if err := os.Mkdir(runDir, 0o700); err != nil {
		return fmt.Errorf("create run dir (is another frmps using it?): %w", err)
	}
	s.runDir = runDir
	if err := os.Chmod(runDir, 0o700); err != nil { // MkdirTemp is 0700, Mkdir obeys umask
		return fmt.Errorf("chmod run dir: %w", err)
	}
	s.logDir = s.cfg.LogDir
	if s.logDir == "" {
		s.logDir = filepath.Join(runDir, "logs")
	}
	if err := os.MkdirAll(s.logDir, 0o700); err != nil {
		return fmt.Errorf("create engine log dir: %w", err)
	}
	ringDir := s.cfg.RingDir
	if ringDir == "" {
		ringDir = runDir
		if fi, err := os.Stat("/dev/shm"); err == nil && fi.IsDir() {
			ringDir = "/dev/shm"
		}
	}
	s.ringPath = filepath.Join(ringDir, "frmps-"+s.deployID+".ring")
	if err := s.writeLaunchRecord(); err != nil {
		s.ringPath = "" // not created
		return err
	}
	ring, err := s.deps.OpenRing(s.ringPath, s.cfg.RingCapacity)
	if err != nil {
		s.ringPath = "" // not ours to remove
		return fmt.Errorf("open ring: %w", err)
	}
	// Status may already be reading these from another goroutine.
	s.ringMu.Lock()
	s.ring = ring
	s.ringMu.Unlock()
	s.mu.Lock()
	s.broker = s.deps.NewBroker()
	s.mu.Unlock()
	if !s.cfg.NoMPS {
		mps, err := s.deps.StartMPS(ctx, runDir, s.log.Named("mps"))
		if err != nil {
			return fmt.Errorf("start MPS (use --no-mps to run without): %w", err)
		}
		s.mps = mps
		if mps.Owned() {
			s.setMPSState("running")
		} else {
			s.setMPSState("joined the operator's daemon at " + s.cfg.MPSPipeDir)
		}
	}
	return nil
}

// envValue is key's value in env (the last one wins, as for exec); "" if unset.
func envValue(env []string, key string) string {
	v := ""
	for _, kv := range env {
		if k, val, ok := strings.Cut(kv, "="); ok && k == key {
			v = val
		}
	}
	return v
}

// cleanup releases what setup acquired; idempotent.
func (s *Supervisor) cleanup() {
	if s.mps != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		if err := s.mps.Stop(ctx); err != nil {
			s.log.Warn("stop MPS", "error", err)
		}
		cancel()
		s.mps = nil
		s.setMPSState("stopped")
	}
	s.ringMu.Lock()
	if s.ring != nil {
		if err := s.ring.Close(); err != nil {
			s.log.Warn("close ring", "error", err)
		}
		s.ring = nil
	}
	s.ringMu.Unlock()
	cleaned := true // the launch record goes only once what it names is gone
	if s.ringPath != "" {
		if err := os.Remove(s.ringPath); err != nil && !errors.Is(err, os.ErrNotExist) {
			s.log.Warn("remove ring", "error", err)
			cleaned = false
		}
	}
	s.mu.Lock()
	b := s.broker
	s.broker = nil
	s.mu.Unlock()
	if b != nil {
		if err := b.Close(); err != nil {
			s.log.Warn("close fd broker", "error", err)
		}
	}
	if s.runDir != "" {
		if err := os.RemoveAll(s.runDir); err != nil {
			s.log.Warn("remove run dir", "error", err)
			cleaned = false
		}
		s.runDir = ""
	}
	if s.stateDir != nil && cleaned {
		if err := s.stateDir.Remove(s.deployID); err != nil {
			s.log.Warn("remove launch record", "error", err)
		}
		s.stateDir = nil
	}
}

// cleanLeftovers removes what supervisors that died without their cleanup
// left (their ring, run dir and private MPS daemon). Failures are logged:
// they do not stop this deployment, and the record stays for a later try.
func (s *Supervisor) cleanLeftovers(ctx context.Context, d *leftover.Dir) {
	stale, err := d.Stale()
	if err != nil {
		s.log.Warn("launch records", "dir", d.Path(), "error", err)
	}
	for _, st := range stale {
		r := st.Record
		if err := leftover.Clean(ctx, r, s.deps.StopLeftoverMPS); err != nil {
			s.log.Warn("clean up after a dead supervisor", "pid", r.Owner.PID, "why", st.Why, "record", st.Name, "error", err)
			continue
		}
		if err := d.Remove(st.Name); err != nil {
			s.log.Warn("clean up after a dead supervisor", "pid", r.Owner.PID, "error", err)
			continue
		}
		s.log.Warn("cleaned up after a supervisor that died without doing so", "pid", r.Owner.PID, "why", st.Why, "ring", r.Ring, "run_dir", r.RunDir)
	}
}

// writeLaunchRecord records this supervisor and what it creates outside
// its process, before the ring and the MPS daemon exist (the run dir is
// already ours: created exclusively).
func (s *Supervisor) writeLaunchRecord() error {
	if s.stateDir == nil {
		return nil
	}
	self, err := leftover.Self()
	if err != nil {
		return fmt.Errorf("launch record: %w", err)
	}
	r := leftover.Record{Owner: self, Written: time.Now(), Ring: s.ringPath, RunDir: s.runDir}
	if !s.cfg.NoMPS && s.cfg.MPSPipeDir == "" { // an operator's daemon is never ours to stop
		r.PrivateMPS, r.MPSControl = true, s.cfg.MPSControlBinary
	}
	return s.stateDir.Write(s.deployID, r)
}

// pollRing consumes the ring into the snapshot. The interval adapts: it
// doubles (up to 16× PollInterval) while the ring is idle and snaps back at
// the first record, so an idle deployment does not spin. Freshness at a
// failover does not depend on it: the failover drains the ring first.
// Nothing is logged per record; errors only when their text changes.
func (s *Supervisor) pollRing(ctx context.Context) {
	interval := s.cfg.PollInterval
	t := time.NewTimer(interval)
	defer t.Stop()
	var lastErr string
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		s.ringMu.Lock()
		if s.ring == nil {
			s.ringMu.Unlock()
			return
		}
		n, err := s.ring.Poll()
		s.ringLag.Store(s.ring.Lag())
		s.ringResyncs.Store(s.ring.Resyncs())
		s.ringMu.Unlock()
		if msg := errString(err); msg != lastErr {
			if msg != "" {
				s.log.Warn("ring poll", "error", msg)
			}
			lastErr = msg
		}
		if n > 0 || err != nil {
			interval = s.cfg.PollInterval
		} else if interval < 16*s.cfg.PollInterval {
			interval *= 2
		}
		t.Reset(interval)
	}
}

func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

// drainRing consumes everything committed, so the snapshot is as fresh as
// the dead active left it.
func (s *Supervisor) drainRing() {
	s.ringMu.Lock()
	defer s.ringMu.Unlock()
	if s.ring == nil {
		return
	}
	for range 64 { // bounded: a live writer cannot keep us here
		n, err := s.ring.Poll()
		if err != nil {
			s.log.Warn("drain ring", "error", err)
		}
		if n == 0 && err == nil {
			break
		}
	}
	s.ringLag.Store(s.ring.Lag())
	s.ringResyncs.Store(s.ring.Resyncs())
}

func (s *Supervisor) resumeSet() []*frmpsv1.ResumeRequest {
	if s.frontDoor == nil {
		return nil
	}
	reqs := s.frontDoor.OpenRequests()
	s.ringMu.Lock()
	defer s.ringMu.Unlock()
	for _, r := range reqs {
		if r == nil || s.ring == nil {
			continue
		}
		if snap, ok := s.ring.Snapshot(r.GetKey()); ok {
			r.Snapshot = snap
		}
	}
	return reqs
}

func (s *Supervisor) setMPSState(st string) {
	s.mu.Lock()
	s.mpsState = st
	s.mu.Unlock()
}

func (s *Supervisor) setUnavailable(err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.unavailable = err
	close(s.changed)
	s.changed = make(chan struct{})
}

type pendingFirstToken struct {
	detected time.Time
	set      func(seconds float64) // called with s.mu held
}

// NoteResumedToken is called by the front door when the first token of a
// stream resumed on engine generation gen reaches its client: the failover
// that promoted gen then records death-to-first-resumed-token. Cheap; safe
// from any goroutine.
func (s *Supervisor) NoteResumedToken(gen uint64, at time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if p, ok := s.awaitingFirstToken[gen]; ok {
		p.set(at.Sub(p.detected).Seconds())
		delete(s.awaitingFirstToken, gen)
	}
}

// publish makes sl the engine Current returns, with a new generation.
func (s *Supervisor) publish(sl *slot) {
	if s.cfg.MaxModelLen == 0 && s.learnedMaxLen.Load() == 0 && sl.gen != nil {
		s.wg.Add(1)
		go func() { defer s.wg.Done(); s.learnMaxModelLen(sl.gen) }()
	}
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

// learnMaxModelLen asks a serving engine for its context limit (best effort).
func (s *Supervisor) learnMaxModelLen(c frmpsv1.GenerationClient) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	h, err := c.Health(ctx, &frmpsv1.HealthRequest{})
	if err != nil {
		s.log.Debug("engine health", "error", err)
		return
	}
	s.learnedMaxLen.Store(h.GetMaxModelLen())
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

var _ io.Closer = nopCloser{}

type nopCloser struct{}

func (nopCloser) Close() error { return nil }

func (s *Supervisor) invocation(role failover.Role, id int) engine.Invocation {
	r := engine.RoleActive
	if role == failover.Standby {
		r = engine.RoleStandby
	}
	return engine.Invocation{
		Role:             r,
		Model:            s.cfg.Model,
		ControlSocket:    filepath.Join(s.runDir, fmt.Sprintf("ctl-%d.sock", id)),
		GenerationSocket: filepath.Join(s.runDir, fmt.Sprintf("gen-%d.sock", id)),
		Memory:           s.cfg.Memory,
		Device:           s.cfg.Device,
		NumBlocks:        s.cfg.NumBlocks,
		MaxModelLen:      s.cfg.MaxModelLen,
		ExtraArgs:        s.cfg.EngineArgs,
	}
}
