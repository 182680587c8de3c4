package supervisor

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
	"github.com/frmps/frmps/supervisor/failover"
)

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
	fev   failover.Event
}

// slot is one engine process and its control connection.
type slot struct {
	id        int
	role      failover.Role
	proc      Process
	listener  ControlListener
	started   time.Time
	inMPS     bool
	genSocket string
	ctlSocket string
	cancel    context.CancelFunc // ends the handshake / reader goroutine
	restartNo uint32

	mu         sync.Mutex // fields below are set by the engine goroutine
	conn       ControlConn
	hello      *frmpsv1.Hello
	fault      *frmpsv1.Fault
	state      string
	deathCause string
	refused    string // why the handshake refused this engine
	beats      beats  // what its Heartbeats said (hang.go)

	// loop-owned
	dead  bool
	probe cpuProbe // CPU waits during a hang suspicion (hang.go)
	gen   frmpsv1.GenerationClient
	genC  io.Closer
}

func (sl *slot) setState(st string) {
	sl.mu.Lock()
	sl.state = st
	sl.mu.Unlock()
}

// roleNow is the slot's role for goroutines other than the loop (the loop
// changes it at promotion).
func (sl *slot) roleNow() failover.Role {
	sl.mu.Lock()
	defer sl.mu.Unlock()
	return sl.role
}

func (sl *slot) getConn() ControlConn {
	sl.mu.Lock()
	defer sl.mu.Unlock()
	return sl.conn
}

// resumeKind says why an engine is being resumed.
type resumeKind int

const (
	resumeFailover resumeKind = iota // the active died; the standby takes over
	resumeHandover                   // failback: the active yielded; the standby takes over
	resumeRestore                    // failback failed: the yielded active takes its requests back
)

// failoverRun is the resume in progress (a failover's, or a handover's).
type failoverRun struct {
	kind     resumeKind
	target   *slot // the engine being resumed
	detected time.Time
	sent     time.Time
	cause    string
	old      *slot
	class    string // known death class (drill, stalled, hung); "" = classify the exit
	count    int
	resumeID uint64
	timer    *time.Timer
}

func (s *Supervisor) handle(ev event) {
	switch ev.kind {
	case evReady:
		if ev.slot.dead || !s.isLive(ev.slot) {
			return
		}
		if err := s.dialGeneration(ev.slot); err != nil {
			s.died(ev.slot, err.Error(), ev.at, "")
			return
		}
		ev.slot.setState("ready")
		if ev.slot.role == failover.Active {
			s.metrics.up(failover.Active, true)
			s.step(failover.Event{Kind: failover.ActiveReady, At: ev.at, Cause: "handshake done"})
		} else {
			s.metrics.up(failover.Standby, true)
			s.step(failover.Event{Kind: failover.StandbyReady, At: ev.at, Cause: "asleep with the brokered pools"})
		}
	case evDied:
		s.died(ev.slot, ev.cause, ev.at, "")
	case evReply:
		if s.handoffReply(ev) {
			break
		}
		fo := s.inflight
		if fo == nil || ev.slot != fo.target || ev.id != fo.resumeID {
			return // a stale or unsolicited reply
		}
		fo.timer.Stop()
		if !ev.reply.GetOk() {
			s.step(failover.Event{Kind: failover.ResumeFailed, At: ev.at, Cause: "standby refused resume: " + ev.reply.GetError()})
			return
		}
		s.step(failover.Event{Kind: failover.ResumeAcked, At: ev.at, Cause: fo.cause})
		s.finishFailover(fo, ev.at, ev.reply, nil)
	case evResumeTimeout:
		if fo := s.inflight; fo != nil && fo.resumeID == ev.id {
			s.step(failover.Event{Kind: failover.ResumeFailed, At: ev.at, Cause: fmt.Sprintf("no reply to resume within %s", s.cfg.ResumeTimeout)})
		}
	case evStartDue:
		if t := s.startAfter[ev.role]; t == nil || ev.id != s.startSeq[ev.role] {
			return // cancelled after it fired
		}
		s.startAfter[ev.role] = nil
		s.start(ev.role)
	case evMPSChecked:
		s.mpsBusy = false
		s.mpsErr = ev.err
		for _, r := range []failover.Role{failover.Active, failover.Standby} {
			if s.wantStart[r] {
				s.wantStart[r] = false
				s.start(r)
			}
		}
	case evDrill:
		st, _ := s.machine.State()
		if st != failover.ServingReady || s.active == nil {
			ev.resp <- fmt.Errorf("no failover possible in state %s: it needs a ready standby", st)
			return
		}
		ev.resp <- nil
		s.log.Info("failover drill: killing the active", "pid", s.active.proc.PID(), "reason", ev.cause)
		s.died(s.active, "drill: "+ev.cause, ev.at, "drill")
	case evShutdown:
		s.step(failover.Event{Kind: failover.Shutdown, At: ev.at, Cause: ev.cause})
	case evStep:
		s.step(ev.fev)
	case evHandoverDue:
		s.handoverDue(ev)
	case evHandoffTimeout:
		s.handoffTimeout(ev)
	case evPing:
		ev.resp <- nil
	}
	s.reap()
	s.syncShown()
	s.maybeScheduleHandover()
}

