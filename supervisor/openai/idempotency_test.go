package openai_test

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/frmps/frmps/supervisor/openai"
	"github.com/frmps/frmps/supervisor/openai/fakegen"
)

func TestIdempotentReplayAfterFinish(t *testing.T) {
	h, eng := newHarness(t, openai.Config{}, fakegen.Config{})
	body := `{"model":"test-model","prompt":"x","max_tokens":4}`
	r1 := h.post("/v1/completions", body, "Idempotency-Key", "k1")
	b1, _ := io.ReadAll(r1.Body)
	r1.Body.Close()
	r2 := h.post("/v1/completions", body, "Idempotency-Key", "k1", "X-Request-Id", "retry-1")
	b2, _ := io.ReadAll(r2.Body)
	r2.Body.Close()
	if r1.StatusCode != 200 || r2.StatusCode != 200 || string(b1) != string(b2) {
		t.Fatalf("replay differs:\n%d %s\n%d %s", r1.StatusCode, b1, r2.StatusCode, b2)
	}
	if r2.Header.Get("X-Request-Id") != "retry-1" {
		t.Errorf("replay x-request-id %q", r2.Header.Get("X-Request-Id"))
	}
	if n := len(eng.Requests()); n != 1 {
		t.Errorf("engine ran %d generations for one key", n)
	}
	// Same key, other body: refused.
	checkError(t, h.post("/v1/completions", `{"model":"test-model","prompt":"other"}`, "Idempotency-Key", "k1"), 422, nil, "idempotency_key_reused")
	// Same key on the other endpoint is another key.
	r3 := h.post("/v1/chat/completions", `{"model":"test-model","messages":[{"role":"user","content":"x"}]}`, "Idempotency-Key", "k1")
	r3.Body.Close()
	if r3.StatusCode != 200 || len(eng.Requests()) != 2 {
		t.Errorf("chat with the same key: %d, %d generations", r3.StatusCode, len(eng.Requests()))
	}
}

func TestIdempotentAttachToRunningStream(t *testing.T) {
	h, eng := newHarness(t, openai.Config{}, fakegen.Config{Interval: 2 * time.Millisecond, OutputLen: 30, MaxModelLen: 100})
	body := `{"model":"test-model","prompt":"x","stream":true}`
	r1 := h.post("/v1/completions", body, "Idempotency-Key", "s1")
	defer r1.Body.Close()
	buf := make([]byte, 32)
	if _, err := r1.Body.Read(buf); err != nil { // the first is running
		t.Fatal(err)
	}
	r2 := h.post("/v1/completions", body, "Idempotency-Key", "s1")
	s2 := readStream(t, r2.Body, nil)
	r2.Body.Close()
	rest := readStream(t, io.MultiReader(stringsReader(string(buf)), r1.Body), nil)
	if !s2.done || !rest.done {
		t.Fatalf("done: attached %v, original %v", s2.done, rest.done)
	}
	if s2.text() != rest.text() || s2.events[0]["id"] != rest.events[0]["id"] {
		t.Errorf("attached stream differs from the original:\n%q\n%q", s2.text(), rest.text())
	}
	if n := len(eng.Requests()); n != 1 {
		t.Errorf("%d generations for one key", n)
	}
}

func TestIdempotentDetachedRunAbortsAfterGrace(t *testing.T) {
	h, eng := newHarness(t, openai.Config{IdempotencyDetachGrace: 20 * time.Millisecond},
		fakegen.Config{Interval: 5 * time.Millisecond, OutputLen: 500, MaxModelLen: 1000})
	ctx, cancel := context.WithCancel(context.Background())
	r := h.do(ctx, http.MethodPost, "/v1/completions", `{"model":"test-model","prompt":"x","stream":true}`, "Idempotency-Key", "g1")
	buf := make([]byte, 16)
	if _, err := r.Body.Read(buf); err != nil {
		t.Fatal(err)
	}
	cancel()
	r.Body.Close()
	select {
	case <-eng.Aborts():
	case <-time.After(10 * time.Second):
		t.Fatal("detached idempotent run never aborted")
	}
}

