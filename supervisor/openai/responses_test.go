package openai_test

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
	"github.com/frmps/frmps/supervisor/openai"
	"github.com/frmps/frmps/supervisor/openai/fakegen"
)

// respEvent is one event of a Responses API stream: its `event:` line's type and its data.
type respEvent struct {
	typ  string
	data map[string]any
}

type respStream struct {
	events     []respEvent
	keepAlives int
	done       bool // saw data: [DONE] (vLLM's Responses streams send none)
}

// readRespStream parses a Responses API stream: every data line follows an
// event line.
func readRespStream(t *testing.T, body io.Reader) respStream {
	t.Helper()
	var s respStream
	typ := ""
	sc := bufio.NewScanner(body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		switch {
		case line == "":
		case strings.HasPrefix(line, ":"):
			s.keepAlives++
		case strings.HasPrefix(line, "event: "):
			if typ != "" {
				t.Fatalf("event %q has no data", typ)
			}
			typ = line[len("event: "):]
		case line == "data: [DONE]":
			s.done = true
		case strings.HasPrefix(line, "data: "):
			if typ == "" {
				t.Fatalf("data without an event line: %q", line)
			}
			var m map[string]any
			if err := json.Unmarshal([]byte(line[len("data: "):]), &m); err != nil {
				t.Fatalf("event data is not JSON: %v: %q", err, line)
			}
			s.events = append(s.events, respEvent{typ, m})
			typ = ""
		default:
			t.Fatalf("unexpected SSE line %q", line)
		}
	}
	return s
}

func (s respStream) types() []string {
	var out []string
	for _, e := range s.events {
		out = append(out, e.typ)
	}
	return out
}

func (s respStream) deltas() string {
	var sb strings.Builder
	for _, e := range s.events {
		if e.typ == "response.output_text.delta" {
			sb.WriteString(e.data["delta"].(string))
		}
	}
	return sb.String()
}

// checkSequence checks every event's data names its own type and that the
// sequence numbers count from 0 without a gap.
func checkSequence(t *testing.T, s respStream) {
	t.Helper()
	for i, e := range s.events {
		if e.data["type"] != e.typ || e.data["sequence_number"] != float64(i) {
			t.Fatalf("event %d (%s): type %v, sequence_number %v", i, e.typ, e.data["type"], e.data["sequence_number"])
		}
	}
}

// outputText is a response object's output text ("" when its message has no part).
func outputText(t *testing.T, r map[string]any) string {
	t.Helper()
	out := r["output"].([]any)
	if len(out) != 1 {
		t.Fatalf("output %v, want one message", out)
	}
	content := out[0].(map[string]any)["content"].([]any)
	if len(content) == 0 {
		return ""
	}
	return content[0].(map[string]any)["text"].(string)
}

// vLLM 0.26.0's ResponsesResponse fields, less its own kv/ec_transfer_params
// and input/output_messages, which have nothing to say here.
const responseKeys = "background,created_at,frequency_penalty,id,incomplete_details,instructions,max_output_tokens,max_tool_calls," +
	"metadata,model,object,output,parallel_tool_calls,presence_penalty,previous_response_id,prompt,reasoning,service_tier," +
	"status,temperature,text,tool_choice,tools,top_logprobs,top_p,truncation,usage,user"

