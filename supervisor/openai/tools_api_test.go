package openai_test

import (
	"encoding/json"
	"regexp"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
	"github.com/frmps/frmps/supervisor/openai"
	"github.com/frmps/frmps/supervisor/openai/fakegen"
)

// The front door with vLLM's --enable-auto-tool-choice --tool-call-parser hermes.
var toolsCfg = openai.Config{EnableAutoToolChoice: true, ToolCallParser: "hermes"}

const (
	weatherTool = `{"type":"function","function":{"name":"get_weather","description":"Current weather.","parameters":{"type":"object","properties":{"city":{"type":"string"},"unit":{"type":"string","enum":["c","f"]}},"required":["city"]}}}`
	// A tool as a client may write it: no type, no description, no parameters.
	timeTool = `{"function":{"name":"get_time"}}`
	twoTools = `[` + weatherTool + `,` + timeTool + `]`
	// vLLM 0.26.0's tools for the chat template and its tool_choice "required"
	// schema for twoTools (printed by vLLM itself: ChatCompletionToolsParam.model_dump
	// and tool_parsers.utils.get_json_schema_from_tools).
	vllmTools    = `[{"type":"function","function":{"name":"get_weather","description":"Current weather.","parameters":{"type":"object","properties":{"city":{"type":"string"},"unit":{"type":"string","enum":["c","f"]}},"required":["city"]}}},{"type":"function","function":{"name":"get_time","description":null,"parameters":null}}]`
	vllmRequired = `{"type":"array","minItems":1,"items":{"type":"object","anyOf":[{"properties":{"name":{"type":"string","enum":["get_weather"]},"parameters":{"type":"object","properties":{"city":{"type":"string"},"unit":{"type":"string","enum":["c","f"]}},"required":["city"]}},"required":["name","parameters"]},{"properties":{"name":{"type":"string","enum":["get_time"]},"parameters":{"type":"object","properties":{}}},"required":["name","parameters"]}]}}`

	hermesWeather = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"c\"}}\n</tool_call>"
	weatherArgs   = `{"city": "Paris", "unit": "c"}`
)

var callIDRe = regexp.MustCompile(`^chatcmpl-tool-[0-9a-f]{16}$`)

// toolBody is a chat request for "Weather in Paris?" with twoTools and extra members.
func toolBody(extra string) string {
	b := `{"model":"test-model","messages":[{"role":"user","content":"Weather in Paris?"}],"tools":` + twoTools
	if extra != "" {
		b += "," + extra
	}
	return b + "}"
}

// tokensOf cuts text into tokens of sizes 3, 1, 4, 2, 5, … (cycling), so that
// the tags and the JSON are split at many places.
func tokensOf(text string) []string {
	sizes := []int{3, 1, 4, 2, 5}
	var out []string
	for i, k := 0, 0; i < len(text); k++ {
		n := min(sizes[k%len(sizes)], len(text)-i)
		out = append(out, text[i:i+n])
		i += n
	}
	return out
}

