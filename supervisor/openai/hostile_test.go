package openai_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/frmps/frmps/supervisor/openai"
	"github.com/frmps/frmps/supervisor/openai/fakegen"
)

// Tests of clients that misbehave on purpose: oversize bodies, slow headers,
// slow bodies, idle keep-alive connections, more connections than allowed.
// They run over real TCP against the http.Server the front door is deployed
// with (newHarness).

const okBody = `{"model":"test-model","prompt":"ok","max_tokens":5}`

// checkServes sends a normal request and checks it is answered in full.
func checkServes(t *testing.T, h *harness) {
	t.Helper()
	resp := h.post("/v1/completions", okBody)
	m := readJSON(t, resp)
	if resp.StatusCode != 200 {
		t.Fatalf("normal request: %d %v", resp.StatusCode, m)
	}
	ch := m["choices"].([]any)[0].(map[string]any)
	if ch["finish_reason"] != "length" || ch["text"] == "" {
		t.Fatalf("normal request: %v", m)
	}
}

// readErrorJSON checks an OpenAI-shaped error body and returns its "error" object.
func readErrorJSON(t *testing.T, body []byte) map[string]any {
	t.Helper()
	var m struct {
		Error map[string]any `json:"error"`
	}
	if err := json.Unmarshal(body, &m); err != nil || m.Error == nil {
		t.Fatalf("not an OpenAI error: %v: %q", err, body)
	}
	for _, k := range []string{"message", "type", "param", "code"} {
		if _, ok := m.Error[k]; !ok {
			t.Fatalf("error without %q: %q", k, body)
		}
	}
	return m.Error
}

// TestOversizeBodyGets413 sends bodies far over the limit, with and without a
// Content-Length, and checks the client reads a 413 with the OpenAI error
// rather than a reset connection.
func TestOversizeBodyGets413(t *testing.T) {
	const limit = 64 << 10
	h, _ := newHarness(t, openai.Config{MaxBodyBytes: limit}, fakegen.Config{})
	big := `{"model":"test-model","prompt":"` + strings.Repeat("x", 8<<20) + `"}`
	for _, tc := range []struct {
		name string
		body func() io.Reader
	}{
		{"content-length", func() io.Reader { return strings.NewReader(big) }},
		{"chunked", func() io.Reader { return struct{ io.Reader }{strings.NewReader(big)} }},
		{"just over", func() io.Reader { return bytes.NewReader(make([]byte, limit+1)) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			req, err := http.NewRequest(http.MethodPost, h.srv.URL+"/v1/completions", tc.body())
			if err != nil {
				t.Fatal(err)
			}
			resp, err := h.client.Do(req)
			if err != nil {
				t.Fatalf("the client could not read the response: %v", err)
			}
			b, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			if err != nil {
				t.Fatal(err)
			}
			e := readErrorJSON(t, b)
			if resp.StatusCode != 413 || e["code"] != "request_too_large" || !strings.Contains(e["message"].(string), "65536 bytes") {
				t.Fatalf("%d %q", resp.StatusCode, b)
			}
		})
	}
	checkServes(t, h)
}

// slowConn is a raw client connection that sends its request a piece at a time.
type slowConn struct {
	net.Conn
	closedAt chan time.Time // when the server closed it
}

func dialSlow(t *testing.T, h *harness, first string) *slowConn {
	t.Helper()
	c, err := net.Dial("tcp", h.srv.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	sc := &slowConn{Conn: c, closedAt: make(chan time.Time, 1)}
	if first != "" {
		if _, err := io.WriteString(c, first); err != nil {
			t.Fatal(err)
		}
	}
	return sc
}

// trickle writes a header line every period until the server closes the
// connection or stop is closed, and reports when the server closed it.
func (c *slowConn) trickle(period time.Duration, stop <-chan struct{}) {
	go func() {
		// Reads end when the server closes the connection (EOF or reset), or
		// when the test's own deadline passes (then the connection was never
		// closed: closedAt stays empty).
		_ = c.SetReadDeadline(time.Now().Add(20 * time.Second))
		_, err := io.Copy(io.Discard, c)
		var ne net.Error
		if !errors.As(err, &ne) || !ne.Timeout() {
			c.closedAt <- time.Now()
		}
	}()
	go func() {
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			case <-time.After(period):
			}
			if _, err := fmt.Fprintf(c, "X-Slow-%d: x\r\n", i); err != nil {
				return
			}
		}
	}()
}

