package openai_test

import (
	"context"
	"io"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
	"github.com/frmps/frmps/supervisor/openai"
	"github.com/frmps/frmps/supervisor/openai/fakegen"
)

const streamBody = `{"model":"test-model","messages":[{"role":"user","content":"tell me"}],"stream":true,"max_tokens":20,"seed":7,"temperature":0.8,"stream_options":{"include_usage":true}}`

// noFault runs body on a healthy fake and returns the stream.
func noFault(t *testing.T, body string, ecfg fakegen.Config) stream {
	t.Helper()
	h, _ := newHarness(t, openai.Config{}, ecfg)
	resp := h.post("/v1/chat/completions", body)
	defer resp.Body.Close()
	return readStream(t, resp.Body, nil)
}

// failoverTo plays the supervisor: once old dies it takes the resume set
// (optionally edited), lets next adopt it and makes next current.
func (h *harness) failoverTo(old, next *fakegen.Engine, edit func([]*frmpsv1.ResumeRequest), ready <-chan struct{}) <-chan []*frmpsv1.ResumeRequest {
	got := make(chan []*frmpsv1.ResumeRequest, 1)
	go func() {
		<-old.Dead()
		h.backend.Clear()
		reqs := h.fd.OpenRequests()
		got <- reqs
		if ready != nil {
			<-ready
		}
		if edit != nil {
			edit(reqs)
		}
		next.Adopt(reqs)
		h.backend.Set(next.Client())
	}()
	return got
}

func usageOf(t *testing.T, s stream) map[string]any {
	t.Helper()
	last := s.events[len(s.events)-1]
	u, ok := last["usage"].(map[string]any)
	if !ok {
		t.Fatalf("no usage in last event %v", last)
	}
	return u
}

