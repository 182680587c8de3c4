package openai_test

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
	"github.com/frmps/frmps/supervisor/openai"
	"github.com/frmps/frmps/supervisor/openai/fakegen"
)

// want is what the fake engine gives one engine request: the text of a
// prompt (or chat messages) under a seed.
func want(ecfg fakegen.Config, prompt string, msgs []*frmpsv1.ChatMessage, seed uint64, maxTokens uint32) (string, string) {
	g := &frmpsv1.GenerateRequest{Params: &frmpsv1.SamplingParams{MaxTokens: maxTokens, Seed: &seed}}
	if msgs != nil {
		g.Input = &frmpsv1.GenerateRequest_Messages{Messages: &frmpsv1.ChatMessages{Messages: msgs}}
	} else {
		g.Input = &frmpsv1.GenerateRequest_Prompt{Prompt: prompt}
	}
	_, text, finish := fakegen.Expected(ecfg, g)
	return text, finish
}

// choicesOf reads a JSON body's choices: index -> text, index -> finish reason.
func choicesOf(t *testing.T, body map[string]any) (map[int]string, map[int]string) {
	t.Helper()
	texts, fins := map[int]string{}, map[int]string{}
	chs, _ := body["choices"].([]any)
	for _, c := range chs {
		cm := c.(map[string]any)
		i := int(cm["index"].(float64))
		if m, ok := cm["message"].(map[string]any); ok {
			texts[i] = m["content"].(string)
		} else {
			texts[i] = cm["text"].(string)
		}
		fins[i], _ = cm["finish_reason"].(string)
	}
	return texts, fins
}

// streamChoices reads a stream's chunks per choice index: text, finish
// reason, and whether a chat stream gave the choice its role before any text.
func streamChoices(t *testing.T, s stream) (texts, fins map[int]string, roleFirst map[int]bool) {
	t.Helper()
	texts, fins, roleFirst = map[int]string{}, map[int]string{}, map[int]bool{}
	for _, ev := range s.events {
		chs, _ := ev["choices"].([]any)
		if len(chs) > 1 {
			t.Fatalf("a chunk with %d choices: %v", len(chs), ev)
		}
		for _, c := range chs {
			cm := c.(map[string]any)
			i := int(cm["index"].(float64))
			if d, ok := cm["delta"].(map[string]any); ok {
				if d["role"] == "assistant" {
					if _, seen := texts[i]; !seen {
						roleFirst[i] = true
					}
				}
				if v, ok := d["content"].(string); ok {
					texts[i] += v
				}
			} else {
				texts[i] += cm["text"].(string)
			}
			if f, ok := cm["finish_reason"].(string); ok {
				if _, dup := fins[i]; dup {
					t.Fatalf("choice %d finished twice", i)
				}
				fins[i] = f
			}
		}
	}
	return texts, fins, roleFirst
}

// n > 1 and a batch of prompts: one choice per prompt and sample, numbered
// prompt by prompt; choice i of a prompt is the prompt's answer under seed + i
// (vLLM's seeding of n's children); the usage counts each prompt once.
func TestChoices(t *testing.T) {
	ecfg := fakegen.Config{}
	h, eng := newHarness(t, openai.Config{}, ecfg)
	prompts := []string{"the quick brown fox", "once upon"}
	cases := []struct {
		name, body string
		n          int
		prompts    []string
	}{
		{"n=3", `{"model":"test-model","prompt":"the quick brown fox","n":3,"seed":40,"max_tokens":6}`, 3, prompts[:1]},
		{"batch", `{"model":"test-model","prompt":["the quick brown fox","once upon"],"seed":40,"max_tokens":6}`, 1, prompts},
		{"batch × n=2", `{"model":"test-model","prompt":["the quick brown fox","once upon"],"n":2,"seed":40,"max_tokens":6}`, 2, prompts},
	}
	for _, tc := range cases {
		for _, streamed := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s stream=%v", tc.name, streamed), func(t *testing.T) {
				body := tc.body
				if streamed {
					body = strings.TrimSuffix(body, "}") + `,"stream":true,"stream_options":{"include_usage":true}}`
				}
				resp := h.post("/v1/completions", body)
				if resp.StatusCode != 200 {
					t.Fatalf("status %d: %v", resp.StatusCode, readJSON(t, resp))
				}
				var texts, fins map[int]string
				var u map[string]any
				if streamed {
					s := readStream(t, resp.Body, nil)
					resp.Body.Close()
					if !s.done {
						t.Fatalf("no [DONE]: %v", s.raw)
					}
					texts, fins, _ = streamChoices(t, s)
					u = usageOf(t, s)
				} else {
					b := readJSON(t, resp)
					texts, fins = choicesOf(t, b)
					u = b["usage"].(map[string]any)
				}
				if len(texts) != len(tc.prompts)*tc.n {
					t.Fatalf("%d choices, want %d: %v", len(texts), len(tc.prompts)*tc.n, texts)
				}
				promptTokens := 0
				for p, prompt := range tc.prompts {
					promptTokens += len(strings.Fields(prompt))
					for i := 0; i < tc.n; i++ {
						idx := p*tc.n + i
						wt, wf := want(ecfg, prompt, nil, 40+uint64(i), 6)
						if texts[idx] != wt || fins[idx] != wf {
							t.Errorf("choice %d: %q %q, want %q %q (prompt %q, seed %d)", idx, texts[idx], fins[idx], wt, wf, prompt, 40+i)
						}
					}
				}
				if u["prompt_tokens"] != float64(promptTokens) || u["completion_tokens"] != float64(6*len(texts)) {
					t.Errorf("usage %v, want %d prompt and %d completion tokens", u, promptTokens, 6*len(texts))
				}
				waitIdle(t, eng)
			})
		}
	}
	// The samples of an unseeded request differ (a random seed, + i each).
	b := readJSON(t, h.post("/v1/completions", `{"model":"test-model","prompt":"a b","n":2,"max_tokens":6}`))
	if texts, _ := choicesOf(t, b); len(texts) != 2 || texts[0] == texts[1] {
		t.Errorf("unseeded n=2: %v", texts)
	}
}