// TestSlowlorisCannotExhaustServer opens many connections that send their
// headers a line at a time and never finish: the server keeps answering a
// normal client, and closes every slow connection once its header timeout
// passes.
func TestSlowlorisCannotExhaustServer(t *testing.T) {
	const headerTimeout = 500 * time.Millisecond
	h, _ := newHarness(t, openai.Config{ReadHeaderTimeout: headerTimeout}, fakegen.Config{})
	const n = 200
	stop := make(chan struct{})
	defer close(stop)
	conns := make([]*slowConn, n)
	start := time.Now()
	for i := range conns {
		conns[i] = dialSlow(t, h, "POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
		conns[i].trickle(50*time.Millisecond, stop)
	}
	checkServes(t, h) // while all of them are open and still sending
	for i, c := range conns {
		select {
		case at := <-c.closedAt:
			if d := at.Sub(start); d < headerTimeout {
				t.Fatalf("slow connection %d closed after %v, before the header timeout", i, d)
			}
		case <-time.After(25 * time.Second):
			t.Fatalf("slow connection %d still open %v after it started sending headers", i, time.Since(start))
		}
	}
	checkServes(t, h)
}

// TestSlowBodyGets408 sends complete headers and then only part of the body:
// the client gets a 408 with the OpenAI error once BodyReadTimeout passes,
// and the connection is closed.
func TestSlowBodyGets408(t *testing.T) {
	h, _ := newHarness(t, openai.Config{BodyReadTimeout: 300 * time.Millisecond}, fakegen.Config{})
	c := dialSlow(t, h, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\":")
	_ = c.SetReadDeadline(time.Now().Add(20 * time.Second))
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatalf("no response to a stalled body: %v", err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	e := readErrorJSON(t, b)
	if resp.StatusCode != http.StatusRequestTimeout || e["code"] != "request_timeout" {
		t.Fatalf("%d %q", resp.StatusCode, b)
	}
	if _, err := br.ReadByte(); !errors.Is(err, io.EOF) {
		t.Fatalf("connection not closed after the 408: %v", err)
	}
	checkServes(t, h)
}

// TestIdleConnectionClosed: a keep-alive connection left idle after a
// request is closed by the server once IdleTimeout passes.
func TestIdleConnectionClosed(t *testing.T) {
	h, _ := newHarness(t, openai.Config{IdleTimeout: 300 * time.Millisecond}, fakegen.Config{})
	// The server's idle clock starts once it has written the response, after
	// the request went out and before this test reads the response.
	sent := time.Now()
	c := dialSlow(t, h, fmt.Sprintf("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(okBody), okBody))
	_ = c.SetReadDeadline(time.Now().Add(20 * time.Second))
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || resp.Close {
		t.Fatalf("status %d, close %v: want a kept-alive 200", resp.StatusCode, resp.Close)
	}
	if _, err := br.ReadByte(); !errors.Is(err, io.EOF) {
		t.Fatalf("idle connection not closed by the server: %v", err)
	}
	if d := time.Since(sent); d < 300*time.Millisecond {
		t.Fatalf("closed %v after the request was sent, before the idle timeout", d)
	}
}

// TestConnectionBound: with MaxConnections open (silent) connections, the
// server holds no more than that at once; a normal client is served once the
// header timeout frees a slot.
func TestConnectionBound(t *testing.T) {
	const limit = 4
	// Counted as the bounded listener hands connections out and before they
	// are closed: inside the span the bound holds each one. (http.Server's
	// ConnState hooks run after a close has freed the slot, so they would see
	// a new connection before the old one's end.)
	cl := &countingListener{}
	wrap := func(l net.Listener) net.Listener { cl.Listener = l; return cl }
	h, _ := newHarnessWrapped(t, openai.Config{MaxConnections: limit, ReadHeaderTimeout: 300 * time.Millisecond}, fakegen.Config{}, wrap)
	for range 2 * limit {
		dialSlow(t, h, "")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	resp := h.do(ctx, http.MethodPost, "/v1/completions", okBody)
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	if p := cl.peak.Load(); p > limit || p == 0 {
		t.Fatalf("%d connections open at once, limit %d", p, limit)
	}
}

type countingListener struct {
	net.Listener
	mu         sync.Mutex
	open, peak atomic.Int64
}

func (l *countingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	l.mu.Lock()
	if n := l.open.Add(1); n > l.peak.Load() {
		l.peak.Store(n)
	}
	l.mu.Unlock()
	return &countedConn{Conn: c, l: l}, nil
}

type countedConn struct {
	net.Conn
	l    *countingListener
	once sync.Once
}

func (c *countedConn) Close() error {
	c.once.Do(func() { c.l.open.Add(-1) })
	return c.Conn.Close()
}

// TestOversizeContentLengthNotRead: a declared body over the limit is refused
// before any of it is read, so a client cannot make the server read it.
func TestOversizeContentLengthNotRead(t *testing.T) {
	h, _ := newHarness(t, openai.Config{MaxBodyBytes: 1024}, fakegen.Config{})
	c := dialSlow(t, h, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1073741824\r\n\r\n")
	_ = c.SetReadDeadline(time.Now().Add(20 * time.Second))
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if e := readErrorJSON(t, b); resp.StatusCode != 413 || e["code"] != "request_too_large" || !resp.Close {
		t.Fatalf("%d close=%v %q", resp.StatusCode, resp.Close, b)
	}
}