// reap forgets retired slots whose process is gone (a handful at most),
// and removes their socket files: nothing listens on them any more.
func (s *Supervisor) reap() {
	for sl := range s.slots {
		if s.isLive(sl) {
			continue
		}
		select {
		case <-sl.proc.Done():
			delete(s.slots, sl)
			for _, p := range []string{sl.genSocket, sl.ctlSocket} {
				if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
					s.log.Warn("remove a dead engine's socket", "path", p, "error", err)
				}
			}
		default:
		}
	}
}

// checkStall fences the serving active when hang detection judges it wedged
// (hang.go): its heartbeats stopped, or its step in progress overran its bound.
func (s *Supervisor) checkStall(now time.Time) {
	sl := s.active
	if sl == nil || sl.dead {
		return
	}
	if st, _ := s.machine.State(); !st.Serving() {
		return
	}
	sl.mu.Lock()
	b := sl.beats
	sl.mu.Unlock()
	p := s.cfg.hangPolicy()
	episode := p.suspicion(b, now)
	if episode != sl.probe.episode {
		sl.probe = cpuProbe{episode: episode}
		if episode != "" && s.deps.RunWait != nil {
			if w, ok := s.deps.RunWait(sl.proc.PID()); ok {
				sl.probe.at, sl.probe.waits = now, w
			}
		}
	}
	class, detail := p.verdict(b, now, 0)
	if class != "" && sl.probe.waits != nil {
		// Past the threshold: how much of it did the engine spend waiting for a CPU?
		if w, ok := s.deps.RunWait(sl.proc.PID()); ok {
			class, detail = p.verdict(b, now, sl.probe.waitedSince(w, now))
		}
	}
	if class == "" {
		return
	}
	s.log.Error("active engine is wedged; fencing it", "pid", sl.proc.PID(), "class", class, "detail", detail)
	s.died(sl, detail, now, class)
}

// raise queues a machine event from inside an action.
func (s *Supervisor) raise(ev failover.Event) { s.enqueue(event{kind: evStep, fev: ev}) }

// dialGeneration prepares the client of a ready engine's generation API
// (lazily connected), so promoting it later costs nothing.
func (s *Supervisor) dialGeneration(sl *slot) error {
	sl.mu.Lock()
	endpoint := sl.hello.GetGenerationEndpoint()
	sl.mu.Unlock()
	if endpoint == "" {
		endpoint = "unix://" + sl.genSocket
	}
	c, closer, err := s.deps.DialGeneration(endpoint)
	if err != nil {
		return fmt.Errorf("generation API %s: %w", endpoint, err)
	}
	sl.gen, sl.genC = c, closer
	return nil
}

func (s *Supervisor) slotOf(r failover.Role) *slot {
	if r == failover.Active {
		return s.active
	}
	return s.standby
}

func (s *Supervisor) isLive(sl *slot) bool { return sl == s.active || sl == s.standby }

// died handles the first report of a slot's death; later ones are ignored.
// class names the death when it is known without looking at the exit
// (a drill, a stall): the fence's SIGKILL would otherwise be the cause.
func (s *Supervisor) died(sl *slot, cause string, at time.Time, class string) {
	if sl == nil || sl.dead || !s.isLive(sl) {
		return
	}
	sl.dead = true
	sl.mu.Lock()
	refused := sl.refused != ""
	if refused && !strings.HasPrefix(cause, "hello refused") {
		cause = sl.refused + " (" + cause + ")"
	}
	sl.state = "dead"
	sl.deathCause = cause
	sl.mu.Unlock()
	s.metrics.up(sl.role, false)
	if refused {
		s.log.Error("engine refused", "role", sl.role, "pid", sl.proc.PID(), "cause", cause)
	} else {
		s.log.Warn("engine died", "role", sl.role, "pid", sl.proc.PID(), "cause", cause)
	}
	kind := failover.StandbyDied
	if sl.role == failover.Active {
		kind = failover.ActiveDied
	}
	st, _ := s.machine.State()
	if kind == failover.ActiveDied && (st == failover.ServingReady || s.machine.Handover() == failover.Yielding) {
		s.inflight = &failoverRun{kind: resumeFailover, target: s.standby, detected: at, cause: cause, old: sl, class: class}
	}
	s.step(failover.Event{Kind: kind, At: at, Cause: cause})
}

