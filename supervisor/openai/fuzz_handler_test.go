package openai_test

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/frmps/frmps/supervisor/openai"
	"github.com/frmps/frmps/supervisor/openai/fakegen"
)

// FuzzRequest drives the whole request path of /v1/chat/completions,
// /v1/completions and /v1/responses (method, body limit and read, JSON parsing and validation,
// Idempotency-Key, x-request-id) with arbitrary bodies and headers. No engine
// can serve, so an accepted request ends in 503; every answer must be an
// OpenAI-shaped JSON error a client can parse, never a panic.
func FuzzRequest(f *testing.F) {
	const maxBody = 4096
	for _, s := range []string{
		`{"model":"test-model","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true}}`,
		`{"model":"test-model","prompt":[[1,2,3]],"max_tokens":5,"stop":["a","b"],"seed":-3}`,
		`{"model":"test-model","prompt":["a"],"temperature":0.5,"top_p":1,"top_k":-1,"n":1}`,
		`{"model":"test-model","messages":[{"role":"user","content":[{"type":"text","text":"x"}]}],"logprobs":false}`,
		`{"model":"test-model","prompt":"x","max_completion_tokens":1e3}`,
		`{"model":"test-model","prompt":"x","max_tokens":63,"stream":false,"return_token_ids":true}`,
		`{"model":"other","prompt":"x"}`,
		`{`, `null`, `[]`, `{"model":null}`, `{"model":"test-model","prompt":[[[[1]]]]}`, "",
		`{"model":"test-model","prompt":"` + strings.Repeat("x", maxBody) + `"}`,
		`{"model":"test-model","prompt":"x"} {"model":"test-model"}`,
		"{\"model\":\"test-model\",\"prompt\":\"\xff\xfe\u2028\"}",
		`{"model":"test-model","input":"hi","instructions":"be brief","max_output_tokens":5,"stream":true}`,
		`{"model":"test-model","input":[{"role":"user","content":[{"type":"input_text","text":"x"}]}],"text":{"format":{"type":"json_object"}}}`,
		`{"model":"test-model","input":"x","tools":[{"type":"function","name":"f"}],"previous_response_id":"resp_1"}`,
		"{\"model\":\"test-model\",\"input\":\"\xff\xfe\u2028\",\"metadata\":{\"k\":\"\xff\"}}",
		// Tool calling (on in this front door: hermes).
		`{"model":"test-model","messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object","$defs":{"A":{"type":"integer"}}}}}],"tool_choice":"required","parallel_tool_calls":false}`,
		`{"model":"test-model","messages":[{"role":"user","content":"x"}],"tools":[{"function":{"name":"f","description":null}}],"tool_choice":{"type":"function","function":{"name":"f"}},"stream":true}`,
		`{"model":"test-model","messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":"{\"a\": [1, 2.5e3]}"}}]},{"role":"tool","tool_call_id":"c","name":"f","content":"ok"}],"tools":[{"type":"function","function":{"name":"f"}}],"tool_choice":"auto"}`,
	} {
		for route := range uint8(3) {
			f.Add(route, []byte(s), "", "")
			f.Add(route, []byte(s), "key-1", "rid-1")
		}
	}
	f.Add(uint8(1), []byte(`{"model":"test-model","prompt":"x"}`), strings.Repeat("k", 300), "bad id with spaces")
	f.Add(uint8(0), []byte(`{"model":"test-model","messages":[]}`), "\x00", strings.Repeat("r", 129))
	f.Add(uint8(2), []byte(`{"model":"test-model","input":[]}`), "\x00", strings.Repeat("r", 129))

	backend := fakegen.NewBackend(openai.ModelInfo{Name: modelName, MaxModelLen: 64})
	backend.SetUnavailable(true)
	fd, err := openai.New(openai.Config{MaxBodyBytes: maxBody, EnableAutoToolChoice: true, ToolCallParser: "hermes"}, backend, hclog.NewNullLogger(), prometheus.NewRegistry())
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := fd.Shutdown(ctx); err != nil {
			f.Errorf("shutdown: %v", err)
		}
	})
	h := fd.Handler()

	routes := []string{"/v1/chat/completions", "/v1/completions", "/v1/responses"}
	f.Fuzz(func(t *testing.T, route uint8, body []byte, idemKey, requestID string) {
		path := routes[int(route)%len(routes)]
		req := httptest.NewRequest(http.MethodPost, path, bytes.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		if idemKey != "" {
			req.Header["Idempotency-Key"] = []string{idemKey}
		}
		if requestID != "" {
			req.Header["X-Request-Id"] = []string{requestID}
		}
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)

		res := rec.Result()
		switch res.StatusCode {
		case 400, 404, 413, 422, 503:
		default:
			t.Fatalf("status %d for %q", res.StatusCode, body)
		}
		if (res.StatusCode == 413) != (len(body) > maxBody) {
			t.Fatalf("status %d for a body of %d bytes (limit %d)", res.StatusCode, len(body), maxBody)
		}
		if ct := res.Header.Get("Content-Type"); ct != "application/json" {
			t.Fatalf("content type %q", ct)
		}
		out := rec.Body.Bytes()
		if len(out) == 0 || out[len(out)-1] != '\n' || bytes.Count(out, []byte("\n")) != 1 {
			t.Fatalf("response is not one JSON line: %q", out)
		}
		var top map[string]json.RawMessage
		if err := json.Unmarshal(out, &top); err != nil || len(top) != 1 || top["error"] == nil {
			t.Fatalf("not an OpenAI error: %v: %q", err, out)
		}
		var e struct {
			Message string  `json:"message"`
			Type    string  `json:"type"`
			Param   *string `json:"param"`
			Code    *string `json:"code"`
		}
		dec := json.NewDecoder(bytes.NewReader(top["error"]))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&e); err != nil || e.Message == "" || e.Type == "" {
			t.Fatalf("error object %q: %v", top["error"], err)
		}
		if res.StatusCode == 503 {
			if res.Header.Get("Retry-After") == "" || e.Code == nil || *e.Code != "engine_unavailable" {
				t.Fatalf("503 without Retry-After or code: %v %q", res.Header, out)
			}
		}
		rid := res.Header.Get("X-Request-Id")
		if rid == "" || len(rid) > 128 || strings.ContainsFunc(rid, func(r rune) bool { return r < 0x21 || r > 0x7e }) {
			t.Fatalf("x-request-id %q", rid)
		}
		if sane := len(requestID) > 0 && len(requestID) <= 128 && !strings.ContainsFunc(requestID, func(r rune) bool { return r < 0x21 || r > 0x7e }); sane && rid != requestID {
			t.Fatalf("x-request-id %q not echoed: %q", requestID, rid)
		}
	})
}
