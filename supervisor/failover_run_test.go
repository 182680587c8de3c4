package supervisor

import (
	"context"
	"fmt"
	"io"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/frmps/frmps/internal/testenv"
	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
	"github.com/frmps/frmps/supervisor/control"
	"github.com/frmps/frmps/supervisor/failover"
)

func TestFailoverSplitNamesEachStepFromTheOneBefore(t *testing.T) {
	t0 := time.Unix(100, 0)
	fo := &failoverRun{handled: t0, fenced: t0.Add(10 * time.Microsecond), drained: t0.Add(30 * time.Microsecond),
		built: t0.Add(330 * time.Microsecond), sent: t0.Add(1330 * time.Microsecond)}
	want := "fenced +10µs, ring drained +20µs, resume set +300µs, sent +1ms"
	if got := fo.split(); got != want {
		t.Fatalf("split = %q, want %q", got, want)
	}
	fo.fenced, fo.drained = time.Time{}, time.Time{} // steps that did not run are left out
	if got := fo.split(); got != "resume set +330µs, sent +1ms" {
		t.Fatalf("split without fence and drain = %q", got)
	}
	if got := (&failoverRun{}).split(); got != "" {
		t.Fatalf("split of nothing = %q", got)
	}
}

// runLogged runs a supervisor (no failback) over w whose log goes to out, up to
// its engines' start; stop ends the run.
func runLogged(t *testing.T, w *fakeWorld, out io.Writer, opts ...func(*Config)) (s *Supervisor, stop func()) {
	t.Helper()
	cfg := testConfig(t)
	cfg.NoFailback = true
	for _, o := range opts {
		o(&cfg)
	}
	log := hclog.New(&hclog.LoggerOptions{Output: out, Level: hclog.Info})
	s, err := NewWithDeps(cfg, w.deps(), log, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	s.SetFrontDoor(w.front)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	synctest.Wait()
	return s, func() { cancel(); <-done }
}

// A failover's "failover done" line says where the way from the loop taking
// the death up to the Resume being sent went, step by step.
func TestFailoverDoneLogsTheWayToTheResume(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		w := newWorld()
		var out testenv.LogBuffer
		_, stop := runLogged(t, w, &out)
		w.liveRole(failover.Active).Kill()
		synctest.Wait()
		stop()
		var line string
		for _, l := range strings.Split(out.String(), "\n") {
			if strings.Contains(l, "failover done") {
				line = l
			}
		}
		if line == "" {
			t.Fatalf("no 'failover done' line in:\n%s", out.String())
		}
		for _, want := range []string{"loop_after=", `then="fenced +`, ", ring drained +", ", resume set +", ", sent +"} {
			if !strings.Contains(line, want) {
				t.Fatalf("%q not in %s", want, line)
			}
		}
	})
}

// orderProbe is a log output that notes, at the first line containing mark,
// whether the process it watches was still alive.
type orderProbe struct {
	testenv.LogBuffer
	mu        sync.Mutex // guards proc, seen and aliveThen
	mark      string
	proc      *fakeProc
	seen      bool
	aliveThen bool
}

func (o *orderProbe) Write(p []byte) (int, error) {
	o.mu.Lock()
	if !o.seen && o.proc != nil && strings.Contains(string(p), o.mark) {
		o.seen, o.aliveThen = true, o.proc.alive()
	}
	o.mu.Unlock()
	return o.LogBuffer.Write(p)
}

// The MPS server's teardown of the active (its process still alive) fences the
// active before anything is logged about its death and before the machine
// steps: the SIGKILL is the first thing on the way to the Resume, and the
// split shows it.
func TestDeadActiveIsFencedBeforeTheLogsAndTheStep(t *testing.T) {
	for _, tp := range []int{1, 2} {
		t.Run(fmt.Sprintf("tp%d", tp), func(t *testing.T) { testFencedFirst(t, tp) })
	}
}