// step feeds the machine and executes its actions.
func (s *Supervisor) step(ev failover.Event) {
	tr := s.machine.Handle(ev)
	if tr.Ignored {
		return
	}
	s.mu.Lock()
	s.state, s.stateCause = tr.To, tr.Cause
	s.mu.Unlock()
	s.crashLoopOpen.Store(s.machine.CrashLoopOpen())
	s.metrics.crashLoop(s.machine.CrashLoopOpen())
	if tr.From != tr.To || len(tr.Actions) > 0 {
		lvl := s.log.Info
		if tr.To == failover.CrashLoop || tr.To == failover.ServingDegraded {
			lvl = s.log.Error
		}
		lvl("state", "from", tr.From, "to", tr.To, "event", ev.Kind, "cause", tr.Cause, "actions", fmt.Sprint(tr.Actions))
	}
	s.execute(tr.Actions, ev)
	s.noteHandoverStep(tr)
	if tr.From == failover.HandingOver && tr.To != failover.HandingOver {
		s.endHandover(tr)
	}
	if tr.To == failover.CrashLoop {
		s.unpublish(fmt.Errorf("%w: crash loop: %s", ErrUnavailable, tr.Cause))
	}
	s.syncFailback()
}

func (s *Supervisor) execute(acts []failover.Action, ev failover.Event) {
	for _, a := range acts {
		switch a.Kind {
		case failover.FenceActive:
			s.fence(s.active)
			if fo := s.inflight; fo != nil && fo.target == s.active {
				s.abortFailover(fo, ev)
			}
		case failover.FenceStandby:
			s.cancelStart(failover.Standby) // a backoff pending for the dead standby
			sb := s.standby
			s.standby = nil
			s.fence(sb)
			s.retire(sb)
			if fo := s.inflight; fo != nil && fo.target == sb {
				s.abortFailover(fo, ev)
			}
		case failover.DrainRing:
			s.drainRing()
		case failover.SendResume:
			if s.inflight == nil && s.machine.Handover() == failover.Resuming {
				s.inflight = &failoverRun{kind: resumeHandover, target: s.standby, detected: time.Now(), cause: "failback handover"}
			}
			s.sendResume()
		case failover.ResumeYielded:
			s.inflight = &failoverRun{kind: resumeRestore, target: s.active, detected: time.Now(), cause: "failback failed: restore the yielded engine"}
			s.sendResume()
		case failover.SendHandoff:
			s.sendHandoff()
		case failover.Swap:
			s.swap()
		case failover.Promote:
			old := s.active
			s.active, s.standby = s.standby, nil
			s.active.mu.Lock() // Status and the reader read role concurrently
			s.active.role = failover.Active
			s.active.beats.stepSince = time.Now() // it slept until now
			s.active.mu.Unlock()
			s.active.setState("serving")
			s.metrics.up(failover.Active, true)
			s.metrics.up(failover.Standby, false)
			s.retire(old)
			s.publish(s.active)
		case failover.Publish:
			s.active.setState("serving")
			s.metrics.up(failover.Active, true)
			s.publish(s.active)
		case failover.Unpublish:
			s.unpublish(nil)
			if a := s.active; a != nil && a.dead {
				s.active = nil
				s.retire(a)
			}
		case failover.StartActive, failover.StartStandby:
			role := failover.Active
			if a.Kind == failover.StartStandby {
				role = failover.Standby
			}
			s.cancelStart(role)
			if a.Delay > 0 {
				s.startSeq[role]++
				seq := s.startSeq[role]
				s.startAfter[role] = time.AfterFunc(a.Delay, func() { s.post(event{kind: evStartDue, role: role, id: seq, at: time.Now()}) })
			} else {
				s.start(role)
			}
		case failover.CheckMPS:
			s.checkMPS()
		case failover.StopAll:
			s.stopAll(ev.Cause)
		}
	}
}

// cancelStart drops a pending delayed start of role.
func (s *Supervisor) cancelStart(role failover.Role) {
	if t := s.startAfter[role]; t != nil {
		t.Stop()
		s.startAfter[role] = nil
	}
	s.wantStart[role] = false
}