// A chat stream with n=2 gives each choice its role first, then its text.
func TestChatChoicesStream(t *testing.T) {
	ecfg := fakegen.Config{}
	h, _ := newHarness(t, openai.Config{}, ecfg)
	msgs := []*frmpsv1.ChatMessage{{Role: "user", Content: "tell me"}}
	body := `{"model":"test-model","messages":[{"role":"user","content":"tell me"}],"n":2,"seed":9,"max_tokens":5,"stream":true}`
	resp := h.post("/v1/chat/completions", body)
	s := readStream(t, resp.Body, nil)
	resp.Body.Close()
	texts, fins, roleFirst := streamChoices(t, s)
	for i := 0; i < 2; i++ {
		wt, wf := want(ecfg, "", msgs, 9+uint64(i), 5)
		if texts[i] != wt || fins[i] != wf || !roleFirst[i] {
			t.Errorf("choice %d: %q %q role first %v, want %q %q", i, texts[i], fins[i], roleFirst[i], wt, wf)
		}
	}
	if !s.done {
		t.Errorf("no [DONE]")
	}
}

// echo: a completion starts with its prompt (each prompt's, in a batch); a
// chat answer with the last message when that is the assistant's.
func TestEcho(t *testing.T) {
	ecfg := fakegen.Config{}
	h, _ := newHarness(t, openai.Config{}, ecfg)
	for _, streamed := range []string{"", `,"stream":true`} {
		resp := h.post("/v1/completions", `{"model":"test-model","prompt":"hello there","echo":true,"seed":1,"max_tokens":3`+streamed+`}`)
		wt, _ := want(ecfg, "hello there", nil, 1, 3)
		var got string
		if streamed != "" {
			s := readStream(t, resp.Body, nil)
			resp.Body.Close()
			got = s.text()
		} else {
			texts, _ := choicesOf(t, readJSON(t, resp))
			got = texts[0]
		}
		if got != "hello there"+wt {
			t.Errorf("echo%s: %q, want %q", streamed, got, "hello there"+wt)
		}
		resp = h.post("/v1/completions", `{"model":"test-model","prompt":["a b","c"],"echo":true,"seed":1,"max_tokens":3`+streamed+`}`)
		var texts map[int]string
		if streamed != "" {
			s := readStream(t, resp.Body, nil)
			resp.Body.Close()
			texts, _, _ = streamChoices(t, s)
		} else {
			texts, _ = choicesOf(t, readJSON(t, resp))
		}
		for i, p := range []string{"a b", "c"} {
			if wt, _ := want(ecfg, p, nil, 1, 3); texts[i] != p+wt {
				t.Errorf("batch echo%s, choice %d: %q, want %q", streamed, i, texts[i], p+wt)
			}
		}
	}
	msgs := `[{"role":"user","content":"say hi"},{"role":"assistant","content":"Hi"}]`
	for _, tc := range []struct {
		msgs, echoed string
	}{
		{msgs, "Hi"},
		{`[{"role":"user","content":"say hi"}]`, ""}, // the last message is not the assistant's
	} {
		b := readJSON(t, h.post("/v1/chat/completions", `{"model":"test-model","messages":`+tc.msgs+`,"echo":true,"seed":1,"max_tokens":3}`))
		texts, _ := choicesOf(t, b)
		if !strings.HasPrefix(texts[0], tc.echoed+" w") {
			t.Errorf("chat echo of %s: %q, want it to start with %q", tc.msgs, texts[0], tc.echoed)
		}
	}
}

// One prompt of a batch too long for the context fails the whole request
// with its status, streamed or not, and leaves nothing running.
func TestChoiceRefusedFailsTheRequest(t *testing.T) {
	h, eng := newHarness(t, openai.Config{}, fakegen.Config{MaxModelLen: 16, Interval: time.Millisecond})
	long := strings.TrimSpace(strings.Repeat("w ", 20))
	for _, streamed := range []string{"", `,"stream":true`} {
		body := `{"model":"test-model","prompt":["a b","` + long + `"],"max_tokens":4` + streamed + `}`
		checkError(t, h.post("/v1/completions", body), 400, "prompt", "context_length_exceeded")
		waitIdle(t, eng)
	}
}