// testFencedFirst: with one rank the leader is fenced first and its group once
// the Resume is sent (the split says so); with ranks in other processes of the
// group, the whole group first.
func testFencedFirst(t *testing.T, tp int) {
	synctest.Test(t, func(t *testing.T) {
		w := newWorld()
		w.mps.logDir = t.TempDir()
		probe := &orderProbe{mark: "engine died"}
		s, stop := runLogged(t, w, probe, func(c *Config) { c.TensorParallelSize = tp })
		act := w.liveRole(failover.Active)
		probe.mu.Lock()
		probe.proc = act
		probe.mu.Unlock()
		appendServerLog(t, w.mps.logDir, fmt.Sprintf("[2026-11-28 17:04:22.012 Server  1997] Client {PID: %d, Context ID: 1} on device 0 to be torn down", act.pid))
		time.Sleep(10 * time.Millisecond)
		synctest.Wait()
		stop()
		probe.mu.Lock()
		seen, alive := probe.seen, probe.aliveThen
		probe.mu.Unlock()
		if !seen {
			t.Fatalf("no 'engine died' line in:\n%s", probe.String())
		}
		if alive {
			t.Fatalf("the active was still alive when its death was logged:\n%s", probe.String())
		}
		recs := s.Status().Failovers
		if len(recs) != 1 || recs[0].GetCause() != "mps_fault" || !recs[0].GetOk() {
			t.Fatalf("records %v", recs)
		}
		kills := act.killed()
		line := probe.String()
		if i := strings.Index(line, "failover done"); i >= 0 {
			line = line[i:]
		}
		if j := strings.IndexByte(line, '\n'); j >= 0 {
			line = line[:j]
		}
		if tp == 1 {
			if len(kills) < 2 || kills[0] != "leader" || kills[1] != "group" {
				t.Fatalf("one rank: kills %v, want the leader, then the group", kills)
			}
			if !regexp.MustCompile(`then="fenced \+[^"]*, sent \+[^"]*, group fenced \+[^"]*"`).MatchString(line) {
				t.Fatalf("one rank: the group is not fenced after the Resume is sent: %s", line)
			}
		} else {
			if len(kills) == 0 || kills[0] != "group" || slices.Contains(kills, "leader") {
				t.Fatalf("tensor parallel: kills %v, want the group first and never the leader alone", kills)
			}
			if strings.Contains(line, "group fenced") || !strings.Contains(line, `then="fenced +`) {
				t.Fatalf("tensor parallel: %s", line)
			}
		}
	})
}

func TestElidePromptOnlyWhereTheSequenceStartsWithTheRequestsPrompt(t *testing.T) {
	snap := func(ids ...uint32) *frmpsv1.RequestSnapshot {
		return &frmpsv1.RequestSnapshot{TokenIds: ids, NumPromptTokens: 2, NumComputedTokens: 3}
	}
	for _, tc := range []struct {
		name          string
		snap          *frmpsv1.RequestSnapshot
		prompt        []uint32
		tokens, after []uint32
	}{
		{"the request's prompt: elided", snap(4, 5, 6, 7), []uint32{4, 5}, nil, []uint32{6, 7}},
		{"nothing generated yet", snap(4, 5), []uint32{4, 5}, nil, []uint32{}},
		{"no prompt ids in the request (text, chat, a frontend's request)", snap(4, 5, 6), nil, []uint32{4, 5, 6}, nil},
		{"another prompt", snap(4, 9, 6), []uint32{4, 5}, []uint32{4, 9, 6}, nil},
		{"another prompt length", snap(4, 5, 6), []uint32{4, 5, 6}, []uint32{4, 5, 6}, nil},
		{"a sequence shorter than the prompt", &frmpsv1.RequestSnapshot{TokenIds: []uint32{4}, NumPromptTokens: 2}, []uint32{4, 5}, []uint32{4}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := elidePrompt(tc.snap, tc.prompt)
			if !slices.Equal(got.GetTokenIds(), tc.tokens) || !slices.Equal(got.GetOutputTokenIds(), tc.after) {
				t.Fatalf("token_ids %v, output_token_ids %v; want %v, %v", got.GetTokenIds(), got.GetOutputTokenIds(), tc.tokens, tc.after)
			}
			if got.GetNumPromptTokens() != tc.snap.GetNumPromptTokens() || got.GetNumComputedTokens() != tc.snap.GetNumComputedTokens() {
				t.Fatalf("counts changed: %v", got)
			}
		})
	}
}