func TestStreamAcrossFailover(t *testing.T) {
	for _, tc := range []struct {
		name string
		ecfg fakegen.Config
		// lag makes the resume set claim fewer delivered tokens than the
		// client has, as a supervisor snapshot taken mid-flight may.
		lag int
	}{
		{name: "one token per chunk", ecfg: fakegen.Config{}},
		{name: "three tokens per chunk", ecfg: fakegen.Config{TokensPerChunk: 3}},
		{name: "engine repeats delivered tokens", ecfg: fakegen.Config{ResumeFromAdopted: true}, lag: 2},
		// The resume then carries the ids, not the messages: the next engine need not tokenize.
		// (Paced: a fake that sends everything at once dies before the front door read its first chunk.)
		{name: "engine reports the prompt's ids", ecfg: fakegen.Config{PromptIDs: true, Interval: time.Millisecond}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			want := noFault(t, streamBody, tc.ecfg)
			if !want.done {
				t.Fatal("baseline did not finish")
			}
			killCfg := tc.ecfg
			killCfg.KillAfter = 7
			h, a := newHarness(t, openai.Config{}, killCfg)
			b := h.addEngine(tc.ecfg)
			sets := h.failoverTo(a, b, func(reqs []*frmpsv1.ResumeRequest) {
				for _, r := range reqs {
					r.DeliveredTokenIds = r.DeliveredTokenIds[:max(len(r.DeliveredTokenIds)-tc.lag, 0)]
				}
			}, nil)
			resp := h.post("/v1/chat/completions", streamBody)
			got := readStream(t, resp.Body, nil)
			resp.Body.Close()
			if !got.done {
				t.Fatalf("stream did not end with [DONE]: %v", got.raw)
			}
			if got.text() != want.text() {
				t.Errorf("text across failover\n got %q\nwant %q", got.text(), want.text())
			}
			gu, wu := usageOf(t, got), usageOf(t, want)
			if gu["completion_tokens"] != 20.0 || gu["completion_tokens"] != wu["completion_tokens"] || gu["prompt_tokens"] != wu["prompt_tokens"] {
				t.Errorf("usage %v, no-fault %v", gu, wu)
			}
			for _, ev := range got.events {
				if ev["id"] != got.events[0]["id"] || ev["created"] != got.events[0]["created"] {
					t.Fatalf("id/created changed mid-stream: %v vs %v", ev, got.events[0])
				}
			}
			// Every token exactly once: each chunk's token text appears once, in order.
			words := strings.Fields(got.text())
			if len(words) != 20 {
				t.Errorf("%d tokens delivered, want 20", len(words))
			}
			set := <-sets
			if len(set) != 1 {
				t.Fatalf("resume set has %d requests", len(set))
			}
			rr := set[0]
			if rr.GetParams().GetSeed() != 7 || rr.GetParams().GetMaxTokens() != 20 {
				t.Errorf("resume request %v", rr)
			}
			if tc.ecfg.PromptIDs {
				if len(rr.GetPromptTokenIds()) != 5 || len(rr.GetMessages()) != 0 || rr.GetPrompt() != "" {
					t.Errorf("resume request %v: want the 5 prompt ids the engine reported, no messages", rr)
				}
			} else if len(rr.GetMessages()) != 1 || rr.GetMessages()[0].GetContent() != "tell me" || len(rr.GetPromptTokenIds()) != 0 {
				t.Errorf("resume request %v: want the request's messages", rr)
			}
			if n := len(rr.GetDeliveredTokenIds()); n > 7 {
				t.Errorf("resume set claims %d delivered tokens; the engine sent 7", n)
			}
			res := b.Resumes()
			if len(res) != 1 || res[0].GetDelivered() != 7 {
				t.Errorf("resume calls %v, want one with delivered=7", res)
			} else if d := res[0].GetDetok(); d.GetPrefix() != 6 || d.GetRead() != 7 {
				// The detokenizer state of the last chunk delivered (it ended at token 7).
				t.Errorf("resume call's detok %v, want the last delivered chunk's {6, 7}", d)
			}
			if n := metricValue(t, h.reg, "frmps_stream_resumes_total", map[string]string{"outcome": "ok"}); n != 1 {
				t.Errorf("stream_resumes_total{ok} = %v", n)
			}
			for _, phase := range []string{"engine", "open", "first_token"} {
				if n := metricValue(t, h.reg, "frmps_stream_resume_phase_seconds", map[string]string{"phase": phase}); n != 1 {
					t.Errorf("stream_resume_phase_seconds{phase=%q} has %v samples, want 1", phase, n)
				}
			}
			if n := metricValue(t, h.reg, "frmps_tokens_generated_total", nil); n != 20 {
				t.Errorf("tokens_generated_total = %v", n)
			}
			if open := h.fd.OpenRequests(); len(open) != 0 {
				t.Errorf("finished request still open: %v", open)
			}
		})
	}
}

func TestNonStreamingAcrossFailover(t *testing.T) {
	body := `{"model":"test-model","prompt":"x y","max_tokens":12,"seed":1}`
	h0, e0 := newHarness(t, openai.Config{}, fakegen.Config{})
	want := readJSON(t, h0.post("/v1/completions", body))
	_ = e0
	h, a := newHarness(t, openai.Config{}, fakegen.Config{KillAfter: 5})
	b := h.addEngine(fakegen.Config{})
	h.failoverTo(a, b, nil, nil)
	got := readJSON(t, h.post("/v1/completions", body))
	wc, gc := want["choices"].([]any)[0].(map[string]any), got["choices"].([]any)[0].(map[string]any)
	if gc["text"] != wc["text"] || gc["finish_reason"] != "length" {
		t.Errorf("text %q want %q (%v)", gc["text"], wc["text"], gc["finish_reason"])
	}
	if got["usage"].(map[string]any)["completion_tokens"] != 12.0 {
		t.Errorf("usage %v", got["usage"])
	}
}