// A failover in the middle of a streamed n=2 request: both choices resume on
// the next engine and end as without the fault.
func TestChoicesAcrossFailover(t *testing.T) {
	body := `{"model":"test-model","messages":[{"role":"user","content":"tell me"}],"n":2,"stream":true,"max_tokens":20,"seed":7,"stream_options":{"include_usage":true}}`
	base := noFault(t, body, fakegen.Config{})
	wantTexts, _, _ := streamChoices(t, base)
	h, a := newHarness(t, openai.Config{}, fakegen.Config{KillAfter: 7, Interval: time.Millisecond})
	b := h.addEngine(fakegen.Config{})
	sets := h.failoverTo(a, b, nil, nil)
	resp := h.post("/v1/chat/completions", body)
	got := readStream(t, resp.Body, nil)
	resp.Body.Close()
	if !got.done {
		t.Fatalf("no [DONE]: %v", got.raw)
	}
	texts, fins, _ := streamChoices(t, got)
	for i := 0; i < 2; i++ {
		if texts[i] != wantTexts[i] || fins[i] != "length" {
			t.Errorf("choice %d across the failover: %q %q, want %q", i, texts[i], fins[i], wantTexts[i])
		}
	}
	if u := usageOf(t, got); u["completion_tokens"] != 40.0 {
		t.Errorf("usage %v", u)
	}
	if set := <-sets; len(set) != 2 {
		t.Errorf("resume set of %d requests, want the 2 choices", len(set))
	}
}

// A client that leaves before every choice has started ends them all: the
// engine is told to drop each, and no goroutine is left (TestMain checks).
func TestChoicesClientGone(t *testing.T) {
	h, eng := newHarness(t, openai.Config{}, fakegen.Config{Interval: 20 * time.Millisecond})
	ctx, cancel := context.WithCancel(context.Background())
	resp := h.do(ctx, http.MethodPost, "/v1/completions", `{"model":"test-model","prompt":["a","b","c"],"n":2,"max_tokens":50,"stream":true}`)
	buf := make([]byte, 1)
	_, _ = resp.Body.Read(buf) // the stream started
	cancel()
	resp.Body.Close()
	waitIdle(t, eng)
}

// waitIdle waits until the engine runs no request.
func waitIdle(t *testing.T, eng *fakegen.Engine) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); eng.Running() > 0; {
		if time.Now().After(deadline) {
			t.Fatalf("%d requests still running on the engine", eng.Running())
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// stream_options.continuous_usage_stats (vLLM's): every chunk carries its
// choice's usage so far, the role chunk none of the completion yet.
func TestContinuousUsageStats(t *testing.T) {
	h, _ := newHarness(t, openai.Config{}, fakegen.Config{TokensPerChunk: 2})
	for _, n := range []int{1, 2} {
		resp := h.post("/v1/chat/completions", fmt.Sprintf(`{"model":"test-model","messages":[{"role":"user","content":"tell me"}],"n":%d,"max_tokens":6,"seed":1,"stream":true,`+
			`"stream_options":{"include_usage":true,"continuous_usage_stats":true}}`, n))
		s := readStream(t, resp.Body, nil)
		resp.Body.Close()
		got := map[int][]float64{} // choice -> completion_tokens of its chunks
		for _, ev := range s.events[:len(s.events)-1] {
			u, ok := ev["usage"].(map[string]any)
			if !ok || u["prompt_tokens"] != 5.0 || u["total_tokens"] != u["prompt_tokens"].(float64)+u["completion_tokens"].(float64) {
				t.Fatalf("n=%d: chunk usage %v in %v", n, ev["usage"], ev)
			}
			i := int(ev["choices"].([]any)[0].(map[string]any)["index"].(float64))
			got[i] = append(got[i], u["completion_tokens"].(float64))
		}
		for i := 0; i < n; i++ {
			// role (0), three chunks of two tokens, the finish chunk (6).
			if fmt.Sprint(got[i]) != "[0 2 4 6 6]" {
				t.Errorf("n=%d choice %d: completion_tokens per chunk %v", n, i, got[i])
			}
		}
		if u := usageOf(t, s); u["completion_tokens"] != float64(6*n) || u["prompt_tokens"] != 5.0 {
			t.Errorf("n=%d: final usage %v", n, u)
		}
	}
	// Without include_usage it adds nothing, as in vLLM.
	resp := h.post("/v1/completions", `{"model":"test-model","prompt":"x","max_tokens":2,"stream":true,"stream_options":{"continuous_usage_stats":true}}`)
	s := readStream(t, resp.Body, nil)
	resp.Body.Close()
	for _, ev := range s.events {
		if _, ok := ev["usage"]; ok {
			t.Fatalf("usage without include_usage: %v", ev)
		}
	}
}