func TestResponsesNonStreaming(t *testing.T) {
	h, eng := newHarness(t, openai.Config{}, fakegen.Config{})
	resp := h.post("/v1/responses", `{"model":"test-model","instructions":"be brief","input":"hello there","max_output_tokens":5,`+
		`"temperature":0.5,"top_p":0.9,"seed":3,"user":"u1","metadata":{"k":"v"},"store":true,"reasoning":{"effort":"low"},`+
		`"tool_choice":"auto","tools":[],"unknown_field":{"x":1}}`, "X-Request-Id", "req-r1")
	if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "application/json" || resp.Header.Get("X-Request-Id") != "req-r1" {
		t.Fatalf("status %d, headers %v", resp.StatusCode, resp.Header)
	}
	m := readJSON(t, resp)
	if k := keys(m); k != responseKeys {
		t.Fatalf("keys %s\nwant %s", k, responseKeys)
	}
	if id, _ := m["id"].(string); !strings.HasPrefix(id, "resp_") || len(id) != 37 || m["object"] != "response" || m["model"] != "test-model" {
		t.Errorf("id %v object %v model %v", m["id"], m["object"], m["model"])
	}
	reqs := eng.Requests()
	if len(reqs) != 1 {
		t.Fatalf("engine got %d requests", len(reqs))
	}
	g := reqs[0]
	msgs := g.GetMessages().GetMessages()
	if len(msgs) != 2 || msgs[0].GetRole() != "system" || msgs[0].GetContent() != "be brief" || msgs[1].GetRole() != "user" || msgs[1].GetContent() != "hello there" {
		t.Errorf("engine messages %v: want the instructions as a system message first, then the input", msgs)
	}
	p := g.GetParams()
	if g.GetRequestId() != "req-r1" || !g.GetAddGenerationPrompt() || p.GetMaxTokens() != 5 || p.GetTemperature() != 0.5 || p.GetTopP() != 0.9 || p.GetSeed() != 3 {
		t.Errorf("engine request %v", g)
	}
	ids, text, _ := fakegen.Expected(h.ecfg, g)
	if m["status"] != "incomplete" || m["incomplete_details"].(map[string]any)["reason"] != "max_output_tokens" {
		t.Errorf("status %v, incomplete_details %v: want incomplete at max_output_tokens", m["status"], m["incomplete_details"])
	}
	msg := m["output"].([]any)[0].(map[string]any)
	if keys(msg) != "content,id,role,status,type" || msg["type"] != "message" || msg["role"] != "assistant" || msg["status"] != "completed" ||
		!strings.HasPrefix(msg["id"].(string), "msg_") {
		t.Errorf("output message %v", msg)
	}
	part := msg["content"].([]any)[0].(map[string]any)
	if keys(part) != "annotations,logprobs,text,type" || part["type"] != "output_text" || part["text"] != text || part["logprobs"] != nil ||
		len(part["annotations"].([]any)) != 0 {
		t.Errorf("output part %v, want text %q", part, text)
	}
	u := m["usage"].(map[string]any)
	// The fake counts 3 tokens of chat overhead per message plus words.
	if u["input_tokens"] != 10.0 || u["output_tokens"] != float64(len(ids)) || u["total_tokens"] != float64(10+len(ids)) ||
		u["input_tokens_details"].(map[string]any)["cached_tokens"] != 0.0 || u["output_tokens_details"].(map[string]any)["reasoning_tokens"] != 0.0 {
		t.Errorf("usage %v", u)
	}
	for k, want := range map[string]any{"instructions": "be brief", "user": "u1", "temperature": 0.5, "top_p": 0.9, "max_output_tokens": 5.0,
		"tool_choice": "none", "parallel_tool_calls": true, "text": nil, "top_logprobs": nil, "truncation": "disabled", "service_tier": "auto",
		"background": false, "previous_response_id": nil, "presence_penalty": 0.0} {
		if m[k] != want {
			t.Errorf("%s = %v, want %v", k, m[k], want)
		}
	}
	if md := m["metadata"].(map[string]any); len(md) != 1 || md["k"] != "v" {
		t.Errorf("metadata %v", md)
	}
	if rs := m["reasoning"].(map[string]any); rs["effort"] != "low" || keys(rs) != "effort,generate_summary,summary" {
		t.Errorf("reasoning %v", rs)
	}
	if tools := m["tools"].([]any); len(tools) != 0 {
		t.Errorf("tools %v", tools)
	}

	// Finished by the model: completed; max_output_tokens is the room left in the context.
	m = readJSON(t, h.post("/v1/responses", `{"model":"test-model","input":"hi"}`))
	if m["status"] != "completed" || m["incomplete_details"] != nil || m["max_output_tokens"] != float64(64-4) {
		t.Errorf("status %v, incomplete_details %v, max_output_tokens %v", m["status"], m["incomplete_details"], m["max_output_tokens"])
	}
	if _, text, finish := fakegen.Expected(h.ecfg, eng.Requests()[1]); finish != "stop" || outputText(t, m) != text {
		t.Errorf("text %q, want %q (%s)", outputText(t, m), text, finish)
	}
}