func TestFailoverBeforeFirstToken(t *testing.T) {
	// The engine dies before sending anything, and the new one never adopted
	// the request: with nothing delivered, it starts afresh on the new engine.
	h, a := newHarness(t, openai.Config{}, fakegen.Config{})
	b := h.addEngine(fakegen.Config{})
	a.Kill()
	<-a.Dead()
	go func() {
		time.Sleep(20 * time.Millisecond) // let the request hit the dead engine first
		h.backend.Set(b.Client())
	}()
	resp := h.post("/v1/chat/completions", streamBody)
	s := readStream(t, resp.Body, nil)
	resp.Body.Close()
	if !s.done || len(strings.Fields(s.text())) != 20 {
		t.Fatalf("done=%v text %q", s.done, s.text())
	}
}

func TestKeepAlivesDuringGap(t *testing.T) {
	h, a := newHarness(t, openai.Config{KeepAliveInterval: 5 * time.Millisecond}, fakegen.Config{KillAfter: 4})
	b := h.addEngine(fakegen.Config{})
	sawKeepAlive := make(chan struct{})
	var once atomic.Bool
	// The failover completes only after the client has seen a keep-alive.
	h.failoverTo(a, b, nil, sawKeepAlive)
	resp := h.post("/v1/chat/completions", streamBody)
	s := readStream(t, resp.Body, func(line string) {
		if line == ": keep-alive" && once.CompareAndSwap(false, true) {
			close(sawKeepAlive)
		}
	})
	resp.Body.Close()
	if s.keepAlives == 0 || !s.done || len(strings.Fields(s.text())) != 20 {
		t.Fatalf("keep-alives %d done %v text %q", s.keepAlives, s.done, s.text())
	}
}

// lastIsError checks the stream ended with an error event and no [DONE].
func lastIsError(t *testing.T, s stream, code string) {
	t.Helper()
	if s.done {
		t.Fatalf("stream ended with [DONE] although it failed: %v", s.raw)
	}
	last := s.events[len(s.events)-1]
	e, ok := last["error"].(map[string]any)
	if !ok || keys(last) != "error" || keys(e) != "code,message,param,type" {
		t.Fatalf("last event is not an error: %v", last)
	}
	if e["code"] != code {
		t.Errorf("error code %v, want %s (%v)", e["code"], code, e["message"])
	}
}

func TestResumeRefusedEndsWithErrorEvent(t *testing.T) {
	h, a := newHarness(t, openai.Config{}, fakegen.Config{KillAfter: 4})
	b := h.addEngine(fakegen.Config{})
	go func() { // a new engine that never adopted the request
		<-a.Dead()
		h.backend.Set(b.Client())
	}()
	resp := h.post("/v1/chat/completions", streamBody)
	s := readStream(t, resp.Body, nil)
	resp.Body.Close()
	lastIsError(t, s, "stream_resume_failed")
	// The log says which engine ended the stream, and where.
	if l := h.logs.String(); !strings.Contains(l, "engine ended a stream") || !strings.Contains(l, "resume=true") ||
		!strings.Contains(l, "delivered=4") || !strings.Contains(l, "generation=") {
		t.Errorf("no log line of the refused resume:\n%s", l)
	}
	if n := len(strings.Fields(s.text())); n != 4 {
		t.Errorf("%d tokens before the error, want 4", n)
	}
	if n := metricValue(t, h.reg, "frmps_stream_resumes_total", map[string]string{"outcome": "failed"}); n != 1 {
		t.Errorf("resumes failed = %v", n)
	}
}

// TestResumeRefusedWholeIs503 is the non-streaming case: nothing was sent
// yet, so the client gets a 503 it may retry (the output is reproducible).
func TestResumeRefusedWholeIs503(t *testing.T) {
	h, a := newHarness(t, openai.Config{}, fakegen.Config{KillAfter: 4})
	b := h.addEngine(fakegen.Config{})
	go func() { // a new engine that never adopted the request
		<-a.Dead()
		h.backend.Set(b.Client())
	}()
	resp := h.post("/v1/completions", `{"model":"test-model","prompt":"x","max_tokens":10}`)
	checkError(t, resp, 503, nil, "stream_resume_failed")
	if resp.Header.Get("Retry-After") != "1" || resp.Header.Get("X-Should-Retry") != "true" {
		t.Errorf("503 without Retry-After: %v", resp.Header)
	}
}

