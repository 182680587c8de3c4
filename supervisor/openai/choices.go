package openai

import (
	"context"
	"errors"
	"net/http"
	"strconv"
	"sync"
	"time"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
)

// A request with several choices (n > 1, or a batch of prompts) runs one
// engine request per choice, each on its own goroutine through run, as one
// choice does: its own key, seed and failover resume. choiceSet merges them
// into one response. A stream's headers go out once every choice has its
// first chunk, so that a choice refused up front (a prompt too long for the
// context) fails the whole request with its status, as vLLM does; after
// that, one choice's failure ends the stream with an error event and no
// [DONE], and the other choices are aborted.

// errChoiceFailed cancels a request's other choices once one has failed.
var errChoiceFailed = errors.New("another choice of the request failed")

type choiceSet struct {
	j      *job
	w      http.ResponseWriter
	head   responseHead
	sse    *sseOutput      // streams: the writer, its lock and keep-alives; nil for one JSON body
	heads  []*streamChoice // streams: each choice's stream state
	ctx    context.Context // ends when the request does, or one choice failed
	cancel context.CancelCauseFunc

	mu       sync.Mutex
	pending  int           // choices not yet at start
	ready    chan struct{} // closed once every choice is at start, or one failed
	started  bool          // a stream's headers went out
	failed   *apiError     // the first failure
	gaps     int           // choices in a failover gap
	finished int
	state    []choiceState
}

type choiceState struct {
	acc    jsonOutput // JSON: what the choice delivered (only its accumulating half is used)
	inGap  bool
	reason string
	u      usage
}

// choiceOut is choice i's output.
type choiceOut struct {
	set *choiceSet
	i   int
}

func (s *Server) runChoices(ctx context.Context, w http.ResponseWriter, j *job, rid string, head responseHead, arrived time.Time) int {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	set := &choiceSet{j: j, w: w, head: head, ctx: ctx, cancel: cancel, pending: len(j.choices), ready: make(chan struct{}),
		state: make([]choiceState, len(j.choices))}
	if j.stream {
		set.sse = newSSEOutput(w, j, head, s.cfg.KeepAliveInterval)
		for i := range j.choices {
			set.heads = append(set.heads, &streamChoice{head: set.sse.choiceHead(i), echo: j.choices[i].echo, tools: j.tools.newStream()})
		}
	}
	for i, c := range j.choices {
		set.state[i].acc = jsonOutput{returnIDs: j.returnTokenIDs, lp: j.lp, tools: j.tools, echoLen: len(c.echo)}
		set.state[i].acc.sb.WriteString(c.echo)
	}
	codes := make([]int, len(j.choices))
	var wg sync.WaitGroup
	for i, c := range j.choices {
		or := &openRequest{key: s.nextKey.Add(1), requestID: rid + "-" + strconv.Itoa(i), gen: c.gen, sibling: i > 0}
		c.gen.Key, c.gen.RequestId = or.key, or.requestID
		s.register(or)
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer s.unregister(or)
			codes[i] = s.run(ctx, j, or, &choiceOut{set: set, i: i}, arrived)
		}()
	}
	wg.Wait()
	return set.end(codes)
}

func (o *choiceOut) start(promptTokens int) error {
	set := o.set
	set.mu.Lock()
	if set.sse != nil {
		set.heads[o.i].u.prompt = promptTokens
	}
	if set.failed == nil {
		set.pending--
		if set.pending == 0 {
			if set.sse != nil {
				if err := set.sse.startChoices(set.heads); err != nil {
					set.failLocked(nil)
				}
				set.started = true
			}
			close(set.ready)
		}
	}
	set.mu.Unlock()
	select {
	case <-set.ready:
	case <-set.ctx.Done(): // the request ended before every choice had started
		return context.Cause(set.ctx)
	}
	set.mu.Lock()
	defer set.mu.Unlock()
	if set.failed != nil {
		return errChoiceFailed
	}
	return nil
}

func (o *choiceOut) text(delta string, ids []uint32, lps []*frmpsv1.TokenLogprobs) error {
	o.set.mu.Lock()
	defer o.set.mu.Unlock()
	if o.set.failed != nil {
		return errChoiceFailed
	}
	if o.set.sse != nil {
		return o.set.sse.textAt(o.set.heads[o.i], delta, ids, lps)
	}
	return o.set.state[o.i].acc.text(delta, ids, lps)
}

func (o *choiceOut) gap(open bool) {
	set := o.set
	set.mu.Lock()
	defer set.mu.Unlock()
	st := &set.state[o.i]
	if st.inGap == open || set.sse == nil {
		st.inGap = open
		return
	}
	st.inGap = open
	if open {
		set.gaps++
		if set.gaps == 1 {
			set.sse.gap(true)
		}
		return
	}
	set.gaps--
	if set.gaps == 0 {
		set.sse.gap(false)
	}
}

func (o *choiceOut) finish(reason string, u usage) error {
	set := o.set
	set.mu.Lock()
	defer set.mu.Unlock()
	if set.failed != nil {
		return errChoiceFailed
	}
	st := &set.state[o.i]
	st.reason, st.u = reason, u
	set.finished++
	if set.sse == nil {
		return nil
	}
	last := set.finished == len(set.state)
	if last {
		set.sse.stopKeepAlive()
	}
	return set.sse.finishChoice(set.heads[o.i], reason, last, set.usage())
}

// usage is the request's: each prompt counted once (by its first choice), every
// choice's completion tokens. set.mu held.
func (set *choiceSet) usage() usage {
	var u usage
	for i := range set.state {
		if set.j.choices[i].sample == 0 {
			u.prompt += set.state[i].u.prompt
		}
		u.completion += set.state[i].u.completion
	}
	return u
}

func (o *choiceOut) fail(e *apiError) {
	o.set.mu.Lock()
	defer o.set.mu.Unlock()
	o.set.failLocked(e)
}

// failLocked records the request's first failure (nil: the client is gone) and
// ends the others; set.mu held. Before the headers the error is the response
// (end writes it); after, a stream gets an error event and no [DONE].
func (set *choiceSet) failLocked(e *apiError) {
	if set.failed != nil {
		return
	}
	if e == nil {
		e = &apiError{Status: statusClientClosed}
	}
	set.failed = e
	set.cancel(errChoiceFailed)
	if set.pending > 0 {
		set.pending = 0
		close(set.ready)
	}
	if set.started && e.Status != statusClientClosed {
		set.sse.fail(e)
	}
}

func (o *choiceOut) close() {}

// end answers the request once every choice has returned, and gives its status.
func (set *choiceSet) end(codes []int) int {
	set.mu.Lock()
	defer set.mu.Unlock()
	if set.sse != nil {
		set.sse.stopKeepAlive()
	}
	if e := set.failed; e != nil {
		if !set.started && e.Status != statusClientClosed {
			e.write(set.w)
		}
		return e.Status
	}
	for _, c := range codes {
		if c != http.StatusOK {
			return c // a choice's client went away, or the request was cut short
		}
	}
	if set.sse != nil {
		return http.StatusOK
	}
	res := make([]choiceResult, len(set.state))
	for i := range set.state {
		res[i] = set.state[i].acc.result(set.state[i].reason)
	}
	if err := writeBody(set.w, set.head, set.j.endpoint == endpointChat, set.j.returnTokenIDs, set.j.lp, res, set.usage()); err != nil {
		return statusClientClosed
	}
	return http.StatusOK
}