// The engine gets exactly the chat request that the equivalent chat completion makes.
func TestResponsesMakeTheChatRequest(t *testing.T) {
	h, eng := newHarness(t, openai.Config{}, fakegen.Config{})
	engineRequest := func(path, body string) *frmpsv1.GenerateRequest {
		t.Helper()
		resp := h.post(path, `{"model":"test-model",`+body+`}`)
		if resp.StatusCode != 200 {
			t.Fatalf("%s %s: status %d: %v", path, body, resp.StatusCode, readJSON(t, resp))
		}
		resp.Body.Close()
		reqs := eng.Requests()
		g := proto.Clone(reqs[len(reqs)-1]).(*frmpsv1.GenerateRequest)
		g.Key, g.RequestId = 0, ""
		return g
	}
	schema := `{"type": "object", "properties": {"a": {"type": "integer"}}}`
	for _, tc := range []struct{ name, responses, chat string }{
		{"instructions and items",
			`"instructions":"sys","input":[{"role":"developer","content":"dev"},` +
				`{"type":"message","role":"user","content":[{"type":"input_text","text":"a"},{"type":"input_text","text":"b"}]},` +
				`{"role":"assistant","content":[{"type":"output_text","text":"c"}],"id":"msg_1","status":"completed"},{"role":"user","content":"d"}],` +
				`"max_output_tokens":4,"seed":9,"temperature":0.3,"top_p":0.5,"top_k":5,"stop":["x"],"ignore_eos":true,"presence_penalty":0.5`,
			`"messages":[{"role":"system","content":"sys"},{"role":"developer","content":"dev"},{"role":"user","content":"a\nb"},` +
				`{"role":"assistant","content":"c"},{"role":"user","content":"d"}],` +
				`"max_tokens":4,"seed":9,"temperature":0.3,"top_p":0.5,"top_k":5,"stop":["x"],"ignore_eos":true,"presence_penalty":0.5`},
		{"json_schema", `"input":"x","seed":1,"text":{"format":{"type":"json_schema","name":"n","schema":` + schema + `,"strict":true}}`,
			`"messages":[{"role":"user","content":"x"}],"seed":1,"response_format":{"type":"json_schema","json_schema":{"name":"n","schema":` + schema + `}}`},
		{"json_object", `"input":"x","seed":1,"text":{"format":{"type":"json_object"}}`,
			`"messages":[{"role":"user","content":"x"}],"seed":1,"response_format":{"type":"json_object"}`},
		{"text", `"input":"x","seed":1,"text":{"format":{"type":"text"},"verbosity":"low"}`, `"messages":[{"role":"user","content":"x"}],"seed":1`},
		{"structured_outputs", `"input":"x","seed":1,"structured_outputs":{"regex":"[ab]+"}`,
			`"messages":[{"role":"user","content":"x"}],"seed":1,"structured_outputs":{"regex":"[ab]+"}`},
		{"logprobs", `"input":"x","seed":1,"include":["message.output_text.logprobs"],"top_logprobs":3`,
			`"messages":[{"role":"user","content":"x"}],"seed":1,"logprobs":true,"top_logprobs":3`},
		{"top_logprobs without include", `"input":"x","seed":1,"top_logprobs":3`, `"messages":[{"role":"user","content":"x"}],"seed":1`},
	} {
		got, want := engineRequest("/v1/responses", tc.responses), engineRequest("/v1/chat/completions", tc.chat)
		if !proto.Equal(got, want) {
			t.Errorf("%s: engine got\n%v\nwant (chat's)\n%v", tc.name, got, want)
		}
		if tc.name == "json_schema" && got.GetParams().GetStructuredOutputs().GetJsonSchema() == "" {
			t.Errorf("json_schema: no constraint: %v", got.GetParams())
		}
	}
	// text is echoed with vLLM's defaults spelled out.
	m := readJSON(t, h.post("/v1/responses", `{"model":"test-model","input":"x","text":{"format":{"type":"json_schema","name":"n","schema":`+schema+`}}}`))
	b, _ := json.Marshal(m["text"])
	if want := `{"format":{"description":null,"name":"n","schema":{"properties":{"a":{"type":"integer"}},"type":"object"},"strict":null,"type":"json_schema"},"verbosity":null}`; string(b) != want {
		t.Errorf("text echoed as %s, want %s", b, want)
	}
}

