package supervisor

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"
	"google.golang.org/protobuf/proto"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
	"github.com/frmps/frmps/supervisor/failover"
)

// failovers owns the resume in progress (a failover's or a handover's;
// loop-owned) and the failover records, with the first resumed token that
// ends each (under mu: the front door notes tokens from its own goroutines,
// Status reads the records).
type failovers struct {
	timeout    time.Duration // Config.ResumeTimeout
	syncEvery  uint32        // Config.SyncEvery, for the resumed engine
	maxRecords int           // Config.MaxFailoverRecords
	log        hclog.Logger
	metrics    *metrics
	post       func(event)     // to the loop, from the resume's timer
	wg         *sync.WaitGroup // the record's classifier, waited for at shutdown
	// classify names a fenced engine's death from its exit (bounded wait).
	classify func(*slot) (class, detail string)

	run *failoverRun // the resume in progress; nil when none

	mu        sync.Mutex
	gen       uint64 // the engine generation published last
	records   []*frmpsv1.FailoverRecord
	recordSeq uint64
	// awaiting: failover records (and the handover), by the generation they
	// promoted, whose first resumed token has not reached a client yet.
	awaiting map[uint64]pendingFirstToken
	// early: a first resumed token that came before its failover record was
	// written.
	early earlyToken
	// detectToResume: death detected → Resume sent, for benchmarks (bounded).
	detectToResume []time.Duration
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

// begin makes r the resume in progress.
func (f *failovers) begin(r *failoverRun) { f.run = r }

// resuming: the resume in progress resumes sl.
func (f *failovers) resuming(sl *slot) bool { return f.run != nil && f.run.target == sl }

// replacing: the resume in progress replaces sl, whose death its record
// classifies.
func (f *failovers) replacing(sl *slot) bool { return f.run != nil && f.run.old == sl }

// drained notes the ring drained on the way to the Resume.
func (f *failovers) drained() {
	if r := f.run; r != nil && r.drained.IsZero() {
		r.drained = time.Now()
	}
}

// groupFenced notes the old active's group fenced after the Resume.
func (f *failovers) groupFenced(old *slot) {
	if f.replacing(old) {
		f.run.groupFenced = time.Now()
	}
}

// sendResume sends the resume in progress its Resume, with the open
// requests (built by reqs) and the ring to read, as command id (from next);
// "" when sent, else why the resume failed.
func (f *failovers) sendResume(reqs func() []*frmpsv1.ResumeRequest, next func() uint64, ringPath string) (failed string) {
	fo := f.run
	if fo == nil || fo.target == nil || fo.target.dead {
		return "no engine to resume"
	}
	sb := fo.target
	open := reqs()
	fo.built = time.Now()
	fo.resumeID = next()
	fo.count = len(open)
	env := &frmpsv1.Envelope{Id: fo.resumeID, Msg: &frmpsv1.Envelope_Resume{Resume: &frmpsv1.Resume{
		Requests: open, RingPath: ringPath, SyncEvery: f.syncEvery,
	}}}
	id := fo.resumeID
	fo.timer = time.AfterFunc(f.timeout, func() { f.post(event{kind: evResumeTimeout, id: id, at: time.Now()}) })
	conn := sb.getConn()
	if conn == nil {
		fo.timer.Stop()
		return "standby has no control connection"
	}
	if err := conn.Send(env, nil); err != nil {
		fo.timer.Stop()
		return "send resume: " + err.Error()
	}
	fo.sent = time.Now()
	if fo.kind != resumeFailover {
		return ""
	}
	d := fo.sent.Sub(fo.detected)
	f.metrics.resumeSent(d)
	f.mu.Lock()
	if len(f.detectToResume) < 4096 {
		f.detectToResume = append(f.detectToResume, d)
	}
	f.mu.Unlock()
	return ""
}

// answer takes a Reply (evReply): the machine event it makes, and the run
// it completes when the engine acknowledged the Resume (finish it after the
// machine's step: its record names the generation the step promoted); ok
// false for a stale or unsolicited reply.
func (f *failovers) answer(ev event) (fev failover.Event, acked *failoverRun, ok bool) {
	fo := f.run
	if fo == nil || ev.slot != fo.target || ev.id != fo.resumeID {
		return fev, nil, false
	}
	fo.timer.Stop()
	if !ev.reply.GetOk() {
		return failover.Event{Kind: failover.ResumeFailed, At: ev.at, Cause: "standby refused resume: " + ev.reply.GetError()}, nil, true
	}
	return failover.Event{Kind: failover.ResumeAcked, At: ev.at, Cause: fo.cause}, fo, true
}

// timedOut: the resume in progress got no reply in time (evResumeTimeout).
func (f *failovers) timedOut(ev event) bool { return f.run != nil && f.run.resumeID == ev.id }

// abort records a failover that did not complete (a handover's outcome is
// recorded when the machine leaves handing_over).
func (f *failovers) abort(ev failover.Event) {
	fo := f.run
	if fo.timer != nil {
		fo.timer.Stop()
	}
	f.run = nil
	if fo.kind == resumeFailover {
		f.record(fo, ev.At, nil, errors.New(ev.Cause))
	}
}

// finish ends a resume the engine acknowledged.
func (f *failovers) finish(fo *failoverRun, at time.Time, reply *frmpsv1.Reply) {
	f.run = nil
	if fo.kind == resumeFailover {
		f.record(fo, at, reply, nil)
	}
}

// stop stops the resume's timer at shutdown.
func (f *failovers) stop() {
	if fo := f.run; fo != nil && fo.timer != nil {
		fo.timer.Stop()
	}
}

// record records a failover. The dead engine's exit status (and so its
// death class) may come a little after the resume ack: classify off the loop.
func (f *failovers) record(fo *failoverRun, at time.Time, reply *frmpsv1.Reply, ferr error) {
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
	f.mu.Lock()
	f.recordSeq++
	rec := &frmpsv1.FailoverRecord{Seq: f.recordSeq, UnixNanos: fo.detected.UnixNano(), Cause: "pending", Detail: fo.cause,
		DurationSeconds: dur.Seconds(), ResumedRequests: uint32(resumed), Ok: ferr == nil,
		ReusedTokens: reused, PrefilledTokens: prefilled}
	if ferr != nil {
		rec.Error = ferr.Error()
	} else if resumed > 0 {
		// Promote ran before this: f.gen is the resumed engine's.
		if f.awaiting == nil {
			f.awaiting = make(map[uint64]pendingFirstToken)
		}
		for g := range f.awaiting { // only the newest failovers matter
			if g+4 < f.gen {
				delete(f.awaiting, g)
			}
		}
		f.awaiting[f.gen] = pendingFirstToken{detected: fo.detected, failover: true,
			set: func(v float64) { rec.FirstTokenSeconds = v }}
		if e := f.early; e.gen == f.gen {
			f.noteFirstTokenLocked(e.gen, e.at)
		}
	}
	f.records = append([]*frmpsv1.FailoverRecord{rec}, f.records...)
	if len(f.records) > f.maxRecords {
		f.records = f.records[:f.maxRecords]
	}
	f.mu.Unlock()
	if ferr == nil {
		f.metrics.failoverDuration(dur)
		f.log.Info("failover done", "cause", fo.cause, "duration", dur, "resume_sent_after", fo.sent.Sub(fo.detected),
			"loop_after", fo.handled.Sub(fo.detected), "then", fo.split(), "resumed", resumed, "open_requests", fo.count)
	} else {
		f.log.Error("failover failed", "cause", fo.cause, "error", ferr)
	}
	old, class, detail := fo.old, fo.class, fo.cause
	f.wg.Add(1)
	go func() {
		defer f.wg.Done()
		if class == "" {
			class, detail = f.classify(old)
		}
		f.mu.Lock()
		rec.Cause, rec.Detail = class, detail
		f.mu.Unlock()
		old.mu.Lock()
		old.deathCause = class + ": " + detail
		old.mu.Unlock()
		if ferr == nil {
			f.metrics.failover(class)
		}
	}()
}

// shownRecords: copies of the failover records, newest first.
func (f *failovers) shownRecords() []*frmpsv1.FailoverRecord {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := make([]*frmpsv1.FailoverRecord, 0, len(f.records))
	for _, r := range f.records {
		out = append(out, proto.Clone(r).(*frmpsv1.FailoverRecord))
	}
	return out
}

// detectToResumeSeen: a copy of the death → Resume times of the failovers.
func (f *failovers) detectToResumeSeen() []time.Duration {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.detectToResume)
}

