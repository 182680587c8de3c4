package openai_test

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/frmps/frmps/supervisor/openai"
	"github.com/frmps/frmps/supervisor/openai/fakegen"
)

func TestChatNonStreamingShape(t *testing.T) {
	h, eng := newHarness(t, openai.Config{}, fakegen.Config{})
	resp := h.post("/v1/chat/completions", `{"model":"test-model","messages":[{"role":"system","content":"be brief"},{"role":"user","content":[{"type":"text","text":"hello there"}]}],"max_tokens":5,"temperature":0,"seed":3,"user":"u1","unknown_field":{"x":1}}`,
		"X-Request-Id", "req-abc")
	if resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	if got := resp.Header.Get("X-Request-Id"); got != "req-abc" {
		t.Errorf("x-request-id %q, want echoed req-abc", got)
	}
	if ct := resp.Header.Get("Content-Type"); ct != "application/json" {
		t.Errorf("content-type %q", ct)
	}
	m := readJSON(t, resp)
	if k := keys(m); k != "choices,created,id,model,object,usage" {
		t.Fatalf("top-level keys %s", k)
	}
	if id := m["id"].(string); !strings.HasPrefix(id, "chatcmpl-") {
		t.Errorf("id %q", id)
	}
	if m["object"] != "chat.completion" || m["model"] != "test-model" {
		t.Errorf("object/model %v %v", m["object"], m["model"])
	}
	if _, ok := m["created"].(float64); !ok {
		t.Errorf("created %v", m["created"])
	}
	reqs := eng.Requests()
	if len(reqs) != 1 {
		t.Fatalf("engine got %d requests", len(reqs))
	}
	g := reqs[0]
	if g.GetRequestId() != "req-abc" || g.GetKey() == 0 || !g.GetAddGenerationPrompt() {
		t.Errorf("generate request id=%q key=%d agp=%v", g.GetRequestId(), g.GetKey(), g.GetAddGenerationPrompt())
	}
	msgs := g.GetMessages().GetMessages()
	if len(msgs) != 2 || msgs[1].GetContent() != "hello there" || msgs[0].GetRole() != "system" {
		t.Errorf("messages %v", msgs)
	}
	p := g.GetParams()
	if p.GetMaxTokens() != 5 || p.GetTemperature() != 0 || p.GetSeed() != 3 || p.GetTopP() != 1 {
		t.Errorf("params %v", p)
	}
	ids, text, finish := fakegen.Expected(h.ecfg, g)
	choices := m["choices"].([]any)
	if len(choices) != 1 {
		t.Fatalf("choices %v", choices)
	}
	c := choices[0].(map[string]any)
	if k := keys(c); k != "finish_reason,index,logprobs,message" {
		t.Errorf("choice keys %s", k)
	}
	if c["index"] != 0.0 || c["logprobs"] != nil || c["finish_reason"] != finish || finish != "length" {
		t.Errorf("choice %v (want finish %s)", c, finish)
	}
	msg := c["message"].(map[string]any)
	if msg["role"] != "assistant" || msg["content"] != text {
		t.Errorf("message %v, want content %q", msg, text)
	}
	u := m["usage"].(map[string]any)
	// The fake counts 3 tokens of chat overhead per message plus words.
	if u["prompt_tokens"] != 10.0 || u["completion_tokens"] != float64(len(ids)) || u["total_tokens"] != float64(10+len(ids)) {
		t.Errorf("usage %v", u)
	}
}