// fence kills a slot's process group; the slot stays until retired.
func (s *Supervisor) fence(sl *slot) {
	if sl == nil {
		return
	}
	if err := sl.proc.Kill(); err != nil {
		s.log.Error("fence engine", "role", sl.role, "pid", sl.proc.PID(), "error", err)
	}
	sl.dead = true
}

// retire closes a fenced slot's connection and socket; its goroutines end
// and its process is reaped by the launcher.
func (s *Supervisor) retire(sl *slot) {
	if sl == nil {
		return
	}
	sl.cancel()
	if c := sl.getConn(); c != nil {
		_ = c.Close()
	}
	if err := sl.listener.Close(); err != nil {
		s.log.Debug("close control listener", "error", err)
	}
	if sl.genC != nil {
		_ = sl.genC.Close()
		sl.genC = nil
	}
}

func (s *Supervisor) sendResume() {
	fo := s.inflight
	if fo == nil || fo.target == nil || fo.target.dead {
		s.raise(failover.Event{Kind: failover.ResumeFailed, At: time.Now(), Cause: "no engine to resume"})
		return
	}
	sb := fo.target
	reqs := s.resumeSet()
	s.resumeSeq++
	fo.resumeID = s.resumeSeq
	fo.count = len(reqs)
	env := &frmpsv1.Envelope{Id: fo.resumeID, Msg: &frmpsv1.Envelope_Resume{Resume: &frmpsv1.Resume{
		Requests: reqs, RingPath: s.ringPath, SyncEvery: s.cfg.SyncEvery,
	}}}
	id := fo.resumeID
	fo.timer = time.AfterFunc(s.cfg.ResumeTimeout, func() { s.post(event{kind: evResumeTimeout, id: id, at: time.Now()}) })
	conn := sb.getConn()
	if conn == nil {
		fo.timer.Stop()
		s.raise(failover.Event{Kind: failover.ResumeFailed, At: time.Now(), Cause: "standby has no control connection"})
		return
	}
	if err := conn.Send(env, nil); err != nil {
		fo.timer.Stop()
		s.raise(failover.Event{Kind: failover.ResumeFailed, At: time.Now(), Cause: "send resume: " + err.Error()})
		return
	}
	fo.sent = time.Now()
	if fo.kind != resumeFailover {
		return
	}
	d := fo.sent.Sub(fo.detected)
	s.metrics.resumeSent(d)
	s.mu.Lock()
	if len(s.detectToResume) < 4096 {
		s.detectToResume = append(s.detectToResume, d)
	}
	s.mu.Unlock()
}

// abortFailover records a failover that did not complete (a handover's
// outcome is recorded when the machine leaves handing_over).
func (s *Supervisor) abortFailover(fo *failoverRun, ev failover.Event) {
	if fo.timer != nil {
		fo.timer.Stop()
	}
	s.inflight = nil
	if fo.kind == resumeFailover {
		s.finishRecord(fo, ev.At, nil, errors.New(ev.Cause))
	}
}

func (s *Supervisor) finishFailover(fo *failoverRun, at time.Time, reply *frmpsv1.Reply, err error) {
	s.inflight = nil
	if fo.kind == resumeFailover {
		s.finishRecord(fo, at, reply, err)
	}
}

