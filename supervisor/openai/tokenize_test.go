package openai_test

import (
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/frmps/frmps/supervisor/openai"
	"github.com/frmps/frmps/supervisor/openai/fakegen"
)

// /tokenize and /detokenize answer with the current engine's tokenizer, in
// vLLM's shapes.
func TestTokenizerRoutes(t *testing.T) {
	h, _ := newHarness(t, openai.Config{APIKey: "k", EngineWaitTimeout: 200 * time.Millisecond}, fakegen.Config{})
	auth := []string{"Authorization", "Bearer k"}
	b := readJSON(t, h.post("/tokenize", `{"model":"test-model","prompt":"the quick fox"}`, auth...))
	toks, _ := b["tokens"].([]any)
	if b["count"] != 3.0 || len(toks) != 3 || b["max_model_len"] != 64.0 {
		t.Errorf("tokenize prompt: %v", b)
	}
	// The chat template's tokens (the fake's: three per role) come with the text's.
	b = readJSON(t, h.post("/tokenize", `{"model":"test-model","messages":[{"role":"user","content":"the quick fox"}]}`, auth...))
	if b["count"] != 6.0 {
		t.Errorf("tokenize messages: %v", b)
	}
	b = readJSON(t, h.post("/detokenize", `{"model":"test-model","tokens":[7,11]}`, auth...))
	if b["prompt"] != fakegen.TokenText(7)+fakegen.TokenText(11) {
		t.Errorf("detokenize: %v", b)
	}
	for _, tc := range []struct {
		path, body string
		hdr        []string
		status     int
		param      any
		code       any
	}{
		{"/tokenize", `{"model":"test-model","prompt":"x"}`, nil, 401, nil, "invalid_api_key"},
		{"/detokenize", `{"model":"test-model","tokens":[1]}`, []string{"Authorization", "Bearer no"}, 401, nil, "invalid_api_key"},
		{"/tokenize", `{"prompt":"x"}`, auth, 400, "model", nil},
		{"/tokenize", `{"model":"other","prompt":"x"}`, auth, 404, "model", "model_not_found"},
		{"/tokenize", `{"model":"test-model"}`, auth, 400, "prompt", nil},
		{"/tokenize", `{"model":"test-model","prompt":[1,2]}`, auth, 400, "prompt", nil},
		{"/tokenize", `{"model":"test-model","messages":[{"role":"wizard","content":"x"}]}`, auth, 400, "messages[0].role", nil},
		{"/detokenize", `{"model":"test-model","tokens":[1,-1]}`, auth, 400, "tokens", nil},
		{"/detokenize", `{"model":"test-model","tokens":"x"}`, auth, 400, "tokens", nil},
	} {
		checkError(t, h.post(tc.path, tc.body, tc.hdr...), tc.status, tc.param, tc.code)
	}
	checkError(t, h.do(context.Background(), http.MethodGet, "/tokenize", "", auth...), 405, nil, nil)
	h.backend.Clear()
	checkError(t, h.post("/tokenize", `{"model":"test-model","prompt":"x"}`, auth...), 503, nil, "engine_unavailable")
	if n := metricValue(t, h.reg, "frmps_requests_total", map[string]string{"endpoint": "tokenize", "code": "200"}); n != 2 {
		t.Errorf("requests_total{tokenize,200} = %v", n)
	}
}

// echo of a prompt given as token ids: the engine's text of those ids first,
// alone and in a batch with n.
func TestEchoOfTokenIDs(t *testing.T) {
	ecfg := fakegen.Config{}
	h, _ := newHarness(t, openai.Config{}, ecfg)
	prefix := fakegen.TokenText(5) + fakegen.TokenText(6)
	texts, _ := choicesOf(t, readJSON(t, h.post("/v1/completions", `{"model":"test-model","prompt":[5,6],"echo":true,"max_tokens":2}`)))
	if !strings.HasPrefix(texts[0], prefix) || len(strings.Fields(texts[0])) != 4 {
		t.Errorf("echo of [5,6]: %q", texts[0])
	}
	resp := h.post("/v1/completions", `{"model":"test-model","prompt":[[5,6],[7]],"n":2,"echo":true,"max_tokens":2,"stream":true}`)
	s := readStream(t, resp.Body, nil)
	resp.Body.Close()
	got, _, _ := streamChoices(t, s)
	for i, want := range []string{prefix, prefix, fakegen.TokenText(7), fakegen.TokenText(7)} {
		if !strings.HasPrefix(got[i], want) || len(strings.Fields(got[i])) != len(strings.Fields(want))+2 {
			t.Errorf("choice %d: %q, want %q then 2 tokens", i, got[i], want)
		}
	}
}