func TestCompletionsNonStreamingPromptForms(t *testing.T) {
	h, eng := newHarness(t, openai.Config{}, fakegen.Config{OutputLen: 4})
	for i, prompt := range []string{`"one two three"`, `["one two three"]`, `[5,6,7]`, `[[5,6,7]]`} {
		resp := h.post("/v1/completions", `{"model":"test-model","prompt":`+prompt+`,"stop":["x","y"],"top_k":-1,"top_p":0.5}`)
		if resp.StatusCode != 200 {
			b, _ := io.ReadAll(resp.Body)
			t.Fatalf("%s: status %d %s", prompt, resp.StatusCode, b)
		}
		m := readJSON(t, resp)
		g := eng.Requests()[i]
		_, text, finish := fakegen.Expected(h.ecfg, g)
		if !strings.HasPrefix(m["id"].(string), "cmpl-") || m["object"] != "text_completion" {
			t.Errorf("id/object %v %v", m["id"], m["object"])
		}
		c := m["choices"].([]any)[0].(map[string]any)
		if k := keys(c); k != "finish_reason,index,logprobs,text" {
			t.Errorf("choice keys %s", k)
		}
		if c["text"] != text || c["finish_reason"] != finish || finish != "stop" {
			t.Errorf("%s: choice %v, want %q/%s", prompt, c, text, finish)
		}
		if got := m["usage"].(map[string]any)["prompt_tokens"]; got != 3.0 {
			t.Errorf("%s: prompt_tokens %v", prompt, got)
		}
		p := g.GetParams()
		if len(p.GetStop()) != 2 || p.GetTopK() != 0 || p.GetTopP() != 0.5 || p.Seed == nil {
			t.Errorf("%s: params %v (a seed is always fixed by the front door)", prompt, p)
		}
		if strings.HasPrefix(prompt, `"`) || strings.HasPrefix(prompt, `["`) {
			if g.GetPrompt() != "one two three" {
				t.Errorf("prompt %q", g.GetPrompt())
			}
		} else if ids := g.GetPromptTokenIds().GetIds(); len(ids) != 3 || ids[0] != 5 {
			t.Errorf("prompt ids %v", ids)
		}
	}
}

func TestStreamingShapes(t *testing.T) {
	h, eng := newHarness(t, openai.Config{}, fakegen.Config{})
	cases := []struct {
		name, path, body string
		chat, usage      bool
	}{
		{"chat", "/v1/chat/completions", `{"model":"test-model","messages":[{"role":"user","content":"hi"}],"stream":true,"max_tokens":6}`, true, false},
		{"chat+usage", "/v1/chat/completions", `{"model":"test-model","messages":[{"role":"user","content":"hi"}],"stream":true,"max_completion_tokens":6,"stream_options":{"include_usage":true}}`, true, true},
		{"completions", "/v1/completions", `{"model":"test-model","prompt":"a b","stream":true,"max_tokens":6}`, false, false},
		{"completions+usage", "/v1/completions", `{"model":"test-model","prompt":"a b","stream":true,"max_tokens":6,"stream_options":{"include_usage":true}}`, false, true},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			resp := h.post(tc.path, tc.body)
			defer resp.Body.Close()
			if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "text/event-stream" {
				t.Fatalf("status %d content-type %q", resp.StatusCode, resp.Header.Get("Content-Type"))
			}
			s := readStream(t, resp.Body, nil)
			if !s.done {
				t.Fatal("no [DONE]")
			}
			g := eng.Requests()[i]
			ids, text, _ := fakegen.Expected(h.ecfg, g)
			if s.text() != text {
				t.Errorf("text %q, want %q", s.text(), text)
			}
			id, created := s.events[0]["id"], s.events[0]["created"]
			object := "text_completion"
			prefix := "cmpl-"
			if tc.chat {
				object, prefix = "chat.completion.chunk", "chatcmpl-"
			}
			if !strings.HasPrefix(id.(string), prefix) {
				t.Errorf("id %v", id)
			}
			var finishes []string
			for k, ev := range s.events {
				if ev["id"] != id || ev["created"] != created || ev["object"] != object || ev["model"] != "test-model" {
					t.Errorf("event %d head differs: %v", k, ev)
				}
				want := "choices,created,id,model,object"
				if tc.usage {
					want = "choices,created,id,model,object,usage"
				}
				if keys(ev) != want {
					t.Errorf("event %d keys %s want %s", k, keys(ev), want)
				}
				for _, c := range ev["choices"].([]any) {
					cm := c.(map[string]any)
					if cm["index"] != 0.0 || cm["logprobs"] != nil {
						t.Errorf("choice %v", cm)
					}
					if f, ok := cm["finish_reason"].(string); ok {
						finishes = append(finishes, f)
					}
				}
			}
			if len(finishes) != 1 || finishes[0] != "length" {
				t.Errorf("finish reasons %v", finishes)
			}
			if tc.chat {
				d := s.events[0]["choices"].([]any)[0].(map[string]any)["delta"].(map[string]any)
				if d["role"] != "assistant" {
					t.Errorf("first chat delta %v", d)
				}
			}
			last := s.events[len(s.events)-1]
			if tc.usage {
				if len(last["choices"].([]any)) != 0 {
					t.Errorf("usage chunk has choices: %v", last)
				}
				u := last["usage"].(map[string]any)
				if u["completion_tokens"] != float64(len(ids)) || u["prompt_tokens"] == 0.0 {
					t.Errorf("usage %v", u)
				}
				for _, ev := range s.events[:len(s.events)-1] {
					if ev["usage"] != nil {
						t.Errorf("usage before the last chunk: %v", ev)
					}
				}
			}
		})
	}
}