func TestResumeTimeoutEndsWithErrorEvent(t *testing.T) {
	h, _ := newHarness(t, openai.Config{ResumeTimeout: 50 * time.Millisecond}, fakegen.Config{KillAfter: 3})
	resp := h.post("/v1/completions", `{"model":"test-model","prompt":"x","stream":true,"max_tokens":10}`)
	s := readStream(t, resp.Body, nil)
	resp.Body.Close()
	lastIsError(t, s, "stream_resume_failed")
}

func TestClientDisconnectAborts(t *testing.T) {
	for _, stream := range []bool{true, false} {
		h, a := newHarness(t, openai.Config{}, fakegen.Config{Interval: 5 * time.Millisecond, OutputLen: 50, MaxModelLen: 1000})
		ctx, cancel := context.WithCancel(context.Background())
		body := `{"model":"test-model","prompt":"x","stream":false}`
		if stream {
			body = `{"model":"test-model","prompt":"x","stream":true}`
		}
		if !stream {
			go func() { // cancel once the engine is generating
				for a.Running() == 0 && ctx.Err() == nil {
					time.Sleep(time.Millisecond)
				}
				cancel()
			}()
		}
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, h.srv.URL+"/v1/completions", strings.NewReader(body))
		resp, err := h.client.Do(req)
		if stream {
			if err != nil {
				t.Fatal(err)
			}
			buf := make([]byte, 64)
			if _, err := resp.Body.Read(buf); err != nil {
				t.Fatal(err)
			}
			cancel()
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		} else if err == nil {
			resp.Body.Close()
			t.Fatal("non-streaming request completed although cancelled")
		}
		select {
		case key := <-a.Aborts():
			if reqs := a.Requests(); len(reqs) != 1 || reqs[0].GetKey() != key {
				t.Errorf("aborted key %d, requests %v", key, reqs)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("stream=%v: engine never got Abort", stream)
		}
		cancel()
	}
}

func TestQueueFull(t *testing.T) {
	h, a := newHarness(t, openai.Config{MaxConcurrent: 1, MaxQueue: -1}, fakegen.Config{Interval: 5 * time.Millisecond, OutputLen: 400, MaxModelLen: 1000})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	first := h.do(ctx, http.MethodPost, "/v1/completions", `{"model":"test-model","prompt":"x","stream":true}`)
	buf := make([]byte, 16)
	if _, err := first.Body.Read(buf); err != nil {
		t.Fatal(err)
	}
	resp := h.post("/v1/completions", `{"model":"test-model","prompt":"y"}`)
	if resp.Header.Get("Retry-After") == "" {
		t.Errorf("429 without Retry-After")
	}
	checkError(t, resp, 429, nil, "rate_limit_exceeded")
	cancel()
	first.Body.Close()
	<-a.Aborts()
}

