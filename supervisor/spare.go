package supervisor

import (
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"
	"google.golang.org/protobuf/proto"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
	"github.com/frmps/frmps/supervisor/engine"
	"github.com/frmps/frmps/supervisor/failover"
)

// Spares: engine processes started ahead of need (Config.Spare, one by
// default, Config.Spares of them). After a
// fault the supervisor launches an engine (the fresh standby, which failback
// then makes the active inside MPS); with vLLM most of that start-up is
// Python importing torch and vLLM, none of which depends on the role or on
// MPS. A spare has done it already and waits for its command line, so the
// engine launched after a fault starts at vLLM's own initialisation.
//
// The first spares start once the pair is ready (so they do not slow the
// first start-up); a consumed spare is replaced at once; one that dies
// unused is restarted with a backoff, and after spareMaxFails deaths in a
// row (or a preload that initialised the CUDA driver) spares are turned off
// and engines start cold, as without them. Everything here runs on the loop.
//
// More than one spare is for faults that come faster than a spare's imports
// (20-30 s with vLLM on an H100 host): each restore consumes one, and the
// next restore would otherwise wait for its replacement's imports.

const (
	spareMaxFails    = 3
	spareBaseBackoff = 2 * time.Second
	// spareStopGrace: a spare sent away at shutdown exits at once once it
	// reads its end of input; one still importing is killed after this.
	spareStopGrace = 2 * time.Second
)

// spares owns the spare processes: the pool, its backoff and its counts
// (loop-owned), and what Status shows of them (under mu).
type spares struct {
	launcher SpareLauncher // nil: engines always start cold
	size     int           // spares to keep; 0: spares are off
	model    string
	log      hclog.Logger
	metrics  *metrics
	post     func(event)     // to the loop, from a spare's watcher
	stopped  <-chan struct{} // closed when the loop has exited
	wg       *sync.WaitGroup // the watchers, waited for at shutdown
	// env is what a spare starts from (the engines' environment); modules is
	// the file the first served engine lists its modules in; logPath names the
	// next spare's log.
	env     func() []string
	modules func() string
	logPath func() string

	pool      []*spareEntry // oldest first
	fails     int
	off       string // why spares are off ("" = on)
	timer     *time.Timer
	seq       uint64
	pairOnce  bool // the pair was ready once: spares may start
	activated uint64
	cold      uint64
	lastReady time.Duration

	mu     sync.Mutex
	status *frmpsv1.Spare
	pids   []int // the spare processes' pids, for Status's host memory
}

// spareEntry is one spare process.
type spareEntry struct {
	p       Spare
	unwatch chan struct{} // closed when the spare is taken or sent away: its watcher returns
	started time.Time
	ready   bool
}

// find returns the pool's entry of p, or nil (taken already).
func (sp *spares) find(p Spare) *spareEntry {
	for _, e := range sp.pool {
		if e.p == p {
			return e
		}
	}
	return nil
}

// take removes e from the pool (used or sent away) and ends its watcher.
func (sp *spares) take(e *spareEntry) {
	close(e.unwatch)
	sp.pool = slices.DeleteFunc(sp.pool, func(x *spareEntry) bool { return x == e })
}

// readyCount: spares whose imports are done.
func (sp *spares) readyCount() int {
	n := 0
	for _, e := range sp.pool {
		if e.ready {
			n++
		}
	}
	return n
}

// next: the spare the next launch takes: the oldest ready one, else the
// oldest still importing (the nearest to ready), skipping any that died
// (their death event is on the way); nil if none.
func (sp *spares) next() *spareEntry {
	var importing *spareEntry
	for _, e := range sp.pool {
		select {
		case <-e.p.Done():
			continue
		default:
		}
		if e.ready {
			return e
		}
		if importing == nil {
			importing = e
		}
	}
	return importing
}

func (sp *spares) enabled() bool { return sp.launcher != nil && sp.size > 0 }

// fill starts spares until the pool is full, once the pair (in state st)
// was ready. Called after every event.
func (sp *spares) fill(st failover.State) {
	if !sp.enabled() {
		return
	}
	if st == failover.ServingReady {
		sp.pairOnce = true
	}
	for st != failover.Stopped && st != failover.CrashLoop && sp.pairOnce && sp.off == "" && sp.timer == nil &&
		len(sp.pool) < sp.size {
		sp.start()
	}
}

// start starts one spare process and its watcher.
func (sp *spares) start() {
	logPath := sp.logPath()
	cur, err := sp.launcher.StartSpare(sp.env(), logPath, engine.SpareOptions{ModulesFile: sp.modules(), Model: sp.model})
	if err != nil {
		sp.failed(fmt.Sprintf("start: %v", err))
		return
	}
	unwatch := make(chan struct{})
	sp.pool = append(sp.pool, &spareEntry{p: cur, unwatch: unwatch, started: time.Now()})
	sp.log.Info("spare engine process started", "pid", cur.PID(), "log", logPath)
	sp.wg.Add(1)
	go func() { // until the spare is used, sent away or dead
		defer sp.wg.Done()
		select {
		case <-cur.Ready():
			sp.post(event{kind: evSpareReady, spare: cur, at: time.Now()})
		case <-cur.Done():
		case <-unwatch:
			return
		case <-sp.stopped:
			return
		}
		select {
		case <-cur.Done():
			sp.post(event{kind: evSpareDied, spare: cur, at: time.Now()})
		case <-unwatch:
		case <-sp.stopped:
		}
	}()
	sp.sync()
}