// finishRecord records a failover. The dead engine's exit status (and so its
// death class) may come a little after the resume ack: classify off the loop.
func (s *Supervisor) finishRecord(fo *failoverRun, at time.Time, reply *frmpsv1.Reply, ferr error) {
	dur := at.Sub(fo.detected)
	resumed := 0
	var reused, prefilled uint64
	for _, o := range reply.GetResumed() {
		if o.GetOk() {
			resumed++
			reused += uint64(o.GetReusedTokens())
			prefilled += uint64(o.GetPrefilledTokens())
		}
	}
	s.mu.Lock()
	s.recordSeq++
	rec := &frmpsv1.FailoverRecord{Seq: s.recordSeq, UnixNanos: fo.detected.UnixNano(), Cause: "pending", Detail: fo.cause,
		DurationSeconds: dur.Seconds(), ResumedRequests: uint32(resumed), Ok: ferr == nil,
		ReusedTokens: reused, PrefilledTokens: prefilled}
	if ferr != nil {
		rec.Error = ferr.Error()
	} else if resumed > 0 {
		// Promote ran before this: s.generation is the resumed engine's.
		if s.awaitingFirstToken == nil {
			s.awaitingFirstToken = make(map[uint64]pendingFirstToken)
		}
		for g := range s.awaitingFirstToken { // only the newest failovers matter
			if g+4 < s.generation {
				delete(s.awaitingFirstToken, g)
			}
		}
		s.awaitingFirstToken[s.generation] = pendingFirstToken{detected: fo.detected, failover: true,
			set: func(v float64) { rec.FirstTokenSeconds = v }}
		if e := s.earlyFirstToken; e.gen == s.generation {
			s.noteFirstTokenLocked(e.gen, e.at)
		}
	}
	s.records = append([]*frmpsv1.FailoverRecord{rec}, s.records...)
	if len(s.records) > s.cfg.MaxFailoverRecords {
		s.records = s.records[:s.cfg.MaxFailoverRecords]
	}
	s.mu.Unlock()
	if ferr == nil {
		s.metrics.failoverDuration(dur)
		s.log.Info("failover done", "cause", fo.cause, "duration", dur, "resumed", resumed, "open_requests", fo.count)
	} else {
		s.log.Error("failover failed", "cause", fo.cause, "error", ferr)
	}
	old, class, detail := fo.old, fo.class, fo.cause
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		if class == "" {
			class, detail = s.classify(old)
		}
		s.mu.Lock()
		rec.Cause, rec.Detail = class, detail
		s.mu.Unlock()
		old.mu.Lock()
		old.deathCause = class + ": " + detail
		old.mu.Unlock()
		if ferr == nil {
			s.metrics.failover(class)
		}
	}()
}

// classify waits (bounded) for the fenced process to be reaped.
func (s *Supervisor) classify(sl *slot) (string, string) {
	select {
	case <-sl.proc.Done():
	case <-time.After(5 * time.Second):
		return "unknown", "engine not reaped within 5s of the fence"
	}
	sl.mu.Lock()
	fault := sl.fault
	sl.mu.Unlock()
	return s.deps.Classify(sl.proc.WaitStatus(), sl.proc.LastStderr(), fault)
}

func (s *Supervisor) checkMPS() {
	if s.mps == nil || s.mpsBusy {
		return
	}
	s.mpsBusy = true
	mps := s.mps
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		err := mps.Check(ctx)
		if err != nil {
			what, recovered := "restart MPS", "running (restarted)"
			if mps.Owned() {
				s.log.Warn("MPS daemon does not answer; restarting it", "error", err)
				s.setMPSState("restarting")
			} else {
				what, recovered = "the operator's MPS daemon", "joined (the operator's daemon answers again)"
				s.log.Warn("the operator's MPS daemon does not answer; waiting for it (frmps never restarts it)", "error", err)
				s.setMPSState("waiting for the operator's daemon")
			}
			if err = mps.Recover(ctx); err != nil {
				err = fmt.Errorf("%s: %w", what, err)
				s.log.Error("MPS daemon unusable: no active can start in it", "error", err)
				s.setMPSState("failed: " + err.Error())
			} else {
				s.setMPSState(recovered)
			}
		}
		s.post(event{kind: evMPSChecked, err: err, at: time.Now()})
	}()
}

