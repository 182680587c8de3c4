package openai

import (
	"encoding/json"
	"strings"
	"testing"
)

// FuzzParseRequest checks that no request body of any endpoint panics the
// parser and that every refusal is a well-formed 4xx error.
func FuzzParseRequest(f *testing.F) {
	for _, s := range []string{
		`{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true}}`,
		`{"model":"m","prompt":[[1,2,3]],"max_tokens":5,"stop":["a","b"],"seed":-3}`,
		`{"model":"m","prompt":["a"],"temperature":0.5,"top_p":1,"top_k":-1,"n":1}`,
		`{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"x"}]}],"logprobs":false}`,
		`{"model":"m","prompt":"x","max_completion_tokens":1e3}`,
		`{`, `null`, `[]`, `{"model":null}`, `{"model":"m","prompt":[[[[1]]]]}`,
		`{"model":"m","input":"hi","instructions":"be brief","max_output_tokens":5,"stream":true,"metadata":{"k":"v"}}`,
		`{"model":"m","input":[{"role":"user","content":[{"type":"input_text","text":"x"}]},{"type":"message","role":"assistant","content":"y"}]}`,
		`{"model":"m","input":"x","text":{"format":{"type":"json_schema","name":"n","schema":{"type":"object"}}},"tool_choice":"auto","tools":[]}`,
		`{"model":"m","input":"x","include":["message.output_text.logprobs"],"top_logprobs":2,"reasoning":{"effort":"low"}}`,
		`{"model":"m","input":[],"previous_response_id":"resp_1","background":true}`,
		`{"model":"m","messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":{"name":"f","parameters":{}}}],"tool_choice":"none"}`,
	} {
		for ep := range uint8(3) {
			f.Add(ep, []byte(s))
		}
	}
	cfg := Config{}.withDefaults()
	model := ModelInfo{Name: "m", MaxModelLen: 64}
	f.Fuzz(func(t *testing.T, route uint8, body []byte) {
		ep := endpoints[int(route)%len(endpoints)]
		j, e := parseRequest(ep, body, model, &cfg)
		if e != nil {
			if j != nil || e.Status < 400 || e.Status >= 500 || e.Message == "" || e.Type == "" {
				t.Fatalf("bad refusal %+v", e)
			}
			b := e.appendJSON(nil)
			if !strings.HasPrefix(string(b), `{"error":{"message":`) {
				t.Fatalf("error JSON %s", b)
			}
			return
		}
		if j.gen.GetInput() == nil || j.gen.GetParams() == nil || j.model != "m" {
			t.Fatalf("accepted request without input or params: %+v", j.gen)
		}
		if (ep == endpointResponses) != (j.resp != nil) || (j.resp != nil && (j.gen.GetMessages() == nil || j.endpoint != endpointResponses)) {
			t.Fatalf("%s request accepted as a job for %s (resp %v): %+v", ep, j.endpoint, j.resp != nil, j.gen)
		}
	})
}

func FuzzAppendJSONString(f *testing.F) {
	for _, s := range []string{"", "a\"b\\c\n\t\x00", "\u2028\u2029", "\xff\xfe", "héllo 世界"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		b := appendJSONString(nil, s)
		var got string
		if err := jsonUnmarshalString(b, &got); err != nil {
			t.Fatalf("invalid JSON %q for %q: %v", b, s, err)
		}
		// encoding/json is the reference: same decoded text (invalid bytes
		// each become U+FFFD).
		ref, _ := json.Marshal(s)
		var want string
		if err := json.Unmarshal(ref, &want); err != nil || want != got {
			t.Fatalf("round trip %q -> %q, encoding/json gives %q", s, got, want)
		}
	})
}

func jsonUnmarshalString(b []byte, s *string) error { return json.Unmarshal(b, s) }
