package supervisor

import (
	"errors"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/go-hclog"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
	"github.com/frmps/frmps/supervisor/deathcause"
	"github.com/frmps/frmps/supervisor/failover"
)

// pair owns the engine processes: the active and the standby, every slot not
// yet cleaned up, and the starts that wait (loop-owned); the fd broker and
// the block count pinned by the first active, which the engines' goroutines
// read, and the engines Status shows (under mu). It launches engines
// (launch.go) and runs each one's goroutine (engines.go); the loop decides
// when.
type pair struct {
	cfg      *Config // read-only
	deps     Deps
	log      hclog.Logger
	metrics  *metrics
	post     func(event)     // to the loop, from the engines' goroutines and timers
	enqueue  func(event)     // from inside the loop (a launch that failed)
	stopped  <-chan struct{} // closed when the loop has exited
	wg       *sync.WaitGroup // the engines' goroutines, waited for at shutdown
	spares   *spares         // a launch takes a spare first
	limit    *modelLimit     // learned from the first active
	deployID string
	beat     time.Duration // the heartbeat period asked of engines (hang.go)
	// Set by setup, before the loop starts: where engines' sockets and logs
	// go, and the ring the active writes.
	runDir, logDir, ringPath string
	// sizeRing sees the first active's Hello.ring_record_bytes before its
	// Welcome names the ring (ringConsumer.fit); nil: the ring stays as made.
	sizeRing  func(recordBytes uint64)
	ringNamed atomic.Bool // a Welcome has named the ring: it is in use

	nextID     int // of the last engine or spare launched (names sockets and logs)
	active     *slot
	standby    *slot
	slots      map[*slot]struct{} // every slot not yet cleaned up
	startAfter [2]*time.Timer     // a delayed start of each role
	startSeq   [2]uint64
	wantStart  [2]bool // a start is due but waits (MPS check in progress)

	mu     sync.Mutex
	broker Broker
	// numBlocks: the KV block count an engine chose itself (Config.NumBlocks
	// 0: the vLLM adapter sizes its cache), from the first active's Hello;
	// every engine launched after it gets it (invocation), so the standby
	// derives the active's pool layout.
	numBlocks int
	// lastDead: the last engine of each role that died: Status shows its
	// cause beside the engine that replaced it.
	lastDead [2]*slot
	shown    [2]*slot
}

func (p *pair) slotOf(r failover.Role) *slot {
	if r == failover.Active {
		return p.active
	}
	return p.standby
}

func (p *pair) set(r failover.Role, sl *slot) {
	if r == failover.Active {
		p.active = sl
	} else {
		p.standby = sl
	}
}

func (p *pair) isLive(sl *slot) bool { return sl == p.active || sl == p.standby }

// promote makes the resumed standby the active and retires the old active
// (action Promote); the caller publishes it.
func (p *pair) promote() {
	old := p.active
	p.active, p.standby = p.standby, nil
	p.active.mu.Lock() // Status and the reader read role concurrently
	p.active.role = failover.Active
	p.active.beats.stepSince = time.Now() // it slept until now
	p.active.mu.Unlock()
	p.active.setState("serving")
	p.metrics.up(failover.Active, true)
	p.metrics.up(failover.Standby, false)
	p.retire(old)
}

// serve marks the ready active serving (action Publish); the caller
// publishes it.
func (p *pair) serve() {
	p.active.setState("serving")
	p.metrics.up(failover.Active, true)
}

// swap makes the resumed standby the active and the yielded active the
// standby (action Swap); the caller publishes the new active.
func (p *pair) swap() {
	yielded, next := p.active, p.standby
	p.active, p.standby = next, nil
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
		p.standby = yielded
	} else if yielded != nil {
		p.retire(yielded)
	}
	p.metrics.up(failover.Active, true)
	p.metrics.up(failover.Standby, p.standby != nil)
}

// dropDeadActive retires a dead active (action Unpublish).
func (p *pair) dropDeadActive() {
	if a := p.active; a != nil && a.dead {
		p.active = nil
		p.retire(a)
	}
}

// dropStandby fences and retires the standby (action FenceStandby) and
// returns it.
func (p *pair) dropStandby() *slot {
	p.cancelStart(failover.Standby) // a backoff pending for the dead standby
	sb := p.standby
	p.standby = nil
	p.fence(sb)
	p.retire(sb)
	p.classifyDeath(sb)
	return sb
}