// start launches a new engine for role. A failure to launch is a death.
func (s *Supervisor) start(role failover.Role) {
	if st, _ := s.machine.State(); st == failover.Stopped || st == failover.CrashLoop {
		return
	}
	if cur := s.slotOf(role); cur != nil && !cur.dead {
		s.log.Error("not starting a second engine for a role", "role", role, "pid", cur.proc.PID())
		return
	}
	inMPS := s.placeInMPS(role)
	if inMPS && s.mpsBusy {
		s.wantStart[role] = true // launch into a daemon known to answer
		return
	}
	if role == failover.Active && s.mpsErr != nil {
		s.raise(failover.Event{Kind: failover.BreakerTripped, Role: failover.Active, At: time.Now(), Cause: "MPS daemon does not answer: " + s.mpsErr.Error()})
		return
	}
	if role == failover.Active {
		// A cold start: the new active allocates fresh pools, so the old
		// layout and fds go.
		if old := s.broker; old != nil && len(old.Pools()) > 0 {
			s.mu.Lock()
			s.broker = s.deps.NewBroker()
			s.mu.Unlock()
			if err := old.Close(); err != nil {
				s.log.Warn("close fd broker", "error", err)
			}
		}
	}
	s.nextID++
	id := s.nextID
	inv := s.invocation(role, id)
	sl := &slot{id: id, role: role, started: time.Now(), state: "starting", inMPS: inMPS, genSocket: inv.GenerationSocket, ctlSocket: inv.ControlSocket}
	sl.restartNo = s.metrics.started(role)
	fail := func(err error) {
		sl.proc = deadProcess{}
		sl.listener = nopListener{}
		sl.cancel = func() {}
		if role == failover.Active {
			s.active = sl
		} else {
			s.standby = sl
		}
		s.enqueue(event{kind: evDied, slot: sl, cause: "launch failed: " + err.Error(), at: time.Now()})
	}
	env := slices.Clone(s.cfg.BaseEnv)
	if s.mps != nil {
		if inMPS {
			env = append(env, s.mps.ClientEnv()...)
		} else {
			out, err := s.deps.OutsideEnv(s.runDir)
			if err != nil {
				fail(fmt.Errorf("outside-MPS env: %w", err))
				return
			}
			env = append(env, out...)
		}
	}
	l, err := s.deps.Listen(inv.ControlSocket)
	if err != nil {
		fail(fmt.Errorf("listen on control socket: %w", err))
		return
	}
	logPath := filepath.Join(s.logDir, fmt.Sprintf("%s-%d.log", role, id))
	proc, err := s.deps.Launcher.Launch(role, inv, env, logPath)
	if err != nil {
		_ = l.Close()
		fail(err)
		return
	}
	ctx, cancel := context.WithCancel(context.Background())
	sl.proc, sl.listener, sl.cancel = proc, l, cancel
	if role == failover.Active {
		s.active = sl
	} else {
		s.standby = sl
	}
	s.slots[sl] = struct{}{}
	s.log.Info("engine launched", "role", role, "pid", proc.PID(), "log", proc.LogPath(), "in_mps", sl.inMPS)
	s.wg.Add(2)
	go func() {
		defer s.wg.Done()
		select {
		case <-proc.Done():
			s.post(event{kind: evDied, slot: sl, cause: "process exited: " + describeExit(proc), at: time.Now()})
		case <-s.stopped:
		}
	}()
	go func() {
		defer s.wg.Done()
		s.runEngine(ctx, sl)
	}()
}

// placeInMPS decides where a new engine of role runs: inside MPS unless the
// other engine is there (after a failover the promoted active runs outside,
// so its fresh standby goes in, and failback swaps them). A standby stays out
// while the daemon is known broken, or when failback is off; an active waits
// for the daemon (or trips the breaker) in start.
func (s *Supervisor) placeInMPS(role failover.Role) bool {
	if s.mps == nil {
		return false
	}
	other := s.slotOf(failover.Standby)
	if role == failover.Standby {
		other = s.slotOf(failover.Active)
		if s.mpsErr != nil || s.cfg.NoFailback {
			return false
		}
	}
	return other == nil || other.dead || !other.inMPS
}

func describeExit(p Process) string {
	ws := p.WaitStatus()
	switch {
	case ws.Signaled():
		return fmt.Sprintf("killed by signal %d", int(ws.Signal()))
	case ws.Exited():
		return fmt.Sprintf("exit code %d", ws.ExitStatus())
	}
	return "unknown status"
}

// runEngine shakes hands with one engine, then reads its messages until the
// socket closes (= death).
func (s *Supervisor) runEngine(ctx context.Context, sl *slot) {
	hctx, cancel := context.WithTimeout(ctx, s.cfg.HandshakeTimeout)
	conn, err := s.handshake(hctx, sl)
	cancel()
	if err != nil {
		if ctx.Err() == nil {
			s.post(event{kind: evDied, slot: sl, cause: err.Error(), at: time.Now()})
		}
		return
	}
	s.learnModelLimit(ctx, sl)
	s.post(event{kind: evReady, slot: sl, at: time.Now()})
	for {
		env, fds, err := conn.Recv()
		closeFDs(fds) // no message after the handshake carries fds to us
		if err != nil {
			now := time.Now()
			cause := "control socket closed"
			if !errors.Is(err, io.EOF) {
				cause = "control socket: " + err.Error()
			}
			s.post(event{kind: evDied, slot: sl, cause: cause, at: now})
			return
		}
		switch m := env.GetMsg().(type) {
		case *frmpsv1.Envelope_Reply:
			s.post(event{kind: evReply, slot: sl, id: env.GetId(), reply: m.Reply, at: time.Now()})
		case *frmpsv1.Envelope_Fault:
			sl.mu.Lock()
			sl.fault = m.Fault
			sl.mu.Unlock()
			s.log.Warn("engine reports a fault", "role", sl.roleNow(), "cause", m.Fault.GetCause(), "detail", m.Fault.GetDetail())
		case *frmpsv1.Envelope_Heartbeat:
			now, hb := time.Now(), m.Heartbeat
			sl.mu.Lock()
			b := &sl.beats
			// The step count is judged only while requests run: an idle engine (or
			// an asleep standby) may keep it for ever.
			if b.last.IsZero() || hb.GetStep() != b.step || b.running == 0 {
				b.stepSince = now
			}
			b.last, b.step, b.running = now, hb.GetStep(), hb.GetRunning()
			b.interval = time.Duration(hb.GetIntervalMs()) * time.Millisecond
			b.stepAge, b.expected = time.Duration(hb.GetStepAgeNs()), time.Duration(hb.GetStepExpectedNs())
			b.tokens = hb.GetStepTokens()
			sl.mu.Unlock()
		default:
			s.log.Warn("unexpected control message", "role", sl.roleNow(), "type", fmt.Sprintf("%T", m))
		}
	}
}