// The Resume a standby gets leaves out of each snapshot the prompt the request
// itself carries as token ids, and keeps whole the others.
func TestResumeLeavesTheRequestsOwnPromptOutOfItsSnapshot(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		w := newWorld()
		w.front.open = []*frmpsv1.ResumeRequest{
			{Key: 7, PromptTokenIds: []uint32{4, 5}, DeliveredTokenIds: []uint32{6}},
			{Key: 8, Prompt: "b", DeliveredTokenIds: []uint32{2}},
		}
		h := start(t, w, func(c *Config) { c.NoFailback = true })
		w.ring.snaps[7] = &frmpsv1.RequestSnapshot{BlockIds: []uint32{3}, TokenIds: []uint32{4, 5, 6}, NumPromptTokens: 2, NumComputedTokens: 2, Step: 5}
		w.ring.snaps[8] = &frmpsv1.RequestSnapshot{BlockIds: []uint32{1}, TokenIds: []uint32{1, 2}, NumPromptTokens: 1, NumComputedTokens: 1, Step: 5}
		old, sb := w.liveRole(failover.Active), w.liveRole(failover.Standby)
		old.Kill()
		synctest.Wait()
		h.wantState(failover.ServingReady)
		if len(sb.resumes) != 1 || len(sb.resumes[0].GetRequests()) != 2 {
			t.Fatalf("resumes %v", sb.resumes)
		}
		for _, r := range sb.resumes[0].GetRequests() {
			s := r.GetSnapshot()
			switch r.GetKey() {
			case 7:
				if len(s.GetTokenIds()) != 0 || !slices.Equal(s.GetOutputTokenIds(), []uint32{6}) || s.GetNumPromptTokens() != 2 {
					t.Fatalf("request 7's snapshot %v", s)
				}
			case 8:
				if !slices.Equal(s.GetTokenIds(), []uint32{1, 2}) || len(s.GetOutputTokenIds()) != 0 {
					t.Fatalf("request 8's snapshot %v", s)
				}
			}
		}
	})
}

// The Resume a takeover of 32 requests of 400 prompt and 200 output tokens
// sends, encoded, with each snapshot whole and with the request's own prompt
// left out of it (elidePrompt): go test -bench ResumeEncode -run '^$' ./supervisor
func BenchmarkResumeEncode(b *testing.B) {
	for _, elide := range []bool{false, true} {
		b.Run(map[bool]string{false: "whole", true: "prompt-left-out"}[elide], func(b *testing.B) {
			env := resumeOf(32, 400, 200, elide)
			frame, err := control.Encode(env)
			if err != nil {
				b.Fatal(err)
			}
			for b.Loop() {
				if _, err := control.Encode(env); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(len(frame)), "bytes")
		})
	}
}

func resumeOf(n, prompt, output int, elide bool) *frmpsv1.Envelope {
	rng := uint32(7)
	next := func() uint32 { rng = rng*1664525 + 1013904223; return rng % 150000 }
	res := &frmpsv1.Resume{}
	for k := range n {
		p, o := make([]uint32, prompt), make([]uint32, output)
		for i := range p {
			p[i] = next()
		}
		for i := range o {
			o[i] = next()
		}
		snap := &frmpsv1.RequestSnapshot{TokenIds: slices.Concat(p, o), NumPromptTokens: uint32(prompt),
			NumComputedTokens: uint32(prompt + output - 1), BlockIds: make([]uint32, (prompt+output)/16+1)}
		if elide {
			snap = elidePrompt(snap, p)
		}
		res.Requests = append(res.Requests, &frmpsv1.ResumeRequest{Key: uint64(k), PromptTokenIds: p, DeliveredTokenIds: o, Snapshot: snap})
	}
	return &frmpsv1.Envelope{Id: 1, Msg: &frmpsv1.Envelope_Resume{Resume: res}}
}

// newFailovers is a failovers owner on its own: its timer's events go to the
// returned channel instead of a loop; every death classifies as "signal".
func newFailovers(t *testing.T) (*failovers, chan event) {
	t.Helper()
	m, err := newMetrics(nil, "m")
	if err != nil {
		t.Fatal(err)
	}
	events := make(chan event, 8)
	f := &failovers{timeout: time.Second, syncEvery: 4, maxRecords: 2, log: hclog.NewNullLogger(), metrics: m,
		post: func(ev event) { events <- ev }, wg: &sync.WaitGroup{},
		classify: func(*slot) (string, string) { return "signal", "signal 9" }}
	t.Cleanup(f.wg.Wait)
	return f, events
}