func TestResponsesStreaming(t *testing.T) {
	opening := []string{"response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"}
	closing := []string{"response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"}
	for _, tc := range []struct {
		name, body string
		ecfg       fakegen.Config
		status     string
		deltas     int
	}{
		{"incomplete at max_output_tokens", `"max_output_tokens":6`, fakegen.Config{}, "incomplete", 6},
		{"completed", ``, fakegen.Config{OutputLen: 5}, "completed", 5},
		// No delta for a chunk without text (its tokens' text comes with the next).
		{"held-back text", `"max_output_tokens":6`, fakegen.Config{HoldText: true}, "incomplete", 3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h, eng := newHarness(t, openai.Config{}, tc.ecfg)
			body := `{"model":"test-model","input":"hi","stream":true`
			if tc.body != "" {
				body += "," + tc.body
			}
			resp := h.post("/v1/responses", body+"}")
			defer resp.Body.Close()
			if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "text/event-stream" {
				t.Fatalf("status %d content-type %q", resp.StatusCode, resp.Header.Get("Content-Type"))
			}
			s := readRespStream(t, resp.Body)
			checkSequence(t, s)
			want := slices.Concat(opening, slices.Repeat([]string{"response.output_text.delta"}, tc.deltas), closing)
			if !slices.Equal(s.types(), want) {
				t.Fatalf("events %v\nwant %v", s.types(), want)
			}
			if s.done {
				t.Error("data: [DONE] in a Responses stream (vLLM sends none)")
			}
			ids, text, _ := fakegen.Expected(h.ecfg, eng.Requests()[0])
			created, final := s.events[0].data["response"].(map[string]any), s.events[len(s.events)-1].data["response"].(map[string]any)
			if keys(created) != responseKeys || keys(final) != responseKeys {
				t.Fatalf("response keys %s / %s", keys(created), keys(final))
			}
			if created["status"] != "in_progress" || len(created["output"].([]any)) != 0 || created["usage"] != nil || created["id"] != final["id"] {
				t.Errorf("created %v", created)
			}
			if final["status"] != tc.status || final["usage"].(map[string]any)["output_tokens"] != float64(len(ids)) {
				t.Errorf("final status %v usage %v, want %s and %d tokens", final["status"], final["usage"], tc.status, len(ids))
			}
			msgID := final["output"].([]any)[0].(map[string]any)["id"]
			item := s.events[2].data["item"].(map[string]any)
			if item["id"] != msgID || item["status"] != "in_progress" || len(item["content"].([]any)) != 0 {
				t.Errorf("output_item.added %v (message %v)", item, msgID)
			}
			for _, e := range s.events[2:] {
				if e.typ != "response.completed" && e.typ != "response.output_item.added" && e.typ != "response.output_item.done" &&
					(e.data["item_id"] != msgID || e.data["output_index"] != 0.0 || e.data["content_index"] != 0.0) {
					t.Errorf("%s locates %v/%v/%v, want message %v", e.typ, e.data["item_id"], e.data["output_index"], e.data["content_index"], msgID)
				}
				if e.typ == "response.output_text.delta" && (e.data["delta"] == "" || len(e.data["logprobs"].([]any)) != 0) {
					t.Errorf("delta %v", e.data)
				}
			}
			done := s.events[len(s.events)-4].data
			partDone := s.events[len(s.events)-3].data["part"].(map[string]any)
			itemDone := s.events[len(s.events)-2].data["item"].(map[string]any)
			if s.deltas() != text || done["text"] != text || partDone["text"] != text || outputText(t, final) != text ||
				itemDone["content"].([]any)[0].(map[string]any)["text"] != text || itemDone["status"] != "completed" {
				t.Errorf("deltas %q, done %q, part %q, item %v, final %q; want %q", s.deltas(), done["text"], partDone["text"], itemDone, outputText(t, final), text)
			}
		})
	}
}