func (s *Supervisor) handshake(ctx context.Context, sl *slot) (ControlConn, error) {
	conn, err := sl.listener.Accept(ctx, sl.proc.PID())
	if err != nil {
		return nil, fmt.Errorf("accept control connection: %w", err)
	}
	sl.mu.Lock()
	sl.conn = conn
	sl.mu.Unlock()
	// Recv blocks without a deadline: end it when ctx ends.
	stop := context.AfterFunc(ctx, func() { _ = conn.Close() })
	defer stop()
	sl.setState("handshaking")
	env, fds, err := conn.Recv()
	closeFDs(fds)
	if err != nil {
		return nil, fmt.Errorf("read hello: %w", err)
	}
	hello := env.GetHello()
	if hello == nil {
		return nil, s.refuse(sl, conn, fmt.Sprintf("first message must be hello, got %T", env.GetMsg()))
	}
	sl.mu.Lock()
	sl.hello = hello
	sl.mu.Unlock()
	wantRole := frmpsv1.Role_ROLE_ACTIVE
	var pools []*frmpsv1.Pool
	if sl.role == failover.Standby {
		wantRole = frmpsv1.Role_ROLE_STANDBY
		pools = s.brokerPools()
	}
	if hello.GetProtocolVersion() != frmpsv1.ProtocolVersion_PROTOCOL_VERSION_1 {
		return nil, s.refuse(sl, conn, fmt.Sprintf("protocol version %d, this supervisor speaks %d", hello.GetProtocolVersion(), frmpsv1.ProtocolVersion_PROTOCOL_VERSION_1))
	}
	if s.deps.ValidateHello != nil {
		if err := s.deps.ValidateHello(hello, HelloExpect{Role: wantRole, PID: sl.proc.PID(), Model: s.cfg.Model, Pools: pools}); err != nil {
			return nil, s.refuse(sl, conn, err.Error())
		}
	}
	welcome := &frmpsv1.Welcome{Accepted: true, ProtocolVersion: frmpsv1.ProtocolVersion_PROTOCOL_VERSION_1,
		SyncEvery: s.cfg.SyncEvery, DeploymentId: s.deployID,
		HeartbeatIntervalMs: uint32(s.cfg.hangPolicy().beatInterval().Milliseconds())}
	if sl.role == failover.Active {
		welcome.RingPath = s.ringPath
	}
	if err := conn.Send(&frmpsv1.Envelope{Msg: &frmpsv1.Envelope_Welcome{Welcome: welcome}}, nil); err != nil {
		return nil, fmt.Errorf("send welcome: %w", err)
	}
	if sl.role == failover.Standby {
		brokered, fds := s.brokerPools(), s.brokerFDs()
		if err := conn.Send(&frmpsv1.Envelope{Msg: &frmpsv1.Envelope_Sleep{Sleep: &frmpsv1.Sleep{Pools: brokered}}}, fds); err != nil {
			return nil, fmt.Errorf("send sleep: %w", err)
		}
	}
	for {
		env, fds, err := conn.Recv()
		if err != nil {
			closeFDs(fds)
			return nil, fmt.Errorf("handshake: %w", err)
		}
		switch m := env.GetMsg().(type) {
		case *frmpsv1.Envelope_PoolExport:
			if sl.role != failover.Active {
				closeFDs(fds)
				return nil, s.refuse(sl, conn, "pool export from a standby")
			}
			if err := s.brokerPut(m.PoolExport.GetPools(), fds); err != nil {
				return nil, s.refuse(sl, conn, "pool export: "+err.Error())
			}
		case *frmpsv1.Envelope_Ready:
			closeFDs(fds)
			if sl.role == failover.Active && len(s.brokerPools()) == 0 {
				return nil, s.refuse(sl, conn, "ready before exporting any pool")
			}
			return conn, nil
		case *frmpsv1.Envelope_Fault:
			closeFDs(fds)
			return nil, fmt.Errorf("engine fault during start: %s: %s", m.Fault.GetCause(), m.Fault.GetDetail())
		default:
			closeFDs(fds)
		}
	}
}

