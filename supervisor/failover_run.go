package supervisor

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
	"github.com/frmps/frmps/supervisor/failover"
)

// The resume in progress (a failover's or a handover's) and its record.
// Loop-owned, except NoteResumedToken, which the front door calls from its
// own goroutines under s.mu.

func (s *Supervisor) resumeSet() []*frmpsv1.ResumeRequest {
	if s.frontDoor == nil {
		return nil
	}
	reqs := s.frontDoor.OpenRequests()
	s.ring.snapshots(reqs)
	return reqs
}

// elidePrompt leaves the prompt out of a snapshot whose sequence starts with
// the request's own prompt_token_ids: the rest goes as output_token_ids and
// token_ids stays empty (control.proto). The standby then converts and checks
// each prompt token once instead of twice on a takeover's path (at 32 requests
// of 400 + 200 tokens, 0.7 ms of its Python and a third of the message). A
// sequence that does not start with that prompt goes whole, for the standby
// to refuse as before.
func elidePrompt(snap *frmpsv1.RequestSnapshot, prompt []uint32) *frmpsv1.RequestSnapshot {
	ids := snap.GetTokenIds()
	if len(prompt) == 0 || int(snap.GetNumPromptTokens()) != len(prompt) || len(ids) < len(prompt) || !slices.Equal(ids[:len(prompt)], prompt) {
		return snap
	}
	snap.OutputTokenIds = ids[len(prompt):]
	snap.TokenIds = nil
	return snap
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
	handled  time.Time // when the loop took the death up (detected is when it was seen)
	sent     time.Time
	cause    string
	old      *slot
	class    string // known death class (drill, stalled, hung); "" = classify the exit
	count    int
	resumeID uint64
	timer    *time.Timer

	// The way from handled to sent, for the log: the old active fenced, the ring
	// drained, the resume set built (each zero if that step did not run).
	fenced, drained, built time.Time
	// groupFenced: the old active's group, after the Resume (one rank: fenced
	// is its leader's SIGKILL then).
	groupFenced time.Time
}

func (s *Supervisor) sendResume() {
	fo := s.inflight
	if fo == nil || fo.target == nil || fo.target.dead {
		s.raise(failover.Event{Kind: failover.ResumeFailed, At: time.Now(), Cause: "no engine to resume"})
		return
	}
	sb := fo.target
	reqs := s.resumeSet()
	fo.built = time.Now()
	s.cmdSeq++
	fo.resumeID = s.cmdSeq
	fo.count = len(reqs)
	env := &frmpsv1.Envelope{Id: fo.resumeID, Msg: &frmpsv1.Envelope_Resume{Resume: &frmpsv1.Resume{
		Requests: reqs, RingPath: s.ring.path, SyncEvery: s.cfg.SyncEvery,
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
		s.log.Info("failover done", "cause", fo.cause, "duration", dur, "resume_sent_after", fo.sent.Sub(fo.detected),
			"loop_after", fo.handled.Sub(fo.detected), "then", fo.split(), "resumed", resumed, "open_requests", fo.count)
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

type pendingFirstToken struct {
	detected time.Time
	failover bool                  // a failover's (counted in frmps_failover_first_token_seconds), not a handover's
	set      func(seconds float64) // called with s.mu held
}

// NoteResumedToken is called by the front door when the first token of a
// stream resumed on engine generation gen reaches its client: the failover
// that promoted gen then records death-to-first-resumed-token. Cheap; safe
// from any goroutine.
func (s *Supervisor) NoteResumedToken(gen uint64, at time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.noteFirstTokenLocked(gen, at)
}

// noteHandoverForFirstToken: the front door's first resumed token on the new
// generation ends the client-visible pause of this handover.
func (s *Supervisor) noteHandoverForFirstToken(started time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.awaitingFirstToken == nil {
		s.awaitingFirstToken = make(map[uint64]pendingFirstToken)
	}
	s.awaitingFirstToken[s.generation] = pendingFirstToken{detected: started, set: s.failback.noteFirstToken}
}

// noteFirstTokenLocked records the first resumed token of generation gen in
// its failover record. Promote publishes the engine before the loop writes
// that record, so a token can come first: it is kept until the record is
// written (finishRecord calls this again).
func (s *Supervisor) noteFirstTokenLocked(gen uint64, at time.Time) {
	if p, ok := s.awaitingFirstToken[gen]; ok {
		p.set(at.Sub(p.detected).Seconds())
		delete(s.awaitingFirstToken, gen)
		if p.failover {
			s.metrics.firstToken(at.Sub(p.detected))
		}
		return
	}
	if gen == s.generation && s.earlyFirstToken.gen != gen {
		s.earlyFirstToken = earlyToken{gen: gen, at: at}
	}
}

type earlyToken struct {
	gen uint64
	at  time.Time
}

// split says where the time from the loop taking the death up to the Resume
// being sent went: "fenced +a, ring drained +b, resume set +c, sent +d", each
// from the step before it (a step that did not run is left out), then
// "group fenced +e" where the old active's leader was fenced alone.
func (fo *failoverRun) split() string {
	var b strings.Builder
	prev := fo.handled
	for _, p := range []struct {
		name string
		at   time.Time
	}{{"fenced", fo.fenced}, {"ring drained", fo.drained}, {"resume set", fo.built}, {"sent", fo.sent}, {"group fenced", fo.groupFenced}} {
		if p.at.IsZero() || prev.IsZero() {
			continue
		}
		if b.Len() > 0 {
			b.WriteString(", ")
		}
		fmt.Fprintf(&b, "%s +%s", p.name, p.at.Sub(prev))
		prev = p.at
	}
	return b.String()
}
