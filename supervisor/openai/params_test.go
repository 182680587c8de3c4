package openai_test

import (
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
	"github.com/frmps/frmps/supervisor/openai"
	"github.com/frmps/frmps/supervisor/openai/fakegen"
)

// logit_bias, min_tokens and the penalties reach the engine as given (the bias
// clamped to ±100, as vLLM clamps it), and a failover's resume set carries them.
func TestPenaltiesReachTheEngineAndTheResume(t *testing.T) {
	h, a := newHarness(t, openai.Config{}, fakegen.Config{KillAfter: 3, Interval: time.Millisecond})
	b := h.addEngine(fakegen.Config{})
	sets := h.failoverTo(a, b, nil, nil)
	resp := h.post("/v1/completions", `{"model":"test-model","prompt":"a b","max_tokens":8,"seed":1,"stream":true,`+
		`"logit_bias":{"5":2.5,"9":-300},"min_tokens":4,"presence_penalty":0.5,"frequency_penalty":-1,"repetition_penalty":1.25}`)
	s := readStream(t, resp.Body, nil)
	resp.Body.Close()
	if !s.done {
		t.Fatalf("no [DONE]: %v", s.raw)
	}
	want := &frmpsv1.SamplingParams{MaxTokens: 8, Temperature: 1, TopP: 1, Seed: proto.Uint64(1),
		LogitBias: map[uint32]float32{5: 2.5, 9: -100}, MinTokens: 4, PresencePenalty: 0.5, FrequencyPenalty: -1, RepetitionPenalty: 1.25}
	reqs := a.Requests()
	if len(reqs) != 1 || !proto.Equal(reqs[0].GetParams(), want) {
		t.Fatalf("engine got %v, want %v", reqs, want)
	}
	set := <-sets
	if len(set) != 1 || !proto.Equal(set[0].GetParams(), want) {
		t.Errorf("resume set %v, want params %v", set, want)
	}
}

func TestPenaltiesRefused(t *testing.T) {
	h, _ := newHarness(t, openai.Config{}, fakegen.Config{})
	for _, tc := range []struct{ body, param string }{
		{`{"model":"test-model","prompt":"x","logit_bias":{"a":1}}`, "logit_bias"},
		{`{"model":"test-model","prompt":"x","logit_bias":{"1":"x"}}`, "logit_bias"},
		{`{"model":"test-model","prompt":"x","min_tokens":-1}`, "min_tokens"},
		{`{"model":"test-model","prompt":"x","max_tokens":3,"min_tokens":4}`, "min_tokens"},
		{`{"model":"test-model","prompt":"x","presence_penalty":2.5}`, "presence_penalty"},
		{`{"model":"test-model","prompt":"x","frequency_penalty":-2.5}`, "frequency_penalty"},
		{`{"model":"test-model","prompt":"x","repetition_penalty":0}`, "repetition_penalty"},
	} {
		checkError(t, h.post("/v1/completions", tc.body), 400, tc.param, nil)
	}
}

// response_format and vLLM's structured_outputs reach the engine as one constraint.
func TestStructuredOutputsReachTheEngine(t *testing.T) {
	h, eng := newHarness(t, openai.Config{}, fakegen.Config{})
	msgs := `"messages":[{"role":"user","content":"x"}]`
	schema := frmpsv1.StructuredOutputs{Kind: &frmpsv1.StructuredOutputs_JsonSchema{JsonSchema: `{"type":"object","required":["a"]}`}}
	for _, tc := range []struct {
		path, body string
		want       *frmpsv1.StructuredOutputs
	}{
		{"/v1/chat/completions", `{"model":"test-model",` + msgs + `,"response_format":{"type":"json_schema","json_schema":{"name":"n","schema":{"type": "object", "required": ["a"]}}}}`, &schema},
		{"/v1/chat/completions", `{"model":"test-model",` + msgs + `,"response_format":{"type":"json_object"}}`,
			&frmpsv1.StructuredOutputs{Kind: &frmpsv1.StructuredOutputs_JsonObject{JsonObject: true}}},
		{"/v1/chat/completions", `{"model":"test-model",` + msgs + `,"response_format":{"type":"text"}}`, nil},
		{"/v1/completions", `{"model":"test-model","prompt":"x","structured_outputs":{"regex":"[a-c]{3}"}}`,
			&frmpsv1.StructuredOutputs{Kind: &frmpsv1.StructuredOutputs_Regex{Regex: "[a-c]{3}"}}},
		{"/v1/completions", `{"model":"test-model","prompt":"x","structured_outputs":{"choice":["yes","no"]}}`,
			&frmpsv1.StructuredOutputs{Kind: &frmpsv1.StructuredOutputs_Choice{Choice: &frmpsv1.Choices{Values: []string{"yes", "no"}}}}},
		{"/v1/completions", `{"model":"test-model","prompt":"x","structured_outputs":{"json":"{\"type\":\"object\",\"required\":[\"a\"]}"}}`, &schema},
		{"/v1/completions", `{"model":"test-model","prompt":"x","structured_outputs":{"grammar":"root ::= \"a\""}}`,
			&frmpsv1.StructuredOutputs{Kind: &frmpsv1.StructuredOutputs_Grammar{Grammar: `root ::= "a"`}}},
	} {
		before := len(eng.Requests())
		resp := h.post(tc.path, tc.body)
		if resp.StatusCode != 200 {
			t.Fatalf("%s: status %d: %v", tc.body, resp.StatusCode, readJSON(t, resp))
		}
		resp.Body.Close()
		reqs := eng.Requests()
		if len(reqs) != before+1 || !proto.Equal(reqs[len(reqs)-1].GetParams().GetStructuredOutputs(), tc.want) {
			t.Errorf("%s: engine got %v, want %v", tc.body, reqs[len(reqs)-1].GetParams().GetStructuredOutputs(), tc.want)
		}
	}
	for _, tc := range []struct{ body, param string }{
		{`"response_format":{"type":"json_object"},"structured_outputs":{"regex":"a"}`, "response_format"},
		{`"response_format":{"type":"xml"}`, "response_format"},
		{`"response_format":{"type":"json_schema","json_schema":{"name":"n"}}`, "response_format"},
		{`"response_format":{"type":"json_schema","json_schema":{"schema":[1]}}`, "response_format"},
		{`"response_format":"json"`, "response_format"},
		{`"structured_outputs":{"regex":"a","choice":["b"]}`, "structured_outputs"},
		{`"structured_outputs":{}`, "structured_outputs"},
		{`"structured_outputs":{"choice":[]}`, "structured_outputs"},
		{`"structured_outputs":{"json":"not json"}`, "structured_outputs"},
	} {
		checkError(t, h.post("/v1/completions", `{"model":"test-model","prompt":"x",`+tc.body+`}`), 400, tc.param, nil)
	}
}