type pendingFirstToken struct {
	detected time.Time
	failover bool                  // a failover's (counted in frmps_failover_first_token_seconds), not a handover's
	set      func(seconds float64) // called with failovers.mu held
}

// published notes the engine generation published next (before Current can
// return it, so a token of it is never taken for a stale one).
func (f *failovers) published(gen uint64) {
	f.mu.Lock()
	f.gen = gen
	f.mu.Unlock()
}

// awaitHandover: the front door's first resumed token on the generation
// published now ends the client-visible pause of a handover started then;
// set gets its seconds.
func (f *failovers) awaitHandover(started time.Time, set func(seconds float64)) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.awaiting == nil {
		f.awaiting = make(map[uint64]pendingFirstToken)
	}
	f.awaiting[f.gen] = pendingFirstToken{detected: started, set: set}
}

// noteResumedToken records the first resumed token of generation gen.
func (f *failovers) noteResumedToken(gen uint64, at time.Time) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.noteFirstTokenLocked(gen, at)
}

// noteFirstTokenLocked records the first resumed token of generation gen in
// its failover record. Promote publishes the engine before the loop writes
// that record, so a token can come first: it is kept until the record is
// written (record calls this again).
func (f *failovers) noteFirstTokenLocked(gen uint64, at time.Time) {
	if p, ok := f.awaiting[gen]; ok {
		p.set(at.Sub(p.detected).Seconds())
		delete(f.awaiting, gen)
		if p.failover {
			f.metrics.firstToken(at.Sub(p.detected))
		}
		return
	}
	if gen == f.gen && f.early.gen != gen {
		f.early = earlyToken{gen: gen, at: at}
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