type errCase struct {
	name, path, body string
	hdr              []string
	status           int
	param, code      any // nil = JSON null
}

func checkError(t *testing.T, resp *http.Response, status int, param, code any) map[string]any {
	t.Helper()
	if resp.StatusCode != status {
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		t.Fatalf("status %d, want %d: %s", resp.StatusCode, status, b)
	}
	m := readJSON(t, resp)
	if keys(m) != "error" {
		t.Fatalf("error body keys %s", keys(m))
	}
	e := m["error"].(map[string]any)
	if keys(e) != "code,message,param,type" {
		t.Fatalf("error keys %s", keys(e))
	}
	if msg, _ := e["message"].(string); msg == "" {
		t.Errorf("empty message")
	}
	if typ, _ := e["type"].(string); typ == "" {
		t.Errorf("empty type")
	}
	if e["param"] != param || e["code"] != code {
		t.Errorf("param %v code %v, want %v %v (message %q)", e["param"], e["code"], param, code, e["message"])
	}
	return e
}

func TestErrors(t *testing.T) {
	h, _ := newHarness(t, openai.Config{MaxBodyBytes: 4096}, fakegen.Config{MaxModelLen: 16})
	chat := "/v1/chat/completions"
	comp := "/v1/completions"
	long := strings.Repeat("w ", 20)
	cases := []errCase{
		{"bad json", chat, `{"model":`, nil, 400, nil, nil},
		{"empty body", chat, ``, nil, 400, nil, nil},
		{"not an object", chat, `[1,2]`, nil, 400, nil, nil},
		{"wrong type", chat, `{"model":"test-model","messages":[{"role":"user","content":"x"}],"max_tokens":"ten"}`, nil, 400, "max_tokens", nil},
		{"missing model", chat, `{"messages":[{"role":"user","content":"x"}]}`, nil, 400, "model", nil},
		{"unknown model", chat, `{"model":"gpt-9","messages":[{"role":"user","content":"x"}]}`, nil, 404, "model", "model_not_found"},
		{"missing messages", chat, `{"model":"test-model"}`, nil, 400, "messages", nil},
		{"bad role", chat, `{"model":"test-model","messages":[{"role":"wizard","content":"x"}]}`, nil, 400, "messages[0].role", nil},
		{"image part", chat, `{"model":"test-model","messages":[{"role":"user","content":[{"type":"image_url"}]}]}`, nil, 400, "messages[0].content", nil},
		{"n=0", chat, `{"model":"test-model","messages":[{"role":"user","content":"x"}],"n":0}`, nil, 400, "n", nil},
		{"n beyond MaxChoices", chat, `{"model":"test-model","messages":[{"role":"user","content":"x"}],"n":129}`, nil, 400, "n", nil},
		{"prompts × n beyond MaxChoices", comp, `{"model":"test-model","prompt":["a","b","c"],"n":43}`, nil, 400, "n", nil},
		{"temperature", chat, `{"model":"test-model","messages":[{"role":"user","content":"x"}],"temperature":3}`, nil, 400, "temperature", nil},
		{"max_tokens 0", comp, `{"model":"test-model","prompt":"x","max_tokens":0}`, nil, 400, "max_tokens", nil},
		{"max_tokens beyond context", comp, `{"model":"test-model","prompt":"x","max_tokens":16}`, nil, 400, "max_tokens", "context_length_exceeded"},
		{"missing prompt", comp, `{"model":"test-model"}`, nil, 400, "prompt", nil},
		{"batch of strings and ids", comp, `{"model":"test-model","prompt":["a",[1,2]]}`, nil, 400, "prompt[1]", nil},
		{"batch with an empty prompt", comp, `{"model":"test-model","prompt":["a",""]}`, nil, 400, "prompt[1]", nil},
		{"batch with a bad token id", comp, `{"model":"test-model","prompt":[[1],[2,-1]]}`, nil, 400, "prompt", nil},
		{"bad token id", comp, `{"model":"test-model","prompt":[1,-2]}`, nil, 400, "prompt", nil},
		{"token prompt too long", comp, `{"model":"test-model","prompt":[` + strings.Repeat("1,", 16) + `1]}`, nil, 400, "prompt", "context_length_exceeded"},
		{"string prompt too long (engine-counted)", comp, `{"model":"test-model","prompt":"` + long + `","stream":true}`, nil, 400, "prompt", "context_length_exceeded"},
		{"prompt + max_tokens too long", comp, `{"model":"test-model","prompt":"a b c d e f g h i j","max_tokens":10}`, nil, 400, "max_tokens", "context_length_exceeded"},
		{"stream_options without stream", comp, `{"model":"test-model","prompt":"x","stream_options":{"include_usage":true}}`, nil, 400, "stream_options", nil},
		{"body too large", comp, `{"model":"test-model","prompt":"` + strings.Repeat("x", 5000) + `"}`, nil, 413, nil, "request_too_large"},
		{"unknown path", "/v1/embeddings", `{}`, nil, 404, nil, nil},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			checkError(t, h.post(tc.path, tc.body, tc.hdr...), tc.status, tc.param, tc.code)
		})
	}
	t.Run("GET completions", func(t *testing.T) {
		resp := h.do(context.Background(), http.MethodGet, comp, "")
		checkError(t, resp, 405, nil, nil)
	})
	if n := metricValue(t, h.reg, "frmps_requests_total", map[string]string{"endpoint": "chat_completions", "code": "400"}); n < 8 {
		t.Errorf("requests_total{chat,400} = %v", n)
	}
}

