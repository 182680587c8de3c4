package openai

import (
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
)

type usage struct{ prompt, completion int }

func appendUsage(b []byte, u usage) []byte {
	b = append(b, `{"prompt_tokens":`...)
	b = strconv.AppendInt(b, int64(u.prompt), 10)
	b = append(b, `,"completion_tokens":`...)
	b = strconv.AppendInt(b, int64(u.completion), 10)
	b = append(b, `,"total_tokens":`...)
	b = strconv.AppendInt(b, int64(u.prompt+u.completion), 10)
	return append(b, '}')
}

// output is where a request's result goes: an SSE stream or one JSON body.
type output interface {
	// start runs once, on the first engine chunk, after the limits passed and
	// before anything reaches the client; a stream sends its headers here.
	// promptTokens is the prompt's length as the engine counted it.
	start(promptTokens int) error
	// text delivers a text delta, the token ids it came from (already
	// recorded as delivered) and their logprobs where asked for.
	text(delta string, ids []uint32, lps []*frmpsv1.TokenLogprobs) error
	// gap opens (true) or closes (false) a failover gap.
	gap(open bool)
	// finish ends the response successfully.
	finish(reason string, u usage) error
	// fail ends the response with an error: a JSON error response before the
	// headers went out, an in-stream error event (and no [DONE]) after.
	fail(e *apiError)
	// close releases what the output holds; idempotent.
	close()
}

// responseHead is what every chunk or body of a response starts with.
type responseHead struct {
	id      string
	object  string
	created int64
	model   string
}

func (h *responseHead) append(b []byte) []byte {
	b = append(b, `{"id":`...)
	b = appendJSONString(b, h.id)
	b = append(b, `,"object":`...)
	b = appendJSONString(b, h.object)
	b = append(b, `,"created":`...)
	b = strconv.AppendInt(b, h.created, 10)
	b = append(b, `,"model":`...)
	b = appendJSONString(b, h.model)
	return append(b, ',')
}

// streamChoice is what a stream keeps per choice.
type streamChoice struct {
	head     []byte     // `data: {"id":...,"choices":[{"index":i,`
	echo     string     // still to put before the choice's first text
	lpOffset int        // completions' text_offset of the next token
	u        usage      // the choice's usage so far (continuous_usage_stats)
	tools    toolStream // chat with tool calling: the choice's parser, else nil
}

// sseOutput streams chunks as server-sent events.
type sseOutput struct {
	w            http.ResponseWriter
	flusher      http.Flusher
	chat         bool
	includeUsage bool
	returnIDs    bool
	keepAlive    time.Duration

	mu      sync.Mutex // the keep-alive goroutine writes too
	started bool
	ended   bool
	err     error
	buf     []byte
	head    responseHead
	lp      *lpFormat // logprobs asked for, else nil
	// continuousUsage: vLLM's stream_options.continuous_usage_stats, the
	// choice's usage so far in every chunk.
	continuousUsage bool
	tools           *toolPlan    // tool calling, else nil
	own             streamChoice // the one choice's stream state (a request with several: choices.go)
	// errorEvent appends the event that ends a stream failing after its
	// headers; nil: `data: {"error":{…}}`, chat's and completions'.
	errorEvent func(b []byte, e *apiError) []byte

	kaStop chan struct{}
	kaDone chan struct{}
}

func newSSEOutput(w http.ResponseWriter, j *job, head responseHead, keepAlive time.Duration) *sseOutput {
	o := &sseOutput{w: w, chat: j.endpoint == endpointChat, includeUsage: j.includeUsage, returnIDs: j.returnTokenIDs, keepAlive: keepAlive, head: head, lp: j.lp,
		continuousUsage: j.continuousUsage, tools: j.tools}
	o.flusher, _ = w.(http.Flusher)
	o.own = streamChoice{head: o.choiceHead(0), echo: j.echo, tools: j.tools.newStream()}
	o.buf = make([]byte, 0, 512)
	return o
}