func TestToolRequestValidation(t *testing.T) {
	for _, tc := range []struct {
		name  string
		cfg   openai.Config
		body  string
		param string
		msg   string
	}{
		{"empty tools", toolsCfg, `{"model":"test-model","messages":[{"role":"user","content":"x"}],"tools":[]}`, "tools", "`tools` must not be an empty array"},
		{"tools not a list", toolsCfg, `{"model":"test-model","messages":[{"role":"user","content":"x"}],"tools":{}}`, "tools", "must be an array"},
		{"tool of another type", toolsCfg, `{"model":"test-model","messages":[{"role":"user","content":"x"}],"tools":[{"type":"retrieval","function":{"name":"f"}}]}`, "tools[0].type", `must be "function"`},
		{"function without a name", toolsCfg, `{"model":"test-model","messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":{"parameters":{}}}]}`, "tools[0].function.name", "must be a string"},
		{"parameters not a schema", toolsCfg, `{"model":"test-model","messages":[{"role":"user","content":"x"}],"tools":[{"function":{"name":"f","parameters":[1]}}]}`, "tools[0].function.parameters", "must be an object"},
		{"tool_choice without tools", toolsCfg, `{"model":"test-model","messages":[{"role":"user","content":"x"}],"tool_choice":"required"}`, "tool_choice", "When using `tool_choice`, `tools` must be set."},
		{"unknown tool_choice", toolsCfg, toolBody(`"tool_choice":"sometimes"`), "tool_choice", `Invalid value for ` + "`tool_choice`" + `: "sometimes"! Only named tools, "none", "auto" or "required" are supported.`},
		{"named: unknown function", toolsCfg, toolBody(`"tool_choice":{"type":"function","function":{"name":"get_stock"}}`), "tool_choice", "The tool specified in `tool_choice` does not match any of the specified `tools`"},
		{"named: no name", toolsCfg, toolBody(`"tool_choice":{"type":"function","function":{}}`), "tool_choice.function.name", "Expected field `name` in `function` in `tool_choice`!"},
		{"named: function not an object", toolsCfg, toolBody(`"tool_choice":{"type":"function","function":"get_weather"}`), "tool_choice.function", "Invalid value for `function`"},
		{"named: empty name", toolsCfg, toolBody(`"tool_choice":{"function":{"name":""}}`), "tool_choice.function.name", "Invalid `name`"},
		{"named with a structured output", toolsCfg, toolBody(`"tool_choice":{"type":"function","function":{"name":"get_weather"}},"structured_outputs":{"regex":"a+"}`), "structured_outputs", "You can only either use constraints for structured outputs or tools, not both."},
		{"history: call of another type", toolsCfg, `{"model":"test-model","messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"code","function":{"name":"f","arguments":"{}"}}]}]}`, "messages[0].tool_calls", "only support assistant tool_calls of type 'function'"},
		{"history: arguments not JSON", toolsCfg, `{"model":"test-model","messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{oops"}}]}]}`, "messages[0].tool_calls", "not valid JSON"},
		// Without the parser: vLLM's refusals (with tools, no tool_choice means "auto").
		{"auto without the parser", openai.Config{}, toolBody(""), "tool_choice", `"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set`},
		{"required without the parser", openai.Config{}, toolBody(`"tool_choice":"required"`), "tool_choice", `tool_choice="required" requires --tool-call-parser to be set`},
		{"named without the parser", openai.Config{ToolCallParser: "hermes"}, toolBody(`"tool_choice":{"type":"function","function":{"name":"get_weather"}}`), "tool_choice", `tool_choice=function "get_weather" requires --tool-call-parser to be set`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h, eng := newHarness(t, tc.cfg, fakegen.Config{})
			resp := h.post("/v1/chat/completions", tc.body)
			m := readJSON(t, resp)
			if resp.StatusCode != 400 {
				t.Fatalf("status %d: %v", resp.StatusCode, m)
			}
			e := m["error"].(map[string]any)
			if e["param"] != tc.param || !strings.Contains(e["message"].(string), tc.msg) || e["type"] != "invalid_request_error" {
				t.Errorf("error %v, want param %q and a message with %q", e, tc.param, tc.msg)
			}
			if n := len(eng.Requests()); n != 0 {
				t.Errorf("a refused request reached the engine (%d)", n)
			}
		})
	}
}

func TestToolsReachTheEngine(t *testing.T) {
	// tool_choice "none": the output is plain, but the template still gets the
	// tools (vLLM's default), normalized as vLLM hands them over; the history's
	// tool calls and results too.
	for _, cfg := range []openai.Config{{}, toolsCfg} {
		h, eng := newHarness(t, cfg, fakegen.Config{})
		body := `{"model":"test-model","tools":` + twoTools + `,"tool_choice":"none","messages":[
			{"role":"user","content":"Weather in Paris?"},
			{"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function","function":{"name":"get_weather","arguments":"{\"unit\": \"c\", \"city\": \"Paris\"}"}},{"id":"call_2","type":"function","function":{"name":"get_time","arguments":""}}]},
			{"role":"tool","tool_call_id":"call_1","content":"22 C"},
			{"role":"tool","tool_call_id":"call_2","name":"get_time","content":[{"type":"text","text":"noon"}]}]}`
		m := readJSON(t, h.post("/v1/chat/completions", body))
		c := m["choices"].([]any)[0].(map[string]any)
		if msg := c["message"].(map[string]any); msg["tool_calls"] != nil || c["finish_reason"] != "stop" {
			t.Errorf("tool_choice none: %v", c)
		}
		g := eng.Requests()[0]
		if g.GetToolsJson() != vllmTools {
			t.Errorf("tools_json\n got %s\nwant %s", g.GetToolsJson(), vllmTools)
		}
		if g.GetParams().GetStructuredOutputs() != nil {
			t.Errorf("tool_choice none constrains the output: %v", g.GetParams().GetStructuredOutputs())
		}
		msgs := g.GetMessages().GetMessages()
		wantCalls := `[{"id":"call_1","type":"function","function":{"name":"get_weather","arguments":{"unit":"c","city":"Paris"}}},{"id":"call_2","type":"function","function":{"name":"get_time","arguments":{}}}]`
		if len(msgs) != 4 || msgs[1].GetContent() != "" || msgs[1].GetToolCallsJson() != wantCalls {
			t.Fatalf("assistant message %v\nwant tool_calls_json %s", msgs[1], wantCalls)
		}
		if msgs[2].GetToolCallId() != "call_1" || msgs[2].GetContent() != "22 C" || msgs[2].Name != nil ||
			msgs[3].GetToolCallId() != "call_2" || msgs[3].GetName() != "get_time" || msgs[3].GetContent() != "noon" || msgs[0].ToolCallId != nil {
			t.Errorf("tool messages %v", msgs)
		}
	}
	// /tokenize's chat form takes the tools too (vLLM's does).
	h, eng := newHarness(t, openai.Config{}, fakegen.Config{})
	resp := h.post("/tokenize", `{"model":"test-model","messages":[{"role":"user","content":"hi"}],"tools":`+twoTools+`}`)
	if m := readJSON(t, resp); resp.StatusCode != 200 {
		t.Fatalf("tokenize: %d %v", resp.StatusCode, m)
	}
	if tk := eng.Tokenizes(); len(tk) != 1 || tk[0].GetToolsJson() != vllmTools {
		t.Errorf("tokenize requests %v", tk)
	}
}