func TestEngineRejectsPrompt(t *testing.T) {
	h, _ := newHarness(t, openai.Config{}, fakegen.Config{MaxModelLen: 8, RejectLongPrompts: true})
	e := checkError(t, h.post("/v1/completions", `{"model":"test-model","prompt":"a b c d e f g h i"}`), 400, nil, nil)
	if !strings.Contains(e["message"].(string), "context holds 8") {
		t.Errorf("engine's reason not passed on: %v", e["message"])
	}
}

func TestAPIKey(t *testing.T) {
	h, _ := newHarness(t, openai.Config{APIKey: "sekret"}, fakegen.Config{})
	body := `{"model":"test-model","prompt":"x"}`
	for _, hdr := range [][]string{nil, {"Authorization", "Bearer wrong"}, {"Authorization", "sekret"}, {"Authorization", "Bearer sekret2"}} {
		resp := h.post("/v1/completions", body, hdr...)
		checkError(t, resp, 401, nil, "invalid_api_key")
	}
	if resp := h.post("/v1/completions", body, "Authorization", "Bearer sekret"); resp.StatusCode != 200 {
		t.Fatalf("good key: status %d", resp.StatusCode)
	} else {
		resp.Body.Close()
	}
	// Health and metrics stay open for probes.
	for _, p := range []string{"/health", "/metrics", "/version"} {
		resp := h.do(context.Background(), http.MethodGet, p, "")
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Errorf("%s: %d", p, resp.StatusCode)
		}
	}
	resp := h.do(context.Background(), http.MethodGet, "/v1/models", "")
	checkError(t, resp, 401, nil, "invalid_api_key")
}