// The logprobs asked for with include: every token's in the final response
// (with bytes), and in the stream's deltas (without), a held-back token's
// with the next delta.
func TestResponsesLogprobs(t *testing.T) {
	ecfg := fakegen.Config{HoldText: true}
	h, eng := newHarness(t, openai.Config{}, ecfg)
	type lp struct {
		Token       string  `json:"token"`
		Logprob     float64 `json:"logprob"`
		Bytes       []int   `json:"bytes"`
		TopLogprobs []struct {
			Token string `json:"token"`
			Bytes []int  `json:"bytes"`
		} `json:"top_logprobs"`
	}
	check := func(what string, got []lp, ids []uint32, bytes bool) {
		t.Helper()
		if len(got) != len(ids) {
			t.Fatalf("%s: %d logprobs for %d tokens", what, len(got), len(ids))
		}
		for i, id := range ids {
			e := fakegen.Logprobs(id, 2)
			if got[i].Token != e.Token || len(got[i].TopLogprobs) != 2 || got[i].TopLogprobs[0].Token != e.Token ||
				got[i].TopLogprobs[1].Token != e.TopTokens[0] || (got[i].Bytes != nil) != bytes || (got[i].TopLogprobs[0].Bytes != nil) != bytes {
				t.Errorf("%s: token %d: %+v, want %s (bytes %v)", what, i, got[i], e.Token, bytes)
			}
		}
	}
	decode := func(v any) []lp {
		b, _ := json.Marshal(v)
		var out []lp
		if err := json.Unmarshal(b, &out); err != nil {
			t.Fatal(err)
		}
		return out
	}
	body := `{"model":"test-model","input":"hi","max_output_tokens":6,"include":["message.output_text.logprobs"],"top_logprobs":2`
	m := readJSON(t, h.post("/v1/responses", body+"}"))
	ids, _, _ := fakegen.Expected(ecfg, eng.Requests()[0])
	check("response", decode(m["output"].([]any)[0].(map[string]any)["content"].([]any)[0].(map[string]any)["logprobs"]), ids, true)
	if m["top_logprobs"] != 2.0 {
		t.Errorf("top_logprobs %v", m["top_logprobs"])
	}

	resp := h.post("/v1/responses", body+`,"stream":true}`)
	s := readRespStream(t, resp.Body)
	resp.Body.Close()
	ids, _, _ = fakegen.Expected(ecfg, eng.Requests()[1])
	var streamed []lp
	for _, e := range s.events {
		if e.typ == "response.output_text.delta" {
			streamed = append(streamed, decode(e.data["logprobs"])...)
		}
	}
	check("stream deltas", streamed, ids, false)
	final := s.events[len(s.events)-1].data["response"].(map[string]any)
	check("completed", decode(final["output"].([]any)[0].(map[string]any)["content"].([]any)[0].(map[string]any)["logprobs"]), ids, true)
}