// refuse answers a refused Welcome (best effort) and returns the reason.
func (s *Supervisor) refuse(sl *slot, conn ControlConn, reason string) error {
	// Recorded before the Welcome goes out: the engine may exit, and its exit
	// be seen, before this goroutine reports the refusal.
	sl.mu.Lock()
	sl.refused = "hello refused: " + reason
	sl.mu.Unlock()
	_ = conn.Send(&frmpsv1.Envelope{Msg: &frmpsv1.Envelope_Welcome{Welcome: &frmpsv1.Welcome{
		Accepted: false, Reason: reason, ProtocolVersion: frmpsv1.ProtocolVersion_PROTOCOL_VERSION_1}}}, nil)
	return fmt.Errorf("hello refused: %s", reason)
}

// The broker is swapped only by the loop while no engine is handshaking
// (cold start); these readers run on engine goroutines.
func (s *Supervisor) brokerPools() []*frmpsv1.Pool {
	s.mu.Lock()
	b := s.broker
	s.mu.Unlock()
	if b == nil {
		return nil
	}
	return b.Pools()
}

func (s *Supervisor) brokerFDs() []int {
	s.mu.Lock()
	b := s.broker
	s.mu.Unlock()
	if b == nil {
		return nil
	}
	return b.FDs()
}

func (s *Supervisor) brokerPut(pools []*frmpsv1.Pool, fds []int) error {
	s.mu.Lock()
	b := s.broker
	s.mu.Unlock()
	if b == nil {
		closeFDs(fds)
		return errors.New("broker closed")
	}
	return b.Put(pools, fds)
}

// stopAll shuts the children down: Shutdown with a grace period, then the
// group kill. The loop exits after this.
func (s *Supervisor) stopAll(cause string) {
	s.setUnavailable(fmt.Errorf("%w: stopped (%s)", ErrUnavailable, cause))
	for r := range s.startAfter {
		if t := s.startAfter[r]; t != nil {
			t.Stop()
		}
	}
	if fo := s.inflight; fo != nil && fo.timer != nil {
		fo.timer.Stop()
	}
	grace := s.cfg.ShutdownGrace
	for sl := range s.slots {
		c := sl.getConn()
		switch {
		case sl.dead:
		case c == nil: // not connected yet: nobody to ask politely
			s.fence(sl)
		default:
			if err := c.Send(&frmpsv1.Envelope{Msg: &frmpsv1.Envelope_Shutdown{Shutdown: &frmpsv1.Shutdown{GraceMs: uint32(grace.Milliseconds())}}}, nil); err != nil {
				s.fence(sl)
			}
		}
	}
	deadline := time.NewTimer(grace)
	defer deadline.Stop()
	for sl := range s.slots {
		select {
		case <-sl.proc.Done():
		case <-deadline.C:
			deadline.Reset(0) // the rest get no more grace
		}
	}
	for sl := range s.slots {
		s.fence(sl)
		s.retire(sl)
	}
	for sl := range s.slots {
		select {
		case <-sl.proc.Done():
		case <-time.After(10 * time.Second):
			s.log.Error("engine survived SIGKILL", "pid", sl.proc.PID())
		}
		delete(s.slots, sl)
	}
	s.active, s.standby = nil, nil
	s.wg.Wait()
	s.metrics.up(failover.Active, false)
	s.metrics.up(failover.Standby, false)
	s.log.Info("deployment stopped", "cause", cause)
}

func closeFDs(fds []int) {
	for _, fd := range fds {
		_ = unix.Close(fd)
	}
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

// deadProcess stands in for an engine that never started.
type deadProcess struct{}

var closedCh = func() chan struct{} { c := make(chan struct{}); close(c); return c }()

func (deadProcess) PID() int                       { return 0 }
func (deadProcess) Done() <-chan struct{}          { return closedCh }
func (deadProcess) WaitStatus() syscall.WaitStatus { return 0 }
func (deadProcess) LastStderr() []string           { return nil }
func (deadProcess) Kill() error                    { return nil }
func (deadProcess) LogPath() string                { return "" }

type nopListener struct{}

func (nopListener) Accept(context.Context, int) (ControlConn, error) {
	return nil, errors.New("no listener")
}
func (nopListener) Close() error { return nil }