func TestLoadAPIKey(t *testing.T) {
	dir := t.TempDir()
	f := dir + "/key"
	if err := writeFile(f, "  k1\n"); err != nil {
		t.Fatal(err)
	}
	if k, err := openai.LoadAPIKey(f, ""); err != nil || k != "k1" {
		t.Errorf("file: %q %v", k, err)
	}
	t.Setenv("FRMPS_TEST_KEY", "k2")
	if k, err := openai.LoadAPIKey("", "FRMPS_TEST_KEY"); err != nil || k != "k2" {
		t.Errorf("env: %q %v", k, err)
	}
	if _, err := openai.LoadAPIKey(dir+"/missing", ""); err == nil {
		t.Error("missing file accepted")
	}
	_ = writeFile(f, "\n")
	if _, err := openai.LoadAPIKey(f, ""); err == nil {
		t.Error("empty key file accepted")
	}
	if k, err := openai.LoadAPIKey("", ""); err != nil || k != "" {
		t.Errorf("none: %q %v", k, err)
	}
}

func TestUnavailableBeforeHeaders(t *testing.T) {
	h, _ := newHarness(t, openai.Config{}, fakegen.Config{})
	h.backend.SetUnavailable(true)
	for _, stream := range []string{"false", "true"} {
		resp := h.post("/v1/completions", `{"model":"test-model","prompt":"x","stream":`+stream+`}`)
		if resp.Header.Get("Retry-After") == "" || resp.Header.Get("X-Should-Retry") != "true" {
			t.Errorf("stream=%s: headers %v", stream, resp.Header)
		}
		checkError(t, resp, 503, nil, "engine_unavailable")
	}
	resp := h.do(context.Background(), http.MethodGet, "/health", "")
	resp.Body.Close()
	if resp.StatusCode != 503 {
		t.Errorf("/health %d while unavailable", resp.StatusCode)
	}
	h.backend.SetUnavailable(false)
	resp = h.do(context.Background(), http.MethodGet, "/health", "")
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Errorf("/health %d while serving", resp.StatusCode)
	}
}

// The series the dashboard and the alert rules read are on /metrics before
// any request, at zero, for every label value known in advance.
func TestMetricsBeforeAnyRequest(t *testing.T) {
	h, _ := newHarness(t, openai.Config{}, fakegen.Config{})
	resp := h.do(context.Background(), http.MethodGet, "/metrics", "")
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, want := range []string{
		`frmps_requests_total{code="200",endpoint="chat_completions",model_name="test-model"} 0`,
		`frmps_requests_total{code="200",endpoint="completions",model_name="test-model"} 0`,
		`frmps_request_duration_seconds_count{endpoint="chat_completions",model_name="test-model"} 0`,
		`frmps_request_duration_seconds_count{endpoint="completions",model_name="test-model"} 0`,
		`frmps_stream_resumes_total{model_name="test-model",outcome="ok"} 0`,
		`frmps_stream_resumes_total{model_name="test-model",outcome="failed"} 0`,
		`frmps_stream_resume_phase_seconds_count{model_name="test-model",phase="first_token"} 0`,
		`frmps_time_to_first_token_seconds_count{model_name="test-model"} 0`,
		`frmps_tokens_generated_total{model_name="test-model"} 0`,
	} {
		if !strings.Contains(string(b), want) {
			t.Errorf("metrics lack %q", want)
		}
	}
}

func TestModelsVersionMetrics(t *testing.T) {
	h, _ := newHarness(t, openai.Config{Version: "1.2.3"}, fakegen.Config{})
	m := readJSON(t, h.do(context.Background(), http.MethodGet, "/v1/models", ""))
	data := m["data"].([]any)
	if m["object"] != "list" || len(data) != 1 || data[0].(map[string]any)["id"] != "test-model" || data[0].(map[string]any)["object"] != "model" {
		t.Errorf("models %v", m)
	}
	v := readJSON(t, h.do(context.Background(), http.MethodGet, "/version", ""))
	if v["version"] != "1.2.3" {
		t.Errorf("version %v", v)
	}
	resp := h.post("/v1/completions", `{"model":"test-model","prompt":"x","max_tokens":3}`)
	resp.Body.Close()
	resp = h.do(context.Background(), http.MethodGet, "/metrics", "")
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, want := range []string{
		`frmps_requests_total{code="200",endpoint="completions",model_name="test-model"} 1`,
		`frmps_tokens_generated_total{model_name="test-model"} 3`,
		`frmps_inflight_requests{model_name="test-model"} 0`,
		`frmps_time_to_first_token_seconds_count{model_name="test-model"} 1`,
		`frmps_request_duration_seconds_count{endpoint="completions",model_name="test-model"} 1`,
	} {
		if !strings.Contains(string(b), want) {
			t.Errorf("metrics lack %q", want)
		}
	}
}