// A Resume goes to the engine resumed, with the open requests and the ring;
// one that cannot go says why; no reply in time is the resume's timeout.
func TestFailoversSendResume(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f, events := newFailovers(t)
		next := func() uint64 { return 7 }
		reqs := func() []*frmpsv1.ResumeRequest { return []*frmpsv1.ResumeRequest{{Key: 1}} }
		if why := f.sendResume(reqs, next, "/ring"); why != "no engine to resume" {
			t.Fatalf("with no resume in progress: %q", why)
		}
		target := &slot{proc: deadProcess{}}
		f.begin(&failoverRun{kind: resumeFailover, target: target, detected: time.Now()})
		if why := f.sendResume(reqs, next, "/ring"); why != "standby has no control connection" {
			t.Fatalf("to an engine with no connection: %q", why)
		}
		server, client := fakePipe(1)
		target.conn = server
		time.Sleep(time.Millisecond)
		if why := f.sendResume(reqs, next, "/ring"); why != "" {
			t.Fatalf("sendResume: %q", why)
		}
		env, _, err := client.Recv()
		if err != nil {
			t.Fatal(err)
		}
		r := env.GetResume()
		if env.GetId() != 7 || r.GetRingPath() != "/ring" || r.GetSyncEvery() != 4 || len(r.GetRequests()) != 1 {
			t.Fatalf("resume sent: %v", env)
		}
		if d := f.detectToResumeSeen(); len(d) != 1 || d[0] != time.Millisecond {
			t.Fatalf("detect to resume %v, want [1ms]", d)
		}
		ev := <-events // the reply never comes
		if ev.kind != evResumeTimeout || !f.timedOut(ev) || f.timedOut(event{id: 6}) {
			t.Fatalf("timeout event %v (id %d) not the resume's", ev.kind, ev.id)
		}
	})
}

// A reply to the Resume in progress is the machine's ResumeAcked (and the
// run to finish) or ResumeFailed; any other reply is stale. Finished or
// aborted failovers are recorded, newest first, classified off the loop.
func TestFailoversAnswerAndRecord(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f, _ := newFailovers(t)
		target, old := &slot{proc: deadProcess{}}, &slot{proc: deadProcess{}}
		run := &failoverRun{kind: resumeFailover, target: target, old: old, detected: time.Now(), cause: "control socket closed",
			resumeID: 3, timer: time.NewTimer(time.Hour)}
		f.begin(run)
		if !f.resuming(target) || f.resuming(old) || !f.replacing(old) {
			t.Fatal("resuming/replacing do not name the run's engines")
		}
		if _, _, ok := f.answer(event{slot: target, id: 2, reply: &frmpsv1.Reply{Ok: true}}); ok {
			t.Fatal("a reply to another command answered the resume")
		}
		if _, _, ok := f.answer(event{slot: old, id: 3, reply: &frmpsv1.Reply{Ok: true}}); ok {
			t.Fatal("another engine's reply answered the resume")
		}
		fev, acked, ok := f.answer(event{slot: target, id: 3, reply: &frmpsv1.Reply{Error: "no"}})
		if !ok || acked != nil || fev.Kind != failover.ResumeFailed || fev.Cause != "standby refused resume: no" {
			t.Fatalf("refusal: %v %v %v", fev, acked, ok)
		}
		time.Sleep(2 * time.Millisecond)
		reply := &frmpsv1.Reply{Ok: true, Resumed: []*frmpsv1.ResumeOutcome{{Ok: true, ReusedTokens: 5}, {Ok: false}}}
		fev, acked, ok = f.answer(event{slot: target, id: 3, reply: reply, at: time.Now()})
		if !ok || acked != run || fev.Kind != failover.ResumeAcked || fev.Cause != "control socket closed" {
			t.Fatalf("ack: %v %v %v", fev, acked, ok)
		}
		f.published(2)
		f.finish(acked, time.Now(), reply)
		if f.run != nil {
			t.Fatal("the run is still in progress after finish")
		}
		f.wg.Wait()
		recs := f.shownRecords()
		if len(recs) != 1 || !recs[0].GetOk() || recs[0].GetResumedRequests() != 1 || recs[0].GetReusedTokens() != 5 ||
			recs[0].GetCause() != "signal" || recs[0].GetDurationSeconds() != 0.002 {
			t.Fatalf("records %v", recs)
		}
		if old.deathCause != "signal: signal 9" {
			t.Fatalf("old engine's death cause %q", old.deathCause)
		}
		for i := range 2 {
			f.begin(&failoverRun{kind: resumeFailover, target: target, old: old, class: classDrill, cause: fmt.Sprint("drill ", i)})
			f.abort(failover.Event{At: time.Now(), Cause: "standby died"})
		}
		f.begin(&failoverRun{kind: resumeHandover, target: target})
		f.abort(failover.Event{Cause: "a handover's outcome is failback's"})
		f.wg.Wait()
		recs = f.shownRecords()
		if len(recs) != 2 || recs[0].GetSeq() != 3 || recs[0].GetOk() || recs[0].GetError() != "standby died" || recs[0].GetCause() != classDrill {
			t.Fatalf("records after two aborts (at most 2 kept): %v", recs)
		}
	})
}