func TestResponsesErrors(t *testing.T) {
	h, _ := newHarness(t, openai.Config{}, fakegen.Config{MaxModelLen: 16})
	in := `"model":"test-model","input":"x"`
	for _, tc := range []struct {
		name, body  string
		status      int
		param, code any
	}{
		{"bad json", `{"model":`, 400, nil, nil},
		{"missing model", `{"input":"x"}`, 400, "model", nil},
		{"unknown model", `{"model":"gpt-9","input":"x"}`, 404, "model", "model_not_found"},
		{"missing input", `{"model":"test-model"}`, 400, "input", nil},
		{"empty input list", `{"model":"test-model","input":[]}`, 400, "input", nil},
		{"input not a list", `{"model":"test-model","input":{"role":"user"}}`, 400, "input", nil},
		{"bad role", `{"model":"test-model","input":[{"role":"tool","content":"x"}]}`, 400, "input[0].role", nil},
		{"image part", `{"model":"test-model","input":[{"role":"user","content":[{"type":"input_image","image_url":"u"}]}]}`, 400, "input[0].content", nil},
		{"chat's text part", `{"model":"test-model","input":[{"role":"user","content":[{"type":"text","text":"x"}]}]}`, 400, "input[0].content", nil},
		{"no content", `{"model":"test-model","input":[{"role":"user"}]}`, 400, "input[0].content", nil},
		{"function call output item", `{"model":"test-model","input":[{"type":"function_call_output","call_id":"c","output":"o"}]}`, 400, "input[0].type", nil},
		{"partial last message", `{"model":"test-model","input":[{"role":"assistant","content":"x","status":"incomplete"}]}`, 400, "input[0].status", nil},
		{"max_output_tokens 0", `{` + in + `,"max_output_tokens":0}`, 400, "max_output_tokens", nil},
		{"max_output_tokens beyond context", `{` + in + `,"max_output_tokens":16}`, 400, "max_output_tokens", "context_length_exceeded"},
		{"input + max_output_tokens beyond context", `{"model":"test-model","input":"a b c d e f g","max_output_tokens":7}`, 400, "max_output_tokens", "context_length_exceeded"},
		{"input beyond context", `{"model":"test-model","input":"` + strings.Repeat("w ", 14) + `","stream":true}`, 400, "input", "context_length_exceeded"},
		{"temperature", `{` + in + `,"temperature":3}`, 400, "temperature", nil},
		{"top_p", `{` + in + `,"top_p":0}`, 400, "top_p", nil},
		{"wrong type", `{` + in + `,"temperature":"hot"}`, 400, "temperature", nil},
		{"tools", `{` + in + `,"tools":[{"type":"function","name":"f","parameters":{}}]}`, 400, "tools", nil},
		{"tool_choice required", `{` + in + `,"tool_choice":"required"}`, 400, "tool_choice", nil},
		{"tool_choice a function", `{` + in + `,"tool_choice":{"type":"function","name":"f"}}`, 400, "tool_choice", nil},
		{"background", `{` + in + `,"background":true}`, 400, "background", nil},
		{"background without store", `{` + in + `,"background":true,"store":false}`, 400, "background", nil},
		{"prompt template", `{` + in + `,"prompt":{"id":"p"}}`, 400, "prompt", nil},
		{"truncation auto", `{` + in + `,"truncation":"auto"}`, 400, "truncation", nil},
		{"service_tier", `{` + in + `,"service_tier":"gold"}`, 400, "service_tier", nil},
		{"unknown include", `{` + in + `,"include":["everything"]}`, 400, "include", nil},
		{"top_logprobs beyond 20", `{` + in + `,"include":["message.output_text.logprobs"],"top_logprobs":21}`, 400, "top_logprobs", nil},
		{"text.format type", `{` + in + `,"text":{"format":{"type":"xml"}}}`, 400, "text.format", nil},
		{"json_schema without schema", `{` + in + `,"text":{"format":{"type":"json_schema","name":"n"}}}`, 400, "text.format.schema", nil},
		{"json_schema without name", `{` + in + `,"text":{"format":{"type":"json_schema","schema":{}}}}`, 400, "text.format.name", nil},
		{"json_schema not an object", `{` + in + `,"text":{"format":{"type":"json_schema","name":"n","schema":[1]}}}`, 400, "text.format.schema", nil},
		{"text.format and structured_outputs", `{` + in + `,"text":{"format":{"type":"json_object"}},"structured_outputs":{"regex":"a"}}`, 400, "structured_outputs", nil},
		{"verbosity", `{` + in + `,"text":{"verbosity":"loud"}}`, 400, "text.verbosity", nil},
		{"metadata not strings", `{` + in + `,"metadata":{"k":1}}`, 400, "metadata", nil},
		{"reasoning not an object", `{` + in + `,"reasoning":"high"}`, 400, "reasoning", nil},
		// vLLM without its store (the default) knows no earlier response.
		{"previous_response_id", `{` + in + `,"previous_response_id":"resp_abc"}`, 404, "previous_response_id", nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			checkError(t, h.post("/v1/responses", tc.body), tc.status, tc.param, tc.code)
		})
	}
	for _, tc := range []struct{ method, path string }{{http.MethodGet, "/v1/responses/resp_abc"}, {http.MethodPost, "/v1/responses/resp_abc/cancel"}} {
		e := checkError(t, h.do(context.Background(), tc.method, tc.path, ""), 404, "response_id", nil)
		if !strings.Contains(e["message"].(string), "'resp_abc' not found") {
			t.Errorf("%s %s: %v", tc.method, tc.path, e["message"])
		}
	}
	checkError(t, h.do(context.Background(), http.MethodGet, "/v1/responses", ""), 405, nil, nil)
	if n := metricValue(t, h.reg, "frmps_requests_total", map[string]string{"endpoint": "responses", "code": "400"}); n < 30 {
		t.Errorf("requests_total{responses,400} = %v", n)
	}
}