func TestQueueWaitsForSlot(t *testing.T) {
	h, _ := newHarness(t, openai.Config{MaxConcurrent: 1, MaxQueue: 4}, fakegen.Config{Interval: time.Millisecond, OutputLen: 5})
	done := make(chan int, 3)
	for i := 0; i < 3; i++ {
		go func() {
			req, _ := http.NewRequest(http.MethodPost, h.srv.URL+"/v1/completions", strings.NewReader(`{"model":"test-model","prompt":"x"}`))
			resp, err := h.client.Do(req)
			if err != nil {
				done <- 0
				return
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			done <- resp.StatusCode
		}()
	}
	for i := 0; i < 3; i++ {
		if c := <-done; c != 200 {
			t.Errorf("queued request got %d", c)
		}
	}
}

func TestResumeInsideChunkIsAnError(t *testing.T) {
	// Three tokens a chunk; the resume set claims 5 delivered while the client
	// has 7; an engine restarting at 5 sends tokens 5-7 in one chunk, whose
	// text cannot be split: the stream must fail loudly, not duplicate text.
	h, a := newHarness(t, openai.Config{}, fakegen.Config{TokensPerChunk: 3, KillAfter: 7})
	b := h.addEngine(fakegen.Config{TokensPerChunk: 3, ResumeFromAdopted: true})
	h.failoverTo(a, b, func(reqs []*frmpsv1.ResumeRequest) {
		for _, r := range reqs {
			if len(r.DeliveredTokenIds) >= 5 {
				r.DeliveredTokenIds = r.DeliveredTokenIds[:5]
			}
		}
	}, nil)
	resp := h.post("/v1/chat/completions", streamBody)
	s := readStream(t, resp.Body, nil)
	resp.Body.Close()
	if len(b.Resumes()) == 1 && b.Resumes()[0].GetDelivered() == 7 {
		lastIsError(t, s, "stream_overlap")
		if n := len(strings.Fields(s.text())); n != 7 {
			t.Errorf("%d tokens reached the client, want the 7 sent before the failure", n)
		}
	} else {
		t.Fatalf("want one resume with delivered=7, got %v", b.Resumes())
	}
}

func TestQueueWaitTimesOut(t *testing.T) {
	h, a := newHarness(t, openai.Config{MaxConcurrent: 1, MaxQueue: 1, QueueTimeout: 20 * time.Millisecond},
		fakegen.Config{Interval: 5 * time.Millisecond, OutputLen: 400, MaxModelLen: 1000})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	first := h.do(ctx, http.MethodPost, "/v1/completions", `{"model":"test-model","prompt":"x","stream":true}`)
	buf := make([]byte, 16)
	if _, err := first.Body.Read(buf); err != nil {
		t.Fatal(err)
	}
	checkError(t, h.post("/v1/completions", `{"model":"test-model","prompt":"y"}`), 429, nil, "rate_limit_exceeded")
	if n := metricValue(t, h.reg, "frmps_queued_requests", nil); n != 0 {
		t.Errorf("queued gauge %v after the timeout", n)
	}
	if n := metricValue(t, h.reg, "frmps_inflight_requests", nil); n != 1 {
		t.Errorf("inflight gauge %v", n)
	}
	cancel()
	first.Body.Close()
	<-a.Aborts()
}

// A resume refused by an engine that has handed the request on (a failback's
// handover reached it first) continues on the newer engine, exactly; a refusal
// with no newer engine stands (TestResumeRefusedEndsWithErrorEvent).
func TestResumeRefusedByAnOlderEngineContinuesOnTheNewer(t *testing.T) {
	want := noFault(t, streamBody, fakegen.Config{})
	h, a := newHarness(t, openai.Config{}, fakegen.Config{KillAfter: 4})
	b := h.addEngine(fakegen.Config{}) // never adopts: refuses the resume
	c := h.addEngine(fakegen.Config{})
	go func() {
		<-a.Dead()
		reqs := h.fd.OpenRequests()
		h.backend.Set(b.Client())
		for len(b.Resumes()) == 0 { // b refused; now the engine that has the request
			time.Sleep(time.Millisecond)
		}
		c.Adopt(reqs)
		h.backend.Set(c.Client())
	}()
	resp := h.post("/v1/chat/completions", streamBody)
	got := readStream(t, resp.Body, nil)
	resp.Body.Close()
	if got.text() != want.text() {
		t.Fatalf("text %q, want %q (no fault)", got.text(), want.text())
	}
	if len(c.Resumes()) != 1 {
		t.Errorf("the newer engine got %d resumes, want 1", len(c.Resumes()))
	}
	if l := h.logs.String(); !strings.Contains(l, "resume refused by an engine no longer current") {
		t.Errorf("no log line of the retried resume:\n%s", l)
	}
}