// The first resumed token of a promoted generation ends its record, also
// when it comes before the record is written; a handover's ends it too.
func TestFailoversFirstResumedToken(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f, _ := newFailovers(t)
		target, old := &slot{proc: deadProcess{}}, &slot{proc: deadProcess{}}
		ok := &frmpsv1.Reply{Ok: true, Resumed: []*frmpsv1.ResumeOutcome{{Ok: true}}}
		t0 := time.Now()
		f.published(1)
		f.begin(&failoverRun{kind: resumeFailover, target: target, old: old, detected: t0})
		time.Sleep(time.Second)
		f.noteResumedToken(1, time.Now()) // before the record
		f.noteResumedToken(1, time.Now().Add(time.Hour))
		f.finish(f.run, time.Now(), ok)
		if got := f.shownRecords()[0].GetFirstTokenSeconds(); got != 1 {
			t.Fatalf("first token %vs after the death, want 1 (the token that came first)", got)
		}
		f.published(2)
		f.begin(&failoverRun{kind: resumeFailover, target: target, old: old, detected: time.Now()})
		f.finish(f.run, time.Now(), ok)
		f.noteResumedToken(1, time.Now()) // an old generation's
		time.Sleep(time.Second)
		f.noteResumedToken(2, time.Now())
		f.noteResumedToken(2, time.Now().Add(time.Hour))
		if got := f.shownRecords()[0].GetFirstTokenSeconds(); got != 1 {
			t.Fatalf("first token %vs, want 1", got)
		}
		var handover float64
		f.published(3)
		f.awaitHandover(time.Now(), func(v float64) { handover = v })
		time.Sleep(500 * time.Millisecond)
		f.noteResumedToken(3, time.Now())
		f.mu.Lock()
		got := handover
		f.mu.Unlock()
		if got != 0.5 {
			t.Fatalf("handover first token %vs, want 0.5", got)
		}
		f.wg.Wait()
	})
}