// choiceHead is what every chunk of choice i starts with.
func (o *sseOutput) choiceHead(i int) []byte {
	b := append([]byte("data: "), o.head.append(nil)...)
	b = append(b, `"choices":[{"index":`...)
	b = strconv.AppendInt(b, int64(i), 10)
	return append(b, ',')
}

// writeLocked writes o.buf and flushes; o.mu held.
func (o *sseOutput) writeLocked() error {
	if o.err != nil {
		return o.err
	}
	if _, err := o.w.Write(o.buf); err != nil {
		o.err = err
		return err
	}
	if o.flusher != nil {
		o.flusher.Flush()
	}
	return nil
}

func (o *sseOutput) start(promptTokens int) error {
	o.own.u.prompt = promptTokens
	return o.startChoices([]*streamChoice{&o.own})
}

// startChoices sends the headers and, for chat, the assistant's role for each
// choice, as OpenAI's streams open.
func (o *sseOutput) startChoices(choices []*streamChoice) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	h := o.w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-cache")
	h.Set("X-Accel-Buffering", "no") // keep reverse proxies from buffering the stream
	o.w.WriteHeader(http.StatusOK)
	o.started = true
	if !o.chat {
		if o.flusher != nil {
			o.flusher.Flush()
		}
		return nil
	}
	o.buf = o.buf[:0]
	for _, c := range choices {
		o.buf = append(o.buf, c.head...)
		o.buf = append(o.buf, `"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]`...)
		o.buf = o.appendTail(o.buf, c)
	}
	return o.writeLocked()
}

// appendTail ends a chunk of choice c: its usage so far with continuous_usage_stats,
// else null when usage was asked for.
func (o *sseOutput) appendTail(b []byte, c *streamChoice) []byte {
	if o.includeUsage {
		if o.continuousUsage {
			b = append(b, `,"usage":`...)
			b = appendUsage(b, c.u)
		} else {
			b = append(b, `,"usage":null`...)
		}
	}
	return append(b, "}\n\n"...)
}

func appendTokenIDs(b []byte, ids []uint32) []byte {
	b = append(b, `,"token_ids":[`...)
	for i, id := range ids {
		if i > 0 {
			b = append(b, ',')
		}
		b = strconv.AppendUint(b, uint64(id), 10)
	}
	return append(b, ']')
}

// text writes one chunk per engine message that carries tokens, with its text
// (possibly empty: a token that ends inside a UTF-8 character, or a special
// token), as vLLM's server streams one chunk per step's output: a client's
// inter-token latency then counts the engine's steps, not the detokeniser's
// hold-backs. A message with neither text nor tokens writes nothing.
func (o *sseOutput) text(delta string, ids []uint32, lps []*frmpsv1.TokenLogprobs) error {
	return o.textAt(&o.own, delta, ids, lps)
}