func TestResponsesAPIKeyAndMetrics(t *testing.T) {
	h, _ := newHarness(t, openai.Config{APIKey: "sekret"}, fakegen.Config{})
	scrape := func() string {
		resp := h.do(context.Background(), http.MethodGet, "/metrics", "")
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return string(b)
	}
	// The route's series are there, at zero, before its first request.
	before := scrape()
	for _, want := range []string{
		`frmps_requests_total{code="200",endpoint="responses",model_name="test-model"} 0`,
		`frmps_request_duration_seconds_count{endpoint="responses",model_name="test-model"} 0`,
	} {
		if !strings.Contains(before, want) {
			t.Errorf("metrics before any request lack %q", want)
		}
	}
	body := `{"model":"test-model","input":"x","max_output_tokens":3}`
	for _, hdr := range [][]string{nil, {"Authorization", "Bearer wrong"}} {
		checkError(t, h.post("/v1/responses", body, hdr...), 401, nil, "invalid_api_key")
	}
	checkError(t, h.do(context.Background(), http.MethodGet, "/v1/responses/resp_1", ""), 401, nil, "invalid_api_key")
	if resp := h.post("/v1/responses", body, "Authorization", "Bearer sekret"); resp.StatusCode != 200 {
		t.Fatalf("good key: status %d", resp.StatusCode)
	} else {
		resp.Body.Close()
	}
	after := scrape()
	for _, want := range []string{
		`frmps_requests_total{code="401",endpoint="responses",model_name="test-model"} 2`,
		`frmps_requests_total{code="200",endpoint="responses",model_name="test-model"} 1`,
		`frmps_request_duration_seconds_count{endpoint="responses",model_name="test-model"} 1`,
		`frmps_tokens_generated_total{model_name="test-model"} 3`,
	} {
		if !strings.Contains(after, want) {
			t.Errorf("metrics lack %q", want)
		}
	}
}

// An Idempotency-Key's retry gets the first response again, not a second generation.
func TestResponsesIdempotent(t *testing.T) {
	h, eng := newHarness(t, openai.Config{}, fakegen.Config{})
	body := `{"model":"test-model","input":"x","max_output_tokens":3}`
	first := readJSON(t, h.post("/v1/responses", body, "Idempotency-Key", "k1"))
	again := readJSON(t, h.post("/v1/responses", body, "Idempotency-Key", "k1"))
	if first["id"] != again["id"] || len(eng.Requests()) != 1 {
		t.Errorf("retry got %v (first %v), engine requests %d", again["id"], first["id"], len(eng.Requests()))
	}
}

const respStreamBody = `{"model":"test-model","instructions":"be brief","input":"tell me","stream":true,"max_output_tokens":20,"seed":7,"temperature":0.8}`

