package openai_test

import (
	"fmt"
	"io"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/frmps/frmps/supervisor/openai"
	"github.com/frmps/frmps/supervisor/openai/fakegen"
)

func TestManyStreamsAcrossFailover(t *testing.T) {
	h, a := newHarness(t, openai.Config{}, fakegen.Config{KillAfter: 9, Interval: time.Millisecond})
	b := h.addEngine(fakegen.Config{})
	sets := h.failoverTo(a, b, nil, nil)
	const n = 8
	texts := make([]string, n)
	done := make([]bool, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			body := fmt.Sprintf(`{"model":"test-model","prompt":"p%d","stream":true,"max_tokens":30,"seed":%d}`, i, i)
			resp := h.post("/v1/completions", body)
			s := readStream(t, resp.Body, nil)
			resp.Body.Close()
			texts[i], done[i] = s.text(), s.done
		}()
	}
	wg.Wait()
	byPrompt := map[string]string{}
	for _, g := range append(a.Requests(), b.Requests()...) { // some start on b when a is already dead
		_, text, _ := fakegen.Expected(h.ecfg, g)
		byPrompt[g.GetPrompt()] = text
	}
	for i := range n {
		want, ok := byPrompt[fmt.Sprintf("p%d", i)]
		if !done[i] || !ok || texts[i] != want {
			t.Errorf("stream %d: done=%v\n got %q\nwant %q", i, done[i], texts[i], want)
		}
	}
	if set := <-sets; len(set) == 0 || len(set) > n {
		t.Errorf("resume set of %d requests", len(set))
	}
}

func fdCount(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Skipf("no /proc/self/fd: %v", err)
	}
	return len(ents)
}

// TestNoFDLeak runs requests of every kind, including a failover and
// disconnects, and checks that every descriptor is released once the front
// door and its fakes are shut down.
func TestNoFDLeak(t *testing.T) {
	round := func(t *testing.T) {
		h, a := newHarness(t, openai.Config{}, fakegen.Config{KillAfter: 5})
		b := h.addEngine(fakegen.Config{})
		h.failoverTo(a, b, nil, nil)
		for _, body := range []string{
			`{"model":"test-model","prompt":"x","stream":true,"max_tokens":10}`,
			`{"model":"test-model","prompt":"x","max_tokens":10}`,
			`{"model":"nope","prompt":"x"}`,
		} {
			resp := h.post("/v1/completions", body)
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
	}
	t.Run("warm-up", round) // the runtime's own descriptors (netpoll) open once
	before := fdCount(t)
	for i := range 3 {
		t.Run(fmt.Sprint("round", i), round)
	}
	if after := fdCount(t); after != before {
		t.Errorf("open descriptors: %d before, %d after", before, after)
	}
}