func TestToolChoiceConstraint(t *testing.T) {
	schemaOf := func(g *frmpsv1.GenerateRequest) string { return g.GetParams().GetStructuredOutputs().GetJsonSchema() }
	for _, tc := range []struct {
		name, extra string
		check       func(*frmpsv1.GenerateRequest) bool
		want        string
	}{
		{"named: the function's parameters", `"tool_choice":{"type":"function","function":{"name":"get_weather"}}`,
			func(g *frmpsv1.GenerateRequest) bool {
				return schemaOf(g) == `{"type":"object","properties":{"city":{"type":"string"},"unit":{"type":"string","enum":["c","f"]}},"required":["city"]}`
			}, "the parameters schema"},
		{"named replaces response_format", `"tool_choice":{"type":"function","function":{"name":"get_weather"}},"response_format":{"type":"json_object"}`,
			func(g *frmpsv1.GenerateRequest) bool {
				return strings.HasPrefix(schemaOf(g), `{"type":"object","properties":{"city"`)
			}, "the parameters schema"},
		{"named function without parameters: no constraint", `"tool_choice":{"type":"function","function":{"name":"get_time"}}`,
			func(g *frmpsv1.GenerateRequest) bool { return g.GetParams().GetStructuredOutputs() == nil }, "none"},
		{"required: vLLM's array schema", `"tool_choice":"required"`,
			func(g *frmpsv1.GenerateRequest) bool { return schemaOf(g) == vllmRequired }, vllmRequired},
		{"required replaces structured_outputs", `"tool_choice":"required","structured_outputs":{"regex":"a+"}`,
			func(g *frmpsv1.GenerateRequest) bool { return schemaOf(g) == vllmRequired }, vllmRequired},
		{"auto keeps the request's own", `"tool_choice":"auto","structured_outputs":{"regex":"a+"}`,
			func(g *frmpsv1.GenerateRequest) bool { return g.GetParams().GetStructuredOutputs().GetRegex() == "a+" }, "the regex"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h, eng := newHarness(t, toolsCfg, fakegen.Config{})
			resp := h.post("/v1/chat/completions", toolBody(tc.extra))
			if m := readJSON(t, resp); resp.StatusCode != 200 {
				t.Fatalf("status %d: %v", resp.StatusCode, m)
			}
			g := eng.Requests()[0]
			if !tc.check(g) {
				t.Errorf("structured_outputs %v, want %s", g.GetParams().GetStructuredOutputs(), tc.want)
			}
			if g.GetToolsJson() != vllmTools {
				t.Errorf("tools_json %s", g.GetToolsJson())
			}
		})
	}
	// $defs of the tools' parameters are gathered at the top of "required"'s schema.
	h, eng := newHarness(t, toolsCfg, fakegen.Config{})
	defTools := `[{"type":"function","function":{"name":"a","parameters":{"type":"object","properties":{"p":{"$ref":"#/$defs/P"}},"$defs":{"P":{"type":"integer"}}}}}]`
	body := `{"model":"test-model","messages":[{"role":"user","content":"x"}],"tool_choice":"required","tools":` + defTools + `}`
	if resp := h.post("/v1/chat/completions", body); resp.StatusCode != 200 || readJSON(t, resp) == nil {
		t.Fatalf("status %d", resp.StatusCode)
	}
	want := `{"type":"array","minItems":1,"items":{"type":"object","anyOf":[{"properties":{"name":{"type":"string","enum":["a"]},"parameters":{"type":"object","properties":{"p":{"$ref":"#/$defs/P"}}}},"required":["name","parameters"]}]},"$defs":{"P":{"type":"integer"}}}`
	if got := schemaOf(eng.Requests()[0]); got != want {
		t.Errorf("schema with $defs\n got %s\nwant %s", got, want)
	}
}