// ready notes that a spare's imports are done (evSpareReady).
func (sp *spares) ready(ev event) {
	e := sp.find(ev.spare)
	if e == nil {
		return
	}
	e.ready, sp.fails = true, 0
	sp.lastReady = ev.at.Sub(e.started)
	sp.log.Info("spare engine process ready", "pid", ev.spare.PID(), "after", sp.lastReady.Round(time.Millisecond), "said", ev.spare.ReadyLine())
	sp.sync()
}

// died handles a spare that exited before it was activated (evSpareDied).
func (sp *spares) died(ev event) {
	e := sp.find(ev.spare)
	if e == nil {
		return // activated: its death is an engine's
	}
	sp.take(e)
	if ws := ev.spare.WaitStatus(); ws.Exited() && ws.ExitStatus() == engine.SpareExitDriverInitialised {
		sp.off = "the engine's imports initialise the CUDA driver, so a spare could not be placed in or out of MPS"
		sp.log.Error("spares turned off: engines start cold", "why", sp.off)
		sp.sync()
		return
	}
	sp.failed(fmt.Sprintf("pid %d %s: %s", ev.spare.PID(), describeExit(ev.spare.WaitStatus()), strings.Join(lastN(ev.spare.LastStderr(), 3), " | ")))
}

// failed counts a spare that could not start or died unused, and schedules
// the next one (or turns spares off).
func (sp *spares) failed(why string) {
	sp.fails++
	if sp.fails >= spareMaxFails {
		sp.off = fmt.Sprintf("%d spares in a row failed, the last: %s", sp.fails, why)
		sp.log.Error("spares turned off: engines start cold", "why", sp.off)
		sp.sync()
		return
	}
	delay := spareBaseBackoff << (sp.fails - 1)
	sp.log.Warn("spare engine process failed; starting another later", "why", why, "in", delay)
	sp.seq++
	seq := sp.seq
	sp.timer = time.AfterFunc(delay, func() { sp.post(event{kind: evSpareDue, id: seq, at: time.Now()}) })
	sp.sync()
}

// due: the backoff after a failed spare elapsed (evSpareDue).
func (sp *spares) due(ev event) {
	if sp.timer == nil || ev.id != sp.seq {
		return
	}
	sp.timer = nil
}

// launch makes a spare the engine of role (next), if there is one that can
// take env. ok false: launch cold.
func (sp *spares) launch(role failover.Role, inv engine.Invocation, env []string, logPath string) (Process, bool) {
	e := sp.next()
	if e == nil {
		if sp.pairOnce && sp.enabled() {
			sp.cold++
			sp.sync()
		}
		return nil, false
	}
	cur, started := e.p, e.started
	sp.take(e)
	wasReady := false
	select {
	case <-cur.Ready():
		wasReady = true
	default:
	}
	p, err := sp.launcher.ActivateSpare(cur, role, inv, env, logPath)
	if err != nil {
		sp.log.Warn("cannot use the spare; launching cold", "pid", cur.PID(), "error", err)
		cur.Close(0)
		sp.cold++
		sp.sync()
		return nil, false
	}
	sp.activated++
	sp.log.Info("engine launched from the spare", "role", role, "pid", p.PID(), "spare_ready", wasReady,
		"spare_age", time.Since(started).Round(time.Millisecond), "spares_left", len(sp.pool))
	sp.sync()
	return p, true
}

// stop sends every spare away at shutdown and waits for them.
func (sp *spares) stop() {
	if sp.timer != nil {
		sp.timer.Stop()
		sp.timer = nil
	}
	pool := slices.Clone(sp.pool)
	for _, e := range pool {
		sp.take(e)
		e.p.Close(spareStopGrace)
	}
	deadline := time.After(10 * time.Second)
	for _, e := range pool {
		select {
		case <-e.p.Done():
		case <-deadline:
			sp.log.Error("spare survived SIGKILL", "pid", e.p.PID())
		}
	}
	sp.sync()
}

// sync publishes the spares' state to Status and metrics.
func (sp *spares) sync() {
	v := &frmpsv1.Spare{Enabled: sp.enabled(), Activations: sp.activated, ColdStarts: sp.cold,
		LastReadySeconds: sp.lastReady.Seconds(), ReadyCount: uint32(sp.readyCount())}
	if v.Enabled {
		v.Size = uint32(sp.size)
	}
	next := sp.next()
	switch {
	case !v.Enabled:
		v.State = "off"
	case sp.off != "":
		v.State = "off: " + sp.off
	case next != nil && next.ready:
		v.State, v.Pid = "ready", int32(next.p.PID())
	case next != nil:
		v.State, v.Pid = "importing", int32(next.p.PID())
	case sp.timer != nil:
		v.State = "backoff"
	default:
		v.State = "none"
	}
	sp.metrics.spare(v.Enabled, int(v.ReadyCount))
	pids := make([]int, 0, len(sp.pool))
	for _, e := range sp.pool {
		pids = append(pids, e.p.PID())
	}
	sp.mu.Lock()
	sp.status, sp.pids = v, pids
	sp.mu.Unlock()
}

// shown is what Status shows of the spares (a copy; nil before the first
// sync) and their processes' pids.
func (sp *spares) shown() (*frmpsv1.Spare, []int) {
	sp.mu.Lock()
	defer sp.mu.Unlock()
	if sp.status == nil {
		return nil, nil
	}
	return proto.Clone(sp.status).(*frmpsv1.Spare), sp.pids
}

func lastN(lines []string, n int) []string {
	if len(lines) > n {
		return lines[len(lines)-n:]
	}
	return lines
}