func writeFile(path, s string) error {
	return osWriteFile(path, []byte(s))
}

func TestRequestIDGenerated(t *testing.T) {
	h, eng := newHarness(t, openai.Config{}, fakegen.Config{})
	for _, hdr := range [][]string{nil, {"X-Request-Id", "bad id with spaces"}} {
		resp := h.post("/v1/completions", `{"model":"test-model","prompt":"x","max_tokens":2}`, hdr...)
		resp.Body.Close()
		rid := resp.Header.Get("X-Request-Id")
		if len(rid) != 32 || strings.Contains(rid, " ") {
			t.Errorf("generated x-request-id %q", rid)
		}
		reqs := eng.Requests()
		if got := reqs[len(reqs)-1].GetRequestId(); got != rid {
			t.Errorf("engine request_id %q, header %q", got, rid)
		}
	}
}

func TestHealthDuringFailoverGap(t *testing.T) {
	h, _ := newHarness(t, openai.Config{HealthTimeout: 10 * time.Millisecond}, fakegen.Config{})
	h.backend.Clear() // a failover in progress: Current blocks
	resp := h.do(context.Background(), http.MethodGet, "/health", "")
	resp.Body.Close()
	if resp.StatusCode != 503 || resp.Header.Get("Retry-After") == "" {
		t.Errorf("/health during a gap: %d %v", resp.StatusCode, resp.Header)
	}
}

func TestEngineAbortIsNotSuccess(t *testing.T) {
	h, _ := newHarness(t, openai.Config{}, fakegen.Config{AbortAt: 3})
	resp := h.post("/v1/completions", `{"model":"test-model","prompt":"x","stream":true,"max_tokens":10}`)
	s := readStream(t, resp.Body, nil)
	resp.Body.Close()
	lastIsError(t, s, "aborted")
	checkError(t, h.post("/v1/completions", `{"model":"test-model","prompt":"x","max_tokens":10}`), 503, nil, "aborted")
}

// readyBackend adds openai.ReadinessReporter to the fake backend.
type readyBackend struct {
	*fakegen.Backend
	ready bool
}

func (b readyBackend) Serving() bool { return b.ready }

func TestHealthUsesReadinessReporter(t *testing.T) {
	for _, ready := range []bool{true, false} {
		fb := fakegen.NewBackend(openai.ModelInfo{Name: "m"})
		fb.SetUnavailable(ready) // Current would say the opposite: /health must not ask it
		fd, err := openai.New(openai.Config{}, readyBackend{fb, ready}, nil, prometheus.NewRegistry())
		if err != nil {
			t.Fatal(err)
		}
		rec := httptest.NewRecorder()
		fd.Handler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/health", nil))
		if want := map[bool]int{true: 200, false: 503}[ready]; rec.Code != want {
			t.Errorf("ready=%v: /health %d", ready, rec.Code)
		}
		if err := fd.Shutdown(context.Background()); err != nil {
			t.Error(err)
		}
	}
}