// inverted: the active runs outside MPS and a ready standby inside.
func (p *pair) inverted() bool {
	a, sb := p.active, p.standby
	return a != nil && sb != nil && !a.dead && !sb.dead && !a.inMPS && sb.inMPS && sb.state == "ready"
}

// placementOK: the active runs in MPS and the standby (if any) outside it,
// or MPS is off.
func (p *pair) placementOK(mpsOn bool) bool {
	if !mpsOn {
		return true
	}
	a, sb := p.active, p.standby
	if a == nil || a.dead || !a.inMPS {
		return false
	}
	return sb == nil || sb.dead || !sb.inMPS
}

// reap forgets retired slots whose process is gone (a handful at most),
// and removes their socket files: nothing listens on them any more.
func (p *pair) reap() {
	for sl := range p.slots {
		if p.isLive(sl) {
			continue
		}
		select {
		case <-sl.proc.Done():
			delete(p.slots, sl)
			for _, path := range []string{sl.genSocket, sl.ctlSocket} {
				if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
					p.log.Warn("remove a dead engine's socket", "path", path, "error", err)
				}
			}
		default:
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
func (p *pair) fenceFirst(sl *slot) {
	if p.cfg.TensorParallelSize > 1 {
		p.fence(sl)
		return
	}
	if err := sl.proc.KillLeader(); err != nil {
		p.log.Error("fence engine", "role", sl.role, "pid", sl.proc.PID(), "error", err)
		p.fence(sl) // the group then, at once
		return
	}
	sl.dead = true
	sl.groupPending = true
}

// fence kills a slot's process group; the slot stays until retired.
func (p *pair) fence(sl *slot) {
	if sl == nil {
		return
	}
	if err := sl.proc.Kill(); err != nil {
		p.log.Error("fence engine", "role", sl.role, "pid", sl.proc.PID(), "error", err)
	}
	sl.dead = true
}

// retire closes a fenced slot's connection and socket; its goroutines end
// and its process is reaped by the launcher.
func (p *pair) retire(sl *slot) {
	if sl == nil {
		return
	}
	sl.cancel()
	if c := sl.getConn(); c != nil {
		_ = c.Close()
	}
	if err := sl.listener.Close(); err != nil {
		p.log.Debug("close control listener", "error", err)
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
func (p *pair) classifyDeath(sl *slot) {
	if sl == nil || !sl.dead || sl.deathClass != "" {
		return
	}
	role := sl.role
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		class, detail := p.classify(sl)
		sl.mu.Lock()
		cause := sl.deathCause
		sl.deathCause = class + ": " + detail
		sl.mu.Unlock()
		p.log.Warn("engine death", "role", role, "pid", sl.proc.PID(), "class", class, "detail", detail, "seen_as", cause,
			"log", sl.proc.LogPath())
	}()
}

// classify waits (bounded) for the fenced process to be reaped.
func (p *pair) classify(sl *slot) (string, string) {
	select {
	case <-sl.proc.Done():
	case <-time.After(5 * time.Second):
		return "unknown", "engine not reaped within 5s of the fence"
	}
	sl.mu.Lock()
	fault := sl.fault
	sl.mu.Unlock()
	return p.deps.Classify(sl.proc.WaitStatus(), sl.proc.LastStderr(), fault)
}

// ready takes a live engine's finished handshake (evReady): it prepares the
// engine's generation client and says which machine event it makes; ok false
// for an engine dead or replaced meanwhile, an error when the client cannot
// be made (a death).
func (p *pair) ready(ev event) (fev failover.Event, ok bool, err error) {
	sl := ev.slot
	if sl.dead || !p.isLive(sl) {
		return fev, false, nil
	}
	if err := p.dialGeneration(sl); err != nil {
		return fev, false, err
	}
	sl.setState("ready")
	p.metrics.up(sl.role, true)
	if sl.role == failover.Active {
		return failover.Event{Kind: failover.ActiveReady, At: ev.at, Cause: "handshake done"}, true, nil
	}
	return failover.Event{Kind: failover.StandbyReady, At: ev.at, Cause: "asleep with the brokered pools"}, true, nil
}

// startExitWait bounds how long died waits for an active that died before
// it was ready to exit on its own (its control socket closes as it exits).
const startExitWait = time.Second

// engineExitRefused is the engines' exit code for "refused at start" (bad
// configuration, pool mismatch): never the MPS server's doing (ENGINE.md).
const engineExitRefused = 2

// startFailure: an active that died before it was ready while nothing has
// served yet. Nobody waits on its fence (no standby, no requests), so first
// let it exit on its own (bounded), for its exit code (the engines' refusal
// of their options) and its stderr's reason, which the SIGKILL would hide:
// the cause with that reason, and whether the engine refused to start (that
// exit code, or a refused handshake). An engine past starting is left as it is.
func (p *pair) startFailure(sl *slot, cause string) (string, bool) {
	sl.mu.Lock()
	starting := sl.state == "starting"
	refusedHello := sl.refused != ""
	sl.mu.Unlock()
	if !starting {
		return cause, false
	}
	select {
	case <-sl.proc.Done():
	case <-time.After(startExitWait):
		return cause, refusedHello
	}
	ws := sl.proc.WaitStatus()
	refused := ws.Exited() && ws.ExitStatus() == engineExitRefused
	if why := deathcause.Reason(sl.proc.LastStderr()); why != "" && !strings.Contains(cause, why) {
		cause += ": " + why
	}
	return cause, refused || refusedHello
}

// buried marks a dead engine dead for Status, with its cause (a refused
// handshake's reason first) and class, and logs its death: the cause as
// recorded, whether it had been ready, whether its handshake was refused.
func (p *pair) buried(sl *slot, cause, class string) (string, bool, bool) {
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
	p.mu.Lock()
	p.lastDead[sl.role] = sl
	p.mu.Unlock()
	p.metrics.up(sl.role, false)
	if refused {
		p.log.Error("engine refused", "role", sl.role, "pid", sl.proc.PID(), "cause", cause)
	} else {
		p.log.Warn("engine died", "role", sl.role, "pid", sl.proc.PID(), "cause", cause)
	}
	return cause, wasReady, refused
}

// shutdown stops every engine: Shutdown with the grace period, then the
// group kill, and waits (bounded) for them to be reaped.
func (p *pair) shutdown(grace time.Duration) {
	for sl := range p.slots {
		c := sl.getConn()
		switch {
		case sl.dead:
		case c == nil: // not connected yet: nobody to ask politely
			p.fence(sl)
		default:
			if err := c.Send(&frmpsv1.Envelope{Msg: &frmpsv1.Envelope_Shutdown{Shutdown: &frmpsv1.Shutdown{GraceMs: uint32(grace.Milliseconds())}}}, nil); err != nil {
				p.fence(sl)
			}
		}
	}
	deadline := time.NewTimer(grace)
	defer deadline.Stop()
	for sl := range p.slots {
		select {
		case <-sl.proc.Done():
		case <-deadline.C:
			deadline.Reset(0) // the rest get no more grace
		}
	}
	for sl := range p.slots {
		p.fence(sl)
		p.retire(sl)
	}
	for sl := range p.slots {
		select {
		case <-sl.proc.Done():
		case <-time.After(10 * time.Second):
			p.log.Error("engine survived SIGKILL", "pid", sl.proc.PID())
		}
		delete(p.slots, sl)
	}
	p.active, p.standby = nil, nil
}

// syncShown publishes the engine slots to Status; a dead engine stays
// visible (with its cause) until its replacement starts.
func (p *pair) syncShown() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.active != nil {
		p.shown[0] = p.active
	}
	if p.standby != nil {
		p.shown[1] = p.standby
	}
	if p.shown[1] == p.shown[0] {
		p.shown[1] = nil
	}
}

// shownSlots: the engines Status shows.
func (p *pair) shownSlots() []*slot {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []*slot
	for _, sl := range p.shown {
		if sl != nil {
			out = append(out, sl)
		}
	}
	return out
}

// lastDeathCause: the cause of the last death of an engine in sl's role, if
// that was another engine (the one sl replaced, or an earlier one); "" if none.
func (p *pair) lastDeathCause(sl *slot) string {
	r := sl.roleNow()
	p.mu.Lock()
	d := p.lastDead[r]
	p.mu.Unlock()
	if d == nil || d == sl {
		return ""
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.deathCause
}