// A failover mid-stream is invisible: the same events a healthy engine gives,
// every token's text once, the sequence numbers unbroken.
func TestResponsesStreamAcrossFailover(t *testing.T) {
	for _, tc := range []struct {
		name string
		ecfg fakegen.Config
		lag  int // the resume set claims fewer delivered tokens than the client has
	}{
		{name: "one token per chunk"},
		{name: "three tokens per chunk", ecfg: fakegen.Config{TokensPerChunk: 3}},
		{name: "engine repeats delivered tokens", ecfg: fakegen.Config{ResumeFromAdopted: true}, lag: 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h0, _ := newHarness(t, openai.Config{}, tc.ecfg)
			resp := h0.post("/v1/responses", respStreamBody)
			want := readRespStream(t, resp.Body)
			resp.Body.Close()

			killCfg := tc.ecfg
			killCfg.KillAfter = 7
			h, a := newHarness(t, openai.Config{}, killCfg)
			b := h.addEngine(tc.ecfg)
			sets := h.failoverTo(a, b, func(reqs []*frmpsv1.ResumeRequest) {
				for _, r := range reqs {
					r.DeliveredTokenIds = r.DeliveredTokenIds[:max(len(r.DeliveredTokenIds)-tc.lag, 0)]
				}
			}, nil)
			resp = h.post("/v1/responses", respStreamBody)
			got := readRespStream(t, resp.Body)
			resp.Body.Close()
			checkSequence(t, got)
			// (Chunks after the resume may group tokens differently: one delta each.)
			g, w := got.types(), want.types()
			if tc.ecfg.TokensPerChunk > 1 {
				g, w = slices.Compact(g), slices.Compact(w)
			}
			if !slices.Equal(g, w) {
				t.Fatalf("events across the failover %v\nwithout one %v", g, w)
			}
			final := got.events[len(got.events)-1].data["response"].(map[string]any)
			if got.deltas() != want.deltas() || outputText(t, final) != want.deltas() || len(strings.Fields(got.deltas())) != 20 {
				t.Errorf("deltas across the failover\n got %q\nwant %q (final %q)", got.deltas(), want.deltas(), outputText(t, final))
			}
			if u := final["usage"].(map[string]any); u["output_tokens"] != 20.0 || u["input_tokens"] != 10.0 {
				t.Errorf("usage %v", u)
			}
			set := <-sets
			if len(set) != 1 || len(set[0].GetMessages()) != 2 || set[0].GetMessages()[0].GetContent() != "be brief" || set[0].GetParams().GetSeed() != 7 {
				t.Fatalf("resume set %v: want the instructions and input, seed 7", set)
			}
			if res := b.Resumes(); len(res) != 1 || res[0].GetDelivered() != 7 {
				t.Errorf("resume calls %v, want one with delivered=7", res)
			}
			if n := metricValue(t, h.reg, "frmps_stream_resumes_total", map[string]string{"outcome": "ok"}); n != 1 {
				t.Errorf("stream_resumes_total{ok} = %v", n)
			}
		})
	}
}

// A stream that cannot be resumed ends with an error event (also carrying the
// error object, as the other streams end), and no response.completed; before
// any output, the client gets the 503.
func TestResponsesResumeRefused(t *testing.T) {
	h, a := newHarness(t, openai.Config{}, fakegen.Config{KillAfter: 4})
	b := h.addEngine(fakegen.Config{})
	go func() { // a new engine that never adopted the request
		<-a.Dead()
		h.backend.Set(b.Client())
	}()
	resp := h.post("/v1/responses", respStreamBody)
	s := readRespStream(t, resp.Body)
	resp.Body.Close()
	checkSequence(t, s)
	last := s.events[len(s.events)-1]
	if last.typ != "error" || keys(last.data) != "code,error,message,param,sequence_number,type" || last.data["code"] != "stream_resume_failed" {
		t.Fatalf("last event %s %v", last.typ, last.data)
	}
	if e := last.data["error"].(map[string]any); keys(e) != "code,message,param,type" || e["code"] != "stream_resume_failed" || e["message"] != last.data["message"] {
		t.Errorf("error object %v", e)
	}
	if slices.Contains(s.types(), "response.completed") || s.done || len(strings.Fields(s.deltas())) != 4 {
		t.Errorf("events %v, deltas %q", s.types(), s.deltas())
	}

	h2, a2 := newHarness(t, openai.Config{ResumeTimeout: 50 * time.Millisecond}, fakegen.Config{KillAfter: 4})
	_ = a2
	resp = h2.post("/v1/responses", `{"model":"test-model","input":"x","max_output_tokens":10}`)
	checkError(t, resp, 503, nil, "stream_resume_failed")
}
