package openai_test

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
	"github.com/frmps/frmps/supervisor/openai"
	"github.com/frmps/frmps/supervisor/openai/fakegen"
)

// completionLogprobs is completions' logprobs object.
type completionLogprobs struct {
	TextOffset    []int                `json:"text_offset"`
	TokenLogprobs []float64            `json:"token_logprobs"`
	Tokens        []string             `json:"tokens"`
	TopLogprobs   []map[string]float64 `json:"top_logprobs"`
}

func (c *completionLogprobs) add(o completionLogprobs) {
	c.TextOffset = append(c.TextOffset, o.TextOffset...)
	c.TokenLogprobs = append(c.TokenLogprobs, o.TokenLogprobs...)
	c.Tokens = append(c.Tokens, o.Tokens...)
	c.TopLogprobs = append(c.TopLogprobs, o.TopLogprobs...)
}

// wantCompletionLogprobs is what the front door must make of the fake's logprobs
// for ids with k top tokens: the sampled token and the top k in each position's top.
func wantCompletionLogprobs(ids []uint32, k int, asIDs bool) completionLogprobs {
	var w completionLogprobs
	name := func(id uint32) string {
		if asIDs {
			return fmt.Sprintf("token_id:%d", id)
		}
		return fakegen.TokenText(id)
	}
	off := 0
	for _, id := range ids {
		e := fakegen.Logprobs(id, k)
		w.TextOffset = append(w.TextOffset, off)
		off += utf8.RuneCountInString(name(id))
		w.TokenLogprobs = append(w.TokenLogprobs, float64(e.Logprob))
		w.Tokens = append(w.Tokens, name(id))
		top := map[string]float64{name(id): float64(e.Logprob)}
		for j, t := range e.TopIds {
			top[name(t)] = float64(e.TopLogprobs[j])
		}
		w.TopLogprobs = append(w.TopLogprobs, top)
	}
	return w
}

// streamedLogprobs joins a one-choice stream's logprobs, chunk by chunk.
func streamedLogprobs(t *testing.T, s stream) completionLogprobs {
	t.Helper()
	var got completionLogprobs
	for _, raw := range s.raw {
		var c struct {
			Choices []struct {
				Logprobs *completionLogprobs `json:"logprobs"`
			} `json:"choices"`
		}
		if err := json.Unmarshal([]byte(raw), &c); err != nil {
			t.Fatal(err)
		}
		if len(c.Choices) == 1 && c.Choices[0].Logprobs != nil {
			got.add(*c.Choices[0].Logprobs)
		}
	}
	return got
}

func approxEqual(a, b completionLogprobs) bool {
	return fmt.Sprintf("%v %v %v %.5f", a.TextOffset, a.Tokens, a.TopLogprobs, a.TokenLogprobs) ==
		fmt.Sprintf("%v %v %v %.5f", b.TextOffset, b.Tokens, b.TopLogprobs, b.TokenLogprobs)
}

func outputIDs(ecfg fakegen.Config, prompt string, seed uint64, max uint32) []uint32 {
	ids, _, _ := fakegen.Expected(ecfg, &frmpsv1.GenerateRequest{Input: &frmpsv1.GenerateRequest_Prompt{Prompt: prompt},
		Params: &frmpsv1.SamplingParams{MaxTokens: max, Seed: &seed}})
	return ids
}

func TestCompletionLogprobs(t *testing.T) {
	ecfg := fakegen.Config{TokensPerChunk: 2}
	h, _ := newHarness(t, openai.Config{}, ecfg)
	ids := outputIDs(ecfg, "a b", 3, 5)
	for _, asIDs := range []bool{false, true} {
		extra := ""
		if asIDs {
			extra = `,"return_tokens_as_token_ids":true`
		}
		want := wantCompletionLogprobs(ids, 2, asIDs)
		var r struct {
			Choices []struct {
				Logprobs completionLogprobs `json:"logprobs"`
			} `json:"choices"`
		}
		resp := h.post("/v1/completions", `{"model":"test-model","prompt":"a b","seed":3,"max_tokens":5,"logprobs":2`+extra+`}`)
		if err := json.NewDecoder(resp.Body).Decode(&r); err != nil || len(r.Choices) != 1 {
			t.Fatalf("body: %v %v", err, r)
		}
		resp.Body.Close()
		if got := r.Choices[0].Logprobs; !approxEqual(got, want) {
			t.Errorf("as ids %v:\n got %+v\nwant %+v", asIDs, got, want)
		}
		// Streamed: each chunk's logprobs, the offsets running on.
		resp = h.post("/v1/completions", `{"model":"test-model","prompt":"a b","seed":3,"max_tokens":5,"logprobs":2,"stream":true`+extra+`}`)
		s := readStream(t, resp.Body, nil)
		resp.Body.Close()
		if got := streamedLogprobs(t, s); !approxEqual(got, want) {
			t.Errorf("streamed, as ids %v:\n got %+v\nwant %+v", asIDs, got, want)
		}
	}
}