func TestShutdownDrainsAndRefuses(t *testing.T) {
	h, _ := newHarness(t, openai.Config{}, fakegen.Config{Interval: 2 * time.Millisecond, OutputLen: 20})
	resp := h.post("/v1/completions", `{"model":"test-model","prompt":"x","stream":true}`)
	buf := make([]byte, 16)
	if _, err := resp.Body.Read(buf); err != nil {
		t.Fatal(err)
	}
	errc := make(chan error, 1)
	go func() { errc <- h.fd.Shutdown(context.Background()) }()
	s := readStream(t, io.MultiReader(stringsReader(string(buf)), resp.Body), nil)
	resp.Body.Close()
	if !s.done {
		t.Error("in-flight stream was not drained to [DONE]")
	}
	if err := <-errc; err != nil {
		t.Errorf("shutdown: %v", err)
	}
	checkError(t, h.post("/v1/completions", `{"model":"test-model","prompt":"x"}`), 503, nil, "engine_unavailable")
}

func TestShutdownDeadlineCutsStreams(t *testing.T) {
	h, eng := newHarness(t, openai.Config{}, fakegen.Config{Interval: 5 * time.Millisecond, OutputLen: 900, MaxModelLen: 1000})
	resp := h.post("/v1/completions", `{"model":"test-model","prompt":"x","stream":true}`)
	buf := make([]byte, 16)
	if _, err := resp.Body.Read(buf); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Millisecond)
	defer cancel()
	if err := h.fd.Shutdown(ctx); err == nil {
		t.Error("shutdown past its deadline returned nil")
	}
	s := readStream(t, io.MultiReader(stringsReader(string(buf)), resp.Body), nil)
	resp.Body.Close()
	lastIsError(t, s, "engine_unavailable")
	<-eng.Aborts()
}

func TestShutdownDoesNotHangOnStalledClient(t *testing.T) {
	h, _ := newHarness(t, openai.Config{FinalWriteTimeout: 50 * time.Millisecond},
		fakegen.Config{OutputLen: 100000, MaxModelLen: 1 << 20, TextPad: 8 << 10})
	conn, err := net.Dial("tcp", h.srv.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	body := `{"model":"test-model","prompt":"x","stream":true}`
	fmt.Fprintf(conn, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
	// Never read: the server's socket buffer fills and its writes block.
	// Wait until delivery stalls: the buffers are full and a write blocks.
	deadline := time.Now().Add(10 * time.Second)
	for last := -1.0; time.Now().Before(deadline); {
		time.Sleep(100 * time.Millisecond)
		n := metricValue(t, h.reg, "frmps_tokens_generated_total", nil)
		if n > 0 && n == last {
			break
		}
		last = n
	}
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- h.fd.Shutdown(ctx) }()
	select {
	case err := <-done:
		if err == nil {
			t.Error("shutdown with a stalled stream returned nil before its deadline")
		}
	case <-time.After(10 * time.Second):
		t.Fatal("shutdown hangs on a client that stopped reading")
	}
}

func TestIdempotencyBounds(t *testing.T) {
	// Room for about one finished response: the second evicts the first.
	h, eng := newHarness(t, openai.Config{IdempotencyMaxTotalBytes: 400}, fakegen.Config{})
	body := `{"model":"test-model","prompt":"x","max_tokens":3}`
	for _, k := range []string{"a", "b", "a"} {
		resp := h.post("/v1/completions", body, "Idempotency-Key", k)
		_, _ = io.Copy(io.Discard, resp.Body) // the whole response: its run has finished
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("key %s: %d", k, resp.StatusCode)
		}
	}
	if n := len(eng.Requests()); n != 3 {
		t.Errorf("%d generations; want 3 (the replay of a was evicted by b)", n)
	}
	resp := h.post("/v1/completions", body, "Idempotency-Key", "a") // a is cached again now
	resp.Body.Close()
	if n := len(eng.Requests()); n != 3 {
		t.Errorf("%d generations after a replay", n)
	}
	checkError(t, h.post("/v1/completions", body, "Idempotency-Key", strings.Repeat("k", 256)), 400, nil, nil)
}
