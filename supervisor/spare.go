package supervisor

import (
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"time"

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

// spareState is the loop's view of the spares (loop-owned).
type spareState struct {
	pool      []*spareEntry // oldest first
	fails     int
	off       string // why spares are off ("" = on)
	timer     *time.Timer
	seq       uint64
	pairOnce  bool // the pair was ready once: spares may start
	activated uint64
	cold      uint64
	lastReady time.Duration
}

// spareEntry is one spare process.
type spareEntry struct {
	p       Spare
	unwatch chan struct{} // closed when the spare is taken or sent away: its watcher returns
	started time.Time
	ready   bool
}

// find returns the pool's entry of p, or nil (taken already).
func (sp *spareState) find(p Spare) *spareEntry {
	for _, e := range sp.pool {
		if e.p == p {
			return e
		}
	}
	return nil
}

// take removes e from the pool (used or sent away) and ends its watcher.
func (sp *spareState) take(e *spareEntry) {
	close(e.unwatch)
	sp.pool = slices.DeleteFunc(sp.pool, func(x *spareEntry) bool { return x == e })
}

// readyCount: spares whose imports are done.
func (sp *spareState) readyCount() int {
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
func (sp *spareState) next() *spareEntry {
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

// engineEnv is the environment every engine and every spare starts from.
func (s *Supervisor) engineEnv() []string {
	env := slices.Clone(s.cfg.BaseEnv)
	return append(env, "FRMPS_MODULES_FILE="+s.modulesFile())
}

// modulesFile: where the first served engine lists its modules for spares.
func (s *Supervisor) modulesFile() string { return filepath.Join(s.runDir, "engine-modules.txt") }

func (s *Supervisor) sparesEnabled() bool { return s.deps.Spares != nil && s.cfg.sparesOn() }

// maybeStartSpare starts spares until the pool is full. Called after every event.
func (s *Supervisor) maybeStartSpare() {
	if !s.sparesEnabled() {
		return
	}
	sp := &s.spares
	st, _ := s.machine.State()
	if st == failover.ServingReady {
		sp.pairOnce = true
	}
	for st != failover.Stopped && st != failover.CrashLoop && sp.pairOnce && sp.off == "" && sp.timer == nil &&
		len(sp.pool) < s.cfg.spareCount() {
		s.startSpare()
	}
}

// startSpare starts one spare process and its watcher.
func (s *Supervisor) startSpare() {
	sp := &s.spares
	s.nextID++
	logPath := filepath.Join(s.logDir, fmt.Sprintf("spare-%d.log", s.nextID))
	cur, err := s.deps.Spares.StartSpare(s.engineEnv(), logPath, engine.SpareOptions{ModulesFile: s.modulesFile(), Model: s.cfg.Model})
	if err != nil {
		s.spareFailed(fmt.Sprintf("start: %v", err))
		return
	}
	unwatch := make(chan struct{})
	sp.pool = append(sp.pool, &spareEntry{p: cur, unwatch: unwatch, started: time.Now()})
	s.log.Info("spare engine process started", "pid", cur.PID(), "log", logPath)
	s.wg.Add(1)
	go func() { // until the spare is used, sent away or dead
		defer s.wg.Done()
		select {
		case <-cur.Ready():
			s.post(event{kind: evSpareReady, spare: cur, at: time.Now()})
		case <-cur.Done():
		case <-unwatch:
			return
		case <-s.stopped:
			return
		}
		select {
		case <-cur.Done():
			s.post(event{kind: evSpareDied, spare: cur, at: time.Now()})
		case <-unwatch:
		case <-s.stopped:
		}
	}()
	s.syncSpare()
}

// spareReady notes that the spare's imports are done.
func (s *Supervisor) spareReady(ev event) {
	sp := &s.spares
	e := sp.find(ev.spare)
	if e == nil {
		return
	}
	e.ready, sp.fails = true, 0
	sp.lastReady = ev.at.Sub(e.started)
	s.log.Info("spare engine process ready", "pid", ev.spare.PID(), "after", sp.lastReady.Round(time.Millisecond), "said", ev.spare.ReadyLine())
	s.syncSpare()
}

// spareDied handles a spare that exited before it was activated.
func (s *Supervisor) spareDied(ev event) {
	sp := &s.spares
	e := sp.find(ev.spare)
	if e == nil {
		return // activated: its death is an engine's
	}
	sp.take(e)
	if ws := ev.spare.WaitStatus(); ws.Exited() && ws.ExitStatus() == engine.SpareExitDriverInitialised {
		sp.off = "the engine's imports initialise the CUDA driver, so a spare could not be placed in or out of MPS"
		s.log.Error("spares turned off: engines start cold", "why", sp.off)
		s.syncSpare()
		return
	}
	s.spareFailed(fmt.Sprintf("pid %d %s: %s", ev.spare.PID(), describeExit(ev.spare.WaitStatus()), strings.Join(lastN(ev.spare.LastStderr(), 3), " | ")))
}

// spareFailed counts a spare that could not start or died unused, and
// schedules the next one (or turns spares off).
func (s *Supervisor) spareFailed(why string) {
	sp := &s.spares
	sp.fails++
	if sp.fails >= spareMaxFails {
		sp.off = fmt.Sprintf("%d spares in a row failed, the last: %s", sp.fails, why)
		s.log.Error("spares turned off: engines start cold", "why", sp.off)
		s.syncSpare()
		return
	}
	delay := spareBaseBackoff << (sp.fails - 1)
	s.log.Warn("spare engine process failed; starting another later", "why", why, "in", delay)
	sp.seq++
	seq := sp.seq
	sp.timer = time.AfterFunc(delay, func() { s.post(event{kind: evSpareDue, id: seq, at: time.Now()}) })
	s.syncSpare()
}

// spareDue: the backoff after a failed spare elapsed.
func (s *Supervisor) spareDue(ev event) {
	if s.spares.timer == nil || ev.id != s.spares.seq {
		return
	}
	s.spares.timer = nil
}

// launchFromSpare makes a spare the engine of role (spareState.next), if
// there is one that can take env. ok false: launch cold.
func (s *Supervisor) launchFromSpare(role failover.Role, inv engine.Invocation, env []string, logPath string) (Process, bool) {
	sp := &s.spares
	e := sp.next()
	if e == nil {
		if sp.pairOnce && s.sparesEnabled() {
			sp.cold++
			s.syncSpare()
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
	p, err := s.deps.Spares.ActivateSpare(cur, role, inv, env, logPath)
	if err != nil {
		s.log.Warn("cannot use the spare; launching cold", "pid", cur.PID(), "error", err)
		cur.Close(0)
		sp.cold++
		s.syncSpare()
		return nil, false
	}
	sp.activated++
	s.log.Info("engine launched from the spare", "role", role, "pid", p.PID(), "spare_ready", wasReady,
		"spare_age", time.Since(started).Round(time.Millisecond), "spares_left", len(sp.pool))
	s.syncSpare()
	return p, true
}

// stopSpare sends every spare away at shutdown and waits for them.
func (s *Supervisor) stopSpare() {
	sp := &s.spares
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
			s.log.Error("spare survived SIGKILL", "pid", e.p.PID())
		}
	}
	s.syncSpare()
}

// syncSpare publishes the spare's state to Status and metrics.
func (s *Supervisor) syncSpare() {
	sp := &s.spares
	v := &frmpsv1.Spare{Enabled: s.sparesEnabled(), Activations: sp.activated, ColdStarts: sp.cold,
		LastReadySeconds: sp.lastReady.Seconds(), ReadyCount: uint32(sp.readyCount())}
	if v.Enabled {
		v.Size = uint32(s.cfg.spareCount())
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
	s.metrics.spare(v.Enabled, int(v.ReadyCount))
	pids := make([]int, 0, len(sp.pool))
	for _, e := range sp.pool {
		pids = append(pids, e.p.PID())
	}
	s.mu.Lock()
	s.spareStatus, s.sparePIDs = v, pids
	s.mu.Unlock()
}

func lastN(lines []string, n int) []string {
	if len(lines) > n {
		return lines[len(lines)-n:]
	}
	return lines
}