// textAt writes a text chunk of choice c, its echo first (the first engine chunk,
// the prompt's, comes through here before any token).
func (o *sseOutput) textAt(c *streamChoice, delta string, ids []uint32, lps []*frmpsv1.TokenLogprobs) error {
	if c.tools != nil {
		return o.toolTextAt(c, delta, ids, lps)
	}
	if c.echo != "" {
		delta, c.echo = c.echo+delta, ""
	}
	if delta == "" && len(ids) == 0 {
		return nil
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	c.u.completion += len(ids)
	b := append(o.buf[:0], c.head...)
	if o.chat {
		b = append(b, `"delta":{"content":`...)
		b = appendJSONString(b, delta)
		b = append(b, '}')
	} else {
		b = append(b, `"text":`...)
		b = appendJSONString(b, delta)
	}
	o.buf = o.appendChunkEnd(b, c, ids, lps)
	return o.writeLocked()
}

// appendChunkEnd ends a text chunk of choice c: its token ids and logprobs
// where asked for, no finish reason yet, the tail.
func (o *sseOutput) appendChunkEnd(b []byte, c *streamChoice, ids []uint32, lps []*frmpsv1.TokenLogprobs) []byte {
	if o.returnIDs {
		b = appendTokenIDs(b, ids)
	}
	if o.lp != nil && len(ids) > 0 {
		b = append(b, `,"logprobs":`...)
		b = o.lp.appendValue(b, ids, lps, &c.lpOffset)
		b = append(b, `,"finish_reason":null}]`...)
	} else {
		b = append(b, `,"logprobs":null,"finish_reason":null}]`...)
	}
	return o.appendTail(b, c)
}

func (o *sseOutput) finish(reason string, u usage) error {
	o.stopKeepAlive()
	o.mu.Lock()
	defer o.mu.Unlock()
	b, reason := o.appendToolEnd(o.buf[:0], &o.own, reason)
	o.buf = o.appendEnd(o.appendFinish(b, &o.own, reason), u)
	o.ended = true
	return o.writeLocked()
}

// appendFinish appends the finish chunk of choice c.
func (o *sseOutput) appendFinish(b []byte, c *streamChoice, reason string) []byte {
	b = append(b, c.head...)
	if o.chat {
		b = append(b, `"delta":{}`...)
	} else {
		b = append(b, `"text":""`...)
	}
	b = append(b, `,"logprobs":null,"finish_reason":`...)
	b = appendJSONString(b, reason)
	b = append(b, "}]"...)
	return o.appendTail(b, c)
}

// appendEnd appends the end of a stream: the usage chunk when asked for, and [DONE].
func (o *sseOutput) appendEnd(b []byte, u usage) []byte {
	if o.includeUsage {
		// OpenAI's last chunk: no choices, usage of the whole request.
		b = append(b, "data: "...)
		b = o.head.append(b)
		b = append(b, `"choices":[],"usage":`...)
		b = appendUsage(b, u)
		b = append(b, "}\n\n"...)
	}
	return append(b, "data: [DONE]\n\n"...)
}

// finishChoice writes one choice's finish chunk, and the stream's end when last.
func (o *sseOutput) finishChoice(c *streamChoice, reason string, last bool, u usage) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	b, reason := o.appendToolEnd(o.buf[:0], c, reason)
	b = o.appendFinish(b, c, reason)
	if last {
		b = o.appendEnd(b, u)
		o.ended = true
	}
	o.buf = b
	return o.writeLocked()
}

func (o *sseOutput) fail(e *apiError) {
	o.stopKeepAlive()
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.ended {
		return
	}
	o.ended = true
	if !o.started {
		e.write(o.w)
		return
	}
	// After the headers the status line is gone: an error event, and no
	// [DONE], so no client mistakes the end for a success.
	if o.errorEvent != nil {
		o.buf = o.errorEvent(o.buf[:0], e)
	} else {
		b := append(o.buf[:0], "data: "...)
		b = e.appendJSON(b)
		o.buf = append(b, "\n\n"...)
	}
	_ = o.writeLocked() // the client may be gone; nothing more to tell it
}

// emit writes the events add appends, in one write; last ends the stream
// (a later fail writes nothing). For a stream that shapes its own events.
func (o *sseOutput) emit(last bool, add func(b []byte) []byte) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.buf = add(o.buf[:0])
	if last {
		o.ended = true
	}
	return o.writeLocked()
}

func (o *sseOutput) gap(open bool) {
	if !open {
		o.stopKeepAlive()
		return
	}
	o.mu.Lock()
	started := o.started
	o.mu.Unlock()
	if !started || o.kaStop != nil || o.keepAlive <= 0 {
		return
	}
	o.kaStop, o.kaDone = make(chan struct{}), make(chan struct{})
	go o.keepAliveLoop(o.kaStop, o.kaDone)
}

func (o *sseOutput) keepAliveLoop(stop <-chan struct{}, done chan<- struct{}) {
	defer close(done)
	t := time.NewTicker(o.keepAlive)
	defer t.Stop()
	for {
		select {
		case <-stop:
			return
		case <-t.C:
			o.mu.Lock()
			if o.err == nil && !o.ended {
				if _, err := o.w.Write([]byte(": keep-alive\n\n")); err != nil {
					o.err = err
				} else if o.flusher != nil {
					o.flusher.Flush()
				}
			}
			o.mu.Unlock()
		}
	}
}