// answerOf is a non-streamed answer's one choice and its message.
func answerOf(t *testing.T, m map[string]any) (choice, msg map[string]any) {
	t.Helper()
	cs, ok := m["choices"].([]any)
	if !ok || len(cs) != 1 {
		t.Fatalf("choices %v", m)
	}
	choice = cs[0].(map[string]any)
	return choice, choice["message"].(map[string]any)
}

// callsOf checks a message's tool_calls' shape and returns them as name(arguments).
func callsOf(t *testing.T, msg map[string]any) []string {
	t.Helper()
	tcs, _ := msg["tool_calls"].([]any)
	var out []string
	for _, x := range tcs {
		tc := x.(map[string]any)
		f := tc["function"].(map[string]any)
		if keys(tc) != "function,id,type" || tc["type"] != "function" || !callIDRe.MatchString(tc["id"].(string)) || keys(f) != "arguments,name" {
			t.Errorf("tool call %v", tc)
		}
		out = append(out, f["name"].(string)+"("+f["arguments"].(string)+")")
	}
	return out
}

func TestToolCallsAnswer(t *testing.T) {
	for _, tc := range []struct {
		name, extra, output string
		content             any // string or nil (null)
		calls               []string
		finish              string
	}{
		{"auto: text, then a call", `"tool_choice":"auto"`, hermesWeather, "Let me check.\n", []string{"get_weather(" + weatherArgs + ")"}, "tool_calls"},
		{"auto: no call", `"max_tokens":40`, "It is sunny <tool", "It is sunny <tool", nil, "stop"},
		{"auto: a call alone, arguments re-serialized", "", "<tool_call>{\"name\":\"get_time\",\"arguments\":{\"tz\":\"CET\",\"n\":1.50}}</tool_call>", nil, []string{`get_time({"tz": "CET", "n": 1.5})`}, "tool_calls"},
		{"auto: parallel_tool_calls false keeps the first", `"parallel_tool_calls":false`, hermesWeather + "<tool_call>{\"name\": \"get_time\", \"arguments\": {}}</tool_call>", "Let me check.\n", []string{"get_weather(" + weatherArgs + ")"}, "tool_calls"},
		{"named: the output is the arguments", `"tool_choice":{"type":"function","function":{"name":"get_weather"}}`, weatherArgs, "", []string{"get_weather(" + weatherArgs + ")"}, "stop"},
		{"named: cut by max_tokens", `"tool_choice":{"type":"function","function":{"name":"get_weather"}},"max_tokens":4`, weatherArgs, "", []string{`get_weather({"city": ")`}, "length"},
		{"required: the array's calls", `"tool_choice":"required"`, `[{"name": "get_weather", "parameters": {"city":"Paris"}}, {"name": "get_time", "parameters": {}}]`, "", []string{`get_weather({"city": "Paris"})`, "get_time({})"}, "tool_calls"},
		{"required: cut by max_tokens, no call", `"tool_choice":"required","max_tokens":6`, `[{"name": "get_weather", "parameters": {}}]`, "", nil, "length"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h, _ := newHarness(t, toolsCfg, fakegen.Config{Script: tokensOf(tc.output)})
			resp := h.post("/v1/chat/completions", toolBody(tc.extra))
			m := readJSON(t, resp)
			if resp.StatusCode != 200 {
				t.Fatalf("status %d: %v", resp.StatusCode, m)
			}
			c, msg := answerOf(t, m)
			want := tc.content
			if tc.calls == nil && want == nil {
				want = tc.output
			}
			if msg["role"] != "assistant" || msg["content"] != want || c["finish_reason"] != tc.finish {
				t.Errorf("message %v finish %v; want content %q finish %s", msg, c["finish_reason"], want, tc.finish)
			}
			if got := callsOf(t, msg); strings.Join(got, " ") != strings.Join(tc.calls, " ") {
				t.Errorf("calls %q, want %q", got, tc.calls)
			}
			if _, has := msg["tool_calls"]; has != (len(tc.calls) > 0) {
				t.Errorf("tool_calls member present=%v with %d calls", has, len(tc.calls))
			}
		})
	}
}