func TestFailoverOnActiveKill(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		w := newWorld()
		w.front.open = []*frmpsv1.ResumeRequest{{Key: 7, Prompt: "a", DeliveredTokenIds: []uint32{1, 2}}, {Key: 8, Prompt: "b"}}
		// The failover alone (failback_test.go covers what follows it).
		h := start(t, w, func(c *Config) { c.NoFailback = true })
		w.ring.snaps[7] = &frmpsv1.RequestSnapshot{BlockIds: []uint32{3}, TokenIds: []uint32{9, 1}, NumComputedTokens: 2, Step: 5}
		old, sb := w.liveRole(failover.Active), w.liveRole(failover.Standby)
		old.Kill()
		synctest.Wait()
		h.wantState(failover.ServingReady)
		if len(sb.resumes) != 1 {
			t.Fatalf("standby got %d resumes", len(sb.resumes))
		}
		res := sb.resumes[0]
		if res.GetRingPath() != w.ring.path || res.GetSyncEvery() != 16 || len(res.GetRequests()) != 2 {
			t.Fatalf("resume %v", res)
		}
		if r := res.GetRequests()[0]; r.GetSnapshot().GetStep() != 5 || !slices.Equal(r.GetDeliveredTokenIds(), []uint32{1, 2}) {
			t.Fatalf("request 7 resumed as %v", r)
		}
		if res.GetRequests()[1].Snapshot != nil {
			t.Fatal("request 8 has a snapshot it never published")
		}
		gen, g := h.current(2)
		if g != 2 || gen.endpoint != "unix://"+sb.inv.GenerationSocket {
			t.Fatalf("after failover current %s gen %d", gen.endpoint, g)
		}
		fresh := w.liveRole(failover.Standby)
		if fresh == nil || fresh == sb || !slices.Equal(fresh.sleepFD, testFDs) {
			t.Fatalf("no fresh standby with the same fds: %v", fresh)
		}
		st := h.s.Status()
		if len(st.Failovers) != 1 {
			t.Fatalf("records %v", st.Failovers)
		}
		rec := st.Failovers[0]
		if !rec.GetOk() || rec.GetCause() != "signal" || rec.GetResumedRequests() != 2 || rec.GetDurationSeconds() < 0 {
			t.Fatalf("record %v", rec)
		}
		if v := testutil.ToFloat64(h.s.metrics.failovers.WithLabelValues("signal")); v != 1 {
			t.Fatalf("failovers_total{signal} = %v", v)
		}
		if n := testutil.CollectAndCount(h.s.metrics.duration); n != 1 {
			t.Fatalf("duration histogram has %d series", n)
		}
		if w.mps.checks == 0 {
			t.Fatal("MPS not checked after the failover")
		}
		if v := testutil.ToFloat64(h.s.metrics.restarts.WithLabelValues("standby")); v != 1 {
			t.Fatalf("restarts{standby} = %v", v)
		}
		h.stop()
	})
}

func TestResumeRefusedColdStarts(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		w := newWorld()
		w.behave = func(r failover.Role, n int) behavior {
			if r == failover.Standby && n == 0 {
				return behavior{resumeReply: func(*frmpsv1.Resume) *frmpsv1.Reply { return &frmpsv1.Reply{Error: "layout mismatch"} }}
			}
			return behavior{}
		}
		h := start(t, w, nil)
		w.liveRole(failover.Active).Kill()
		synctest.Wait()
		time.Sleep(time.Second) // the cold start's backoff
		synctest.Wait()
		// A new active loaded the weights (fresh broker), and a new standby is armed.
		h.wantState(failover.ServingReady)
		if _, g := h.current(2); g != 2 {
			t.Fatalf("gen %d", g)
		}
		if len(w.broker) != 2 || !w.broker[0].closed {
			t.Fatalf("cold start did not replace the broker: %d brokers", len(w.broker))
		}
		rec := h.s.Status().Failovers[0]
		if rec.GetOk() || !strings.Contains(rec.GetError(), "layout mismatch") {
			t.Fatalf("record %v", rec)
		}
		h.stop()
	})
}

func TestStandbyDiesDuringTakeover(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		w := newWorld()
		w.behave = func(r failover.Role, n int) behavior {
			return behavior{dieOnResume: r == failover.Standby && n == 0}
		}
		h := start(t, w, nil)
		w.liveRole(failover.Active).Kill()
		synctest.Wait()
		time.Sleep(time.Second)
		synctest.Wait()
		h.wantState(failover.ServingReady)
		if w.launched[failover.Active] != 2 {
			t.Fatalf("actives launched %d, want a cold restart", w.launched[failover.Active])
		}
		if rec := h.s.Status().Failovers[0]; rec.GetOk() {
			t.Fatalf("record %v", rec)
		}
		h.stop()
	})
}

func TestTimeoutOnResume(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		w := newWorld()
		block := make(chan struct{})
		w.behave = func(r failover.Role, n int) behavior {
			if r == failover.Standby && n == 0 {
				return behavior{resumeReply: func(*frmpsv1.Resume) *frmpsv1.Reply { <-block; return &frmpsv1.Reply{Ok: true} }}
			}
			return behavior{}
		}
		h := start(t, w, nil)
		w.liveRole(failover.Active).Kill()
		synctest.Wait()
		h.wantState(failover.FailingOver)
		time.Sleep(2 * time.Second) // virtual time: the resume timeout and the cold start's backoff elapse
		synctest.Wait()
		h.wantState(failover.ServingReady)
		if rec := h.s.Status().Failovers[0]; rec.GetOk() || !strings.Contains(rec.GetError(), "no reply to resume") {
			t.Fatalf("record %v", rec)
		}
		close(block)
		h.stop()
	})
}
