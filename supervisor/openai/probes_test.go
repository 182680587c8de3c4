package openai_test

import (
	"context"
	"errors"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/frmps/frmps/supervisor/openai"
	"github.com/frmps/frmps/supervisor/openai/fakegen"
)

func (h *harness) status(path string) (int, string) {
	h.t.Helper()
	resp := h.do(context.Background(), http.MethodGet, path, "")
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		h.t.Fatal(err)
	}
	return resp.StatusCode, string(b)
}

// Liveness follows the backend's loop, readiness whether an engine serves:
// the two differ when the engines are down (alive, not ready), when the loop
// is wedged (ready by the last engine state, not alive) and while draining.
func TestLivenessAndReadinessAreDistinct(t *testing.T) {
	h, _ := newHarness(t, openai.Config{APIKey: "sekret"}, fakegen.Config{})
	check := func(what string, live, ready int) {
		t.Helper()
		if got, body := h.status("/livez"); got != live {
			t.Errorf("%s: /livez %d %s, want %d", what, got, body, live)
		}
		if got, body := h.status("/readyz"); got != ready {
			t.Errorf("%s: /readyz %d %s, want %d", what, got, body, ready)
		}
		if got, _ := h.status("/health"); got != ready {
			t.Errorf("%s: /health %d, want %d like /readyz", what, got, ready)
		}
	}
	check("serving", 200, 200) // probes need no API key
	h.backend.SetUnavailable(true)
	check("no engine", 200, 503)
	h.backend.SetUnavailable(false)
	h.backend.SetAliveErr(errors.New("event loop did not answer"))
	check("loop wedged", 503, 200)
	if _, body := h.status("/livez"); !strings.Contains(body, "event loop did not answer") {
		t.Errorf("/livez body %q does not say why", body)
	}
	h.backend.SetAliveErr(nil)

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := h.fd.Shutdown(ctx); err != nil {
		t.Fatal(err)
	}
	check("draining", 200, 503)
}

// The context limit is read per request: one learned after the front door
// was built shows in /v1/models and bounds max_tokens.
func TestModelLimitReadLive(t *testing.T) {
	h, _ := newHarness(t, openai.Config{}, fakegen.Config{MaxModelLen: 64})
	h.backend.SetMaxModelLen(0)
	m := readJSON(t, h.do(context.Background(), http.MethodGet, "/v1/models", ""))
	if _, ok := m["data"].([]any)[0].(map[string]any)["max_model_len"]; ok {
		t.Errorf("unknown limit reported: %v", m)
	}
	resp := h.post("/v1/completions", `{"model":"test-model","prompt":"x","max_tokens":40}`)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("limit unknown: status %d", resp.StatusCode)
	}

	h.backend.SetMaxModelLen(32)
	m = readJSON(t, h.do(context.Background(), http.MethodGet, "/v1/models", ""))
	if got := m["data"].([]any)[0].(map[string]any)["max_model_len"]; got != float64(32) {
		t.Errorf("max_model_len %v, want 32", got)
	}
	checkError(t, h.post("/v1/completions", `{"model":"test-model","prompt":"x","max_tokens":40}`), 400, "max_tokens", "context_length_exceeded")
}