// streamedCalls assembles a stream's tool-call deltas per choice, checking
// their shape: a call's first delta carries its id, type and name (and only
// it), later ones its index and arguments.
type streamedCall struct{ id, name, args string }

func streamedCalls(t *testing.T, s stream) (content map[int]string, calls map[int][]streamedCall, finish map[int]string) {
	t.Helper()
	content, calls, finish = map[int]string{}, map[int][]streamedCall{}, map[int]string{}
	for _, ev := range s.events {
		for _, x := range ev["choices"].([]any) {
			c := x.(map[string]any)
			i := int(c["index"].(float64))
			if f, ok := c["finish_reason"].(string); ok {
				finish[i] = f
			}
			d := c["delta"].(map[string]any)
			if v, ok := d["content"].(string); ok {
				content[i] += v
			}
			for _, y := range asList(d["tool_calls"]) {
				tc := y.(map[string]any)
				idx := int(tc["index"].(float64))
				f := tc["function"].(map[string]any)
				if id, ok := tc["id"].(string); ok {
					if idx != len(calls[i]) || !callIDRe.MatchString(id) || tc["type"] != "function" || f["name"] == nil {
						t.Fatalf("first delta of a call %v (choice %d has %d calls)", tc, i, len(calls[i]))
					}
					calls[i] = append(calls[i], streamedCall{id: id, name: f["name"].(string)})
				} else if idx >= len(calls[i]) || f["name"] != nil || tc["type"] != nil {
					t.Fatalf("delta %v of a call not started (choice %d has %d calls)", tc, i, len(calls[i]))
				}
				if a, ok := f["arguments"].(string); ok {
					calls[i][idx].args += a
				}
			}
		}
	}
	return content, calls, finish
}

func asList(v any) []any { l, _ := v.([]any); return l }

func TestToolCallsStreamed(t *testing.T) {
	for _, tc := range []struct {
		name, extra, output string
		content             string
		calls               []string
		finish              string
	}{
		{"auto", `"tool_choice":"auto"`, hermesWeather, "Let me check.\n", []string{"get_weather(" + weatherArgs + ")"}, "tool_calls"},
		{"auto: no call, the held-back text released at the end", "", "It is sunny <tool_ca", "It is sunny <tool_ca", nil, "stop"},
		{"auto: parallel_tool_calls false", `"parallel_tool_calls":false`, hermesWeather + "\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>", "Let me check.\n", []string{"get_weather(" + weatherArgs + ")"}, "tool_calls"},
		{"named", `"tool_choice":{"type":"function","function":{"name":"get_weather"}}`, weatherArgs, "", []string{"get_weather(" + weatherArgs + ")"}, "stop"},
		{"required", `"tool_choice":"required"`, `[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]`, "", []string{`get_weather({"city": "Paris"})`, "get_time({})"}, "tool_calls"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h, _ := newHarness(t, toolsCfg, fakegen.Config{Script: tokensOf(tc.output)})
			resp := h.post("/v1/chat/completions", toolBody(tc.extra+sep(tc.extra)+`"stream":true,"n":2`))
			s := readStream(t, resp.Body, nil)
			resp.Body.Close()
			if !s.done {
				t.Fatalf("no [DONE]: %v", s.raw)
			}
			content, calls, finish := streamedCalls(t, s)
			for i := 0; i < 2; i++ { // each choice reads its own output
				var got []string
				for _, c := range calls[i] {
					got = append(got, c.name+"("+c.args+")")
				}
				if content[i] != tc.content || strings.Join(got, " ") != strings.Join(tc.calls, " ") || finish[i] != tc.finish {
					t.Errorf("choice %d: content %q calls %q finish %q; want %q %q %q", i, content[i], got, finish[i], tc.content, tc.calls, tc.finish)
				}
			}
		})
	}
}

func sep(s string) string {
	if s == "" {
		return ""
	}
	return ","
}