// stopKeepAlive is called from the request's own goroutine only.
func (o *sseOutput) stopKeepAlive() {
	if o.kaStop == nil {
		return
	}
	close(o.kaStop)
	<-o.kaDone
	o.kaStop, o.kaDone = nil, nil
}

func (o *sseOutput) close() { o.stopKeepAlive() }

// jsonOutput collects the whole completion and sends one JSON body.
type jsonOutput struct {
	w         http.ResponseWriter
	chat      bool
	returnIDs bool
	head      responseHead
	lp        *lpFormat
	tools     *toolPlan // tool calling, else nil
	echoLen   int       // sb starts with the echo, this long
	sb        strings.Builder
	ids       []uint32
	lps       []*frmpsv1.TokenLogprobs
	done      bool
}

func newJSONOutput(w http.ResponseWriter, j *job, head responseHead) *jsonOutput {
	o := &jsonOutput{w: w, chat: j.endpoint == endpointChat, returnIDs: j.returnTokenIDs, head: head, lp: j.lp, tools: j.tools, echoLen: len(j.echo)}
	o.sb.WriteString(j.echo)
	return o
}

func (o *jsonOutput) start(int) error { return nil }

func (o *jsonOutput) text(delta string, ids []uint32, lps []*frmpsv1.TokenLogprobs) error {
	o.sb.WriteString(delta)
	if o.returnIDs || o.lp != nil {
		o.ids = append(o.ids, ids...)
	}
	if o.lp != nil {
		o.lps = append(o.lps, lps...)
		for len(o.lps) < len(o.ids) { // an engine that sent fewer entries than tokens
			o.lps = append(o.lps, nil)
		}
	}
	return nil
}

func (o *jsonOutput) gap(bool) {}

func (o *jsonOutput) finish(reason string, u usage) error {
	o.done = true
	return writeBody(o.w, o.head, o.chat, o.returnIDs, o.lp, []choiceResult{o.result(reason)}, u)
}

// choiceResult is one finished choice of a JSON body.
type choiceResult struct {
	text   string
	ids    []uint32
	lps    []*frmpsv1.TokenLogprobs
	reason string
	answer *toolAnswer // chat with tool calling: the message, else nil
}

// writeBody sends a whole (non-streamed) response: its choices, index by index.
func writeBody(w http.ResponseWriter, head responseHead, chat, returnIDs bool, lp *lpFormat, choices []choiceResult, u usage) error {
	size := 256
	for _, c := range choices {
		size += 96 + len(c.text) + len(c.text)/8 + 11*len(c.ids)
		if lp != nil {
			size += len(c.ids) * (64 + 32*lp.top)
		}
	}
	b := make([]byte, 0, size)
	b = head.append(b)
	b = append(b, `"choices":[`...)
	for i, c := range choices {
		if i > 0 {
			b = append(b, ',')
		}
		b = append(b, `{"index":`...)
		b = strconv.AppendInt(b, int64(i), 10)
		switch {
		case c.answer != nil:
			b = append(b, ',')
			b = appendToolMessage(b, c.answer)
		case chat:
			b = append(b, `,"message":{"role":"assistant","content":`...)
			b = appendJSONString(b, c.text)
			b = append(b, '}')
		default:
			b = append(b, `,"text":`...)
			b = appendJSONString(b, c.text)
		}
		if returnIDs {
			b = appendTokenIDs(b, c.ids)
		}
		if lp != nil {
			b = append(b, `,"logprobs":`...)
			off := 0
			b = lp.appendValue(b, c.ids, c.lps, &off)
		} else {
			b = append(b, `,"logprobs":null`...)
		}
		b = append(b, `,"finish_reason":`...)
		b = appendJSONString(b, c.reason)
		b = append(b, '}')
	}
	b = append(b, `],"usage":`...)
	b = appendUsage(b, u)
	b = append(b, "}\n"...)
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)))
	w.WriteHeader(http.StatusOK)
	_, err := w.Write(b)
	return err
}

func (o *jsonOutput) fail(e *apiError) {
	if o.done {
		return
	}
	o.done = true
	e.write(o.w)
}

func (o *jsonOutput) close() {}