func TestChatLogprobs(t *testing.T) {
	ecfg := fakegen.Config{}
	h, _ := newHarness(t, openai.Config{}, ecfg)
	msgs := []*frmpsv1.ChatMessage{{Role: "user", Content: "hi"}}
	seed := uint64(4)
	ids, _, _ := fakegen.Expected(ecfg, &frmpsv1.GenerateRequest{Input: &frmpsv1.GenerateRequest_Messages{Messages: &frmpsv1.ChatMessages{Messages: msgs}},
		Params: &frmpsv1.SamplingParams{MaxTokens: 3, Seed: &seed}})
	type lp struct {
		Token   string  `json:"token"`
		Logprob float64 `json:"logprob"`
		Bytes   []int   `json:"bytes"`
	}
	var r struct {
		Choices []struct {
			Logprobs struct {
				Content []struct {
					lp
					TopLogprobs []lp `json:"top_logprobs"`
				} `json:"content"`
			} `json:"logprobs"`
		} `json:"choices"`
	}
	resp := h.post("/v1/chat/completions", `{"model":"test-model","messages":[{"role":"user","content":"hi"}],"seed":4,"max_tokens":3,"logprobs":true,"top_logprobs":2}`)
	if err := json.NewDecoder(resp.Body).Decode(&r); err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	content := r.Choices[0].Logprobs.Content
	if len(content) != len(ids) {
		t.Fatalf("%d entries for %d tokens", len(content), len(ids))
	}
	for i, id := range ids {
		e, c := fakegen.Logprobs(id, 2), content[i]
		if c.Token != e.Token || fmt.Sprintf("%.5f", c.Logprob) != fmt.Sprintf("%.5f", e.Logprob) || string(bytesOf(c.Bytes)) != e.Token {
			t.Errorf("token %d: %+v, want %v %v", i, c.lp, e.Token, e.Logprob)
		}
		// vLLM's order: the sampled token, then the most likely, cut to top_logprobs.
		if len(c.TopLogprobs) != 2 || c.TopLogprobs[0].Token != e.Token || c.TopLogprobs[1].Token != e.TopTokens[0] {
			t.Errorf("token %d top: %+v", i, c.TopLogprobs)
		}
	}
	// Without logprobs: null, as before.
	b := readJSON(t, h.post("/v1/chat/completions", `{"model":"test-model","messages":[{"role":"user","content":"hi"}],"max_tokens":2,"logprobs":false}`))
	if c := b["choices"].([]any)[0].(map[string]any); c["logprobs"] != nil {
		t.Errorf("logprobs %v without asking", c["logprobs"])
	}
}

func bytesOf(v []int) []byte {
	b := make([]byte, len(v))
	for i, x := range v {
		b[i] = byte(x)
	}
	return b
}

func TestLogprobsRefused(t *testing.T) {
	h, _ := newHarness(t, openai.Config{}, fakegen.Config{})
	chat := "/v1/chat/completions"
	comp := "/v1/completions"
	msgs := `"messages":[{"role":"user","content":"x"}]`
	for _, tc := range []struct{ path, body, param string }{
		{comp, `{"model":"test-model","prompt":"x","logprobs":21}`, "logprobs"},
		{comp, `{"model":"test-model","prompt":"x","logprobs":-1}`, "logprobs"},
		{comp, `{"model":"test-model","prompt":"x","logprobs":true}`, "logprobs"},
		{comp, `{"model":"test-model","prompt":"x","logprobs":1,"echo":true}`, "echo"},
		{chat, `{"model":"test-model",` + msgs + `,"logprobs":3}`, "logprobs"},
		{chat, `{"model":"test-model",` + msgs + `,"top_logprobs":2}`, "top_logprobs"},
		{chat, `{"model":"test-model",` + msgs + `,"logprobs":true,"top_logprobs":21}`, "top_logprobs"},
	} {
		checkError(t, h.post(tc.path, tc.body), 400, tc.param, nil)
	}
}

// Across a failover the resumed engine is asked for the same logprobs: every
// token has its entry, as without the fault; with n=2 each choice has its own.
func TestLogprobsAcrossFailoverAndChoices(t *testing.T) {
	body := `{"model":"test-model","prompt":"a b","seed":3,"max_tokens":12,"logprobs":1,"stream":true}`
	h, a := newHarness(t, openai.Config{}, fakegen.Config{KillAfter: 5, Interval: time.Millisecond})
	b := h.addEngine(fakegen.Config{})
	h.failoverTo(a, b, nil, nil)
	resp := h.post("/v1/completions", body)
	s := readStream(t, resp.Body, nil)
	resp.Body.Close()
	got := streamedLogprobs(t, s)
	if want := wantCompletionLogprobs(outputIDs(fakegen.Config{}, "a b", 3, 12), 1, false); !approxEqual(got, want) || !s.done {
		t.Errorf("across the failover:\n got %+v\nwant %+v", got, want)
	}

	h2, _ := newHarness(t, openai.Config{}, fakegen.Config{})
	var r struct {
		Choices []struct {
			Index    int                `json:"index"`
			Logprobs completionLogprobs `json:"logprobs"`
		} `json:"choices"`
	}
	resp = h2.post("/v1/completions", `{"model":"test-model","prompt":"a b","seed":3,"max_tokens":4,"logprobs":1,"n":2}`)
	if err := json.NewDecoder(resp.Body).Decode(&r); err != nil || len(r.Choices) != 2 {
		t.Fatalf("n=2: %v %+v", err, r)
	}
	resp.Body.Close()
	for _, c := range r.Choices {
		want := wantCompletionLogprobs(outputIDs(fakegen.Config{}, "a b", 3+uint64(c.Index), 4), 1, false)
		if !approxEqual(c.Logprobs, want) {
			t.Errorf("choice %d:\n got %+v\nwant %+v", c.Index, c.Logprobs, want)
		}
	}
	if !strings.Contains(fmt.Sprint(r.Choices[0].Logprobs.Tokens), "w") {
		t.Errorf("tokens %v", r.Choices[0].Logprobs.Tokens)
	}
}