// TestToolCallAcrossFailover: the engine dies after each token of a hermes
// call in turn, inside the tags and the JSON; the stream resumed on the
// standby gives the same content, calls and finish as an uninterrupted one
// (the parser's state is the front door's and continues), and so does a
// non-streamed answer.
func TestToolCallAcrossFailover(t *testing.T) {
	toks := tokensOf(hermesWeather)
	body := toolBody(`"stream":true,"seed":5`)
	for k := 1; k < len(toks); k++ {
		ecfg := fakegen.Config{Script: toks}
		killCfg := ecfg
		killCfg.KillAfter = k
		h, a := newHarness(t, toolsCfg, killCfg)
		b := h.addEngine(ecfg)
		sets := h.failoverTo(a, b, nil, nil)
		resp := h.post("/v1/chat/completions", body)
		s := readStream(t, resp.Body, nil)
		resp.Body.Close()
		if !s.done {
			t.Fatalf("kill after %d (%q): no [DONE]: %v", k, strings.Join(toks[:k], ""), s.raw)
		}
		content, calls, finish := streamedCalls(t, s)
		if content[0] != "Let me check.\n" || len(calls[0]) != 1 || calls[0][0].name != "get_weather" || calls[0][0].args != weatherArgs || finish[0] != "tool_calls" {
			t.Errorf("kill after %d (%q): content %q calls %+v finish %q", k, strings.Join(toks[:k], ""), content[0], calls[0], finish[0])
		}
		if len(b.Resumes()) != 1 {
			t.Errorf("kill after %d: %d resumes", k, len(b.Resumes()))
		}
		// The resume set carries the tools: a standby that tokenizes the messages again
		// renders the same prompt.
		if set := <-sets; len(set) != 1 || set[0].GetToolsJson() != vllmTools || len(set[0].GetMessages()) != 1 {
			t.Errorf("kill after %d: resume set %v", k, set)
		}
	}
	// Not streamed: the same answer.
	ecfg := fakegen.Config{Script: toks}
	killCfg := ecfg
	killCfg.KillAfter = len(toks) / 2
	h, a := newHarness(t, toolsCfg, killCfg)
	b := h.addEngine(ecfg)
	h.failoverTo(a, b, nil, nil)
	m := readJSON(t, h.post("/v1/chat/completions", toolBody(`"seed":5`)))
	c, msg := answerOf(t, m)
	if got := callsOf(t, msg); len(got) != 1 || got[0] != "get_weather("+weatherArgs+")" || msg["content"] != "Let me check.\n" || c["finish_reason"] != "tool_calls" {
		t.Errorf("non-streamed across failover: %v", c)
	}
}

func TestToolCallStreamShape(t *testing.T) {
	// The raw chunks of a hermes call: content deltas, then the call's first
	// delta (id, type, index, name), then its arguments in pieces.
	h, _ := newHarness(t, toolsCfg, fakegen.Config{Script: tokensOf(hermesWeather)})
	resp := h.post("/v1/chat/completions", toolBody(`"stream":true`))
	s := readStream(t, resp.Body, nil)
	resp.Body.Close()
	var first, pieces int
	for _, raw := range s.raw {
		switch {
		case strings.Contains(raw, `"tool_calls":[{"id":"chatcmpl-tool-`):
			first++
			if !regexp.MustCompile(`"delta":\{"tool_calls":\[\{"id":"chatcmpl-tool-[0-9a-f]{16}","type":"function","index":0,"function":\{"name":"get_weather"\}\}`).MatchString(raw) {
				t.Errorf("first delta %s", raw)
			}
		case strings.Contains(raw, `"tool_calls":[{"index":0,"function":{"arguments":`):
			pieces++
		}
	}
	if first != 1 || pieces < 3 {
		t.Errorf("%d first deltas, %d argument pieces: %v", first, pieces, s.raw)
	}
	var ev map[string]any
	if err := json.Unmarshal([]byte(s.raw[0]), &ev); err != nil || !strings.Contains(s.raw[0], `"delta":{"role":"assistant","content":""}`) {
		t.Errorf("first chunk %s", s.raw[0])
	}
}

func TestToolCallParserConfig(t *testing.T) {
	for _, c := range []struct {
		cfg  openai.Config
		want string
	}{
		{openai.Config{ToolCallParser: "mistral"}, `tool call parser "mistral" is not implemented`},
		{openai.Config{EnableAutoToolChoice: true}, "needs a tool call parser"},
	} {
		_, err := openai.New(c.cfg, fakegen.NewBackend(openai.ModelInfo{Name: "m"}), nil, prometheus.NewRegistry())
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("New(%+v): %v, want %q", c.cfg, err, c.want)
		}
	}
}
