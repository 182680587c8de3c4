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