// TestReturnTokenIDs: vLLM's return_token_ids extension carries every
// generated token id, streamed per chunk and whole in a JSON body.
func TestReturnTokenIDs(t *testing.T) {
	h, eng := newHarness(t, openai.Config{}, fakegen.Config{OutputLen: 6})
	toIDs := func(v any) []uint32 {
		var out []uint32
		for _, x := range v.([]any) {
			out = append(out, uint32(x.(float64)))
		}
		return out
	}
	resp := h.post("/v1/completions", `{"model":"test-model","prompt":"a b","return_token_ids":true}`)
	m := readJSON(t, resp)
	want, _, _ := fakegen.Expected(h.ecfg, eng.Requests()[0])
	c := m["choices"].([]any)[0].(map[string]any)
	if got := toIDs(c["token_ids"]); !slices.Equal(got, want) {
		t.Fatalf("token_ids %v, want %v", got, want)
	}

	resp = h.post("/v1/chat/completions", `{"model":"test-model","messages":[{"role":"user","content":"hi"}],"stream":true,"return_token_ids":true}`)
	defer resp.Body.Close()
	s := readStream(t, resp.Body, nil)
	want, _, _ = fakegen.Expected(h.ecfg, eng.Requests()[1])
	var got []uint32
	for _, ev := range s.events {
		for _, ch := range ev["choices"].([]any) {
			if ids, ok := ch.(map[string]any)["token_ids"]; ok {
				got = append(got, toIDs(ids)...)
			}
		}
	}
	if !s.done || !slices.Equal(got, want) {
		t.Fatalf("streamed token_ids %v (done %v), want %v", got, s.done, want)
	}

	// Without the flag the choices keep OpenAI's exact keys.
	m = readJSON(t, h.post("/v1/completions", `{"model":"test-model","prompt":"a b"}`))
	if _, ok := m["choices"].([]any)[0].(map[string]any)["token_ids"]; ok {
		t.Fatal("token_ids present without return_token_ids")
	}
}

// TestStreamingChunkPerTokenMessage: as vLLM's server, one chunk for each engine
// message that carries tokens, also when the detokeniser held its text back
// (the chunk's text is then empty); the text is whole at the end.
func TestStreamingChunkPerTokenMessage(t *testing.T) {
	h, eng := newHarness(t, openai.Config{}, fakegen.Config{HoldText: true})
	for i, tc := range []struct{ path, body, field string }{
		{"/v1/completions", `{"model":"test-model","prompt":"a b","stream":true,"max_tokens":6}`, "text"},
		{"/v1/chat/completions", `{"model":"test-model","messages":[{"role":"user","content":"hi"}],"stream":true,"max_tokens":6}`, "content"},
	} {
		resp := h.post(tc.path, tc.body)
		s := readStream(t, resp.Body, nil)
		resp.Body.Close()
		_, text, _ := fakegen.Expected(h.ecfg, eng.Requests()[i])
		if s.text() != text {
			t.Errorf("%s: text %q, want %q", tc.path, s.text(), text)
		}
		empty, withText := 0, 0
		for _, ev := range s.events {
			for _, c := range ev["choices"].([]any) {
				cm := c.(map[string]any)
				v, ok := cm[tc.field].(string)
				if d, isChat := cm["delta"].(map[string]any); isChat {
					if _, role := d["role"]; role {
						continue // the role's opening chunk, before any token
					}
					v, ok = d[tc.field].(string)
				}
				switch {
				case ok && v == "" && cm["finish_reason"] == nil:
					empty++
				case ok && v != "":
					withText++
				}
			}
		}
		// 6 tokens, one per message: 3 held back (empty), 3 carrying text.
		if empty != 3 || withText != 3 {
			t.Errorf("%s: %d empty and %d non-empty token chunks, want 3 and 3: %v", tc.path, empty, withText, s.raw)
		}
	}
}

// GET /v1/models answers 503 until an engine has served (scripts wait for a
// server with it), then 200 for good: a later failover is a pause, not a
// server that went away.
func TestModelsWaitsForTheFirstEngine(t *testing.T) {
	fb := fakegen.NewBackend(openai.ModelInfo{Name: "m"})
	rb := &flipBackend{Backend: fb}
	fd, err := openai.New(openai.Config{}, rb, nil, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	get := func() int {
		rec := httptest.NewRecorder()
		fd.Handler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/v1/models", nil))
		return rec.Code
	}
	if c := get(); c != 503 {
		t.Fatalf("before any engine served: %d, want 503", c)
	}
	rb.ready.Store(true)
	if c := get(); c != 200 {
		t.Fatalf("engine serving: %d, want 200", c)
	}
	rb.ready.Store(false) // a failover
	if c := get(); c != 200 {
		t.Fatalf("during a later failover: %d, want 200", c)
	}
}

// flipBackend is a ReadinessReporter whose answer the test changes.
type flipBackend struct {
	*fakegen.Backend
	ready atomic.Bool
}

func (b *flipBackend) Serving() bool { return b.ready.Load() }
