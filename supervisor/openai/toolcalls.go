package openai

import (
	"strconv"
	"strings"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
)

// The output side of tool calling: a finished choice's message (toolAnswer)
// and a streamed choice's deltas (toolStream), shaped as vLLM shapes them.

// toolCall is one call of a finished answer.
type toolCall struct{ id, name, args string }

// toolDelta is one entry of a streamed chunk's tool_calls; a call's first
// carries its id, type and name.
type toolDelta struct {
	index   int
	id      string // the call's first delta only
	name    string // with id
	args    string
	hasArgs bool
}

// toolStream turns one choice's streamed text into content and tool-call
// deltas. Its state is the choice's, across failovers.
type toolStream interface {
	// feed reads the next text and says what to send of it.
	feed(text string) (content string, calls []toolDelta)
	// end is called at the finish: what is left to send, and the finish reason.
	end(reason string) (content string, calls []toolDelta, finish string)
}

// newToolCallID is vLLM's id of a call: "chatcmpl-tool-" and 16 hex digits
// (its random_uuid: 64 random bits).
func newToolCallID() string { return "chatcmpl-tool-" + randomID(8) }

// newStream is a choice's stream parser; nil (no parsing) for a nil plan.
func (p *toolPlan) newStream() toolStream {
	if p == nil {
		return nil
	}
	switch p.mode {
	case toolsNamed:
		return &namedStream{name: p.name}
	case toolsRequired:
		return &requiredStream{scan: newCallScan(2, "name", "parameters", false)}
	}
	return &hermesStream{}
}

// keep applies parallel_tool_calls false: the first call's deltas only.
func (p *toolPlan) keep(calls []toolDelta) []toolDelta {
	if p.parallel || len(calls) == 0 {
		return calls
	}
	out := calls[:0]
	for _, c := range calls {
		if c.index == 0 {
			out = append(out, c)
		}
	}
	return out
}

// toolAnswer is a finished choice's message and finish reason.
type toolAnswer struct {
	content string
	null    bool // content is null
	calls   []toolCall
	reason  string
}

// answer reads a finished choice's text as vLLM's full (non-streamed) answer does:
//   - named: the text is the arguments of one call (none when it is blank),
//     content "", the engine's finish reason;
//   - required: the text is a JSON array of {name, parameters} (no call
//     unless all of it reads), content "", finish "tool_calls" when the
//     engine stopped by itself;
//   - auto: the hermes blocks are the calls and the text before them the
//     content (null when blank), finish "tool_calls"; text without a block,
//     or with one that does not read, is all content.
func (p *toolPlan) answer(text, reason string) toolAnswer {
	a := toolAnswer{reason: reason}
	switch p.mode {
	case toolsNamed:
		if strings.TrimSpace(text) != "" {
			a.calls = []toolCall{{id: newToolCallID(), name: p.name, args: text}}
		}
	case toolsRequired:
		a.calls = requiredCalls(text)
		if reason == "stop" {
			a.reason = "tool_calls"
		}
	default:
		content, calls, ok := hermesExtract(text)
		if !ok {
			a.content = text
			break
		}
		a.calls, a.reason = calls, "tool_calls"
		a.content, a.null = content, strings.TrimSpace(content) == ""
		if a.null {
			a.content = ""
		}
	}
	if !p.parallel && len(a.calls) > 1 {
		a.calls = a.calls[:1]
	}
	return a
}

// requiredCalls reads tool_choice "required"'s output, a JSON array of
// {name, parameters}: every item must read (a name, parameters an object or
// null), else there is no call. Arguments are the parameters as Python's
// json.dumps writes them ("null" when absent).
func requiredCalls(text string) []toolCall {
	v, err := parseJNode([]byte(text))
	if err != nil || v.kind != '[' {
		return nil
	}
	out := make([]toolCall, 0, len(v.vals))
	for _, it := range v.vals {
		n := it.get("name")
		if it.kind != '{' || n == nil || n.kind != '"' {
			return nil
		}
		if d := it.get("description"); d != nil && d.kind != 'n' && d.kind != '"' {
			return nil
		}
		args := "null"
		if params := it.get("parameters"); params != nil && params.kind != 'n' {
			if params.kind != '{' {
				return nil
			}
			args = params.pyDumps()
		}
		out = append(out, toolCall{id: newToolCallID(), name: n.str, args: args})
	}
	return out
}

// namedStream: every delta of the text is the arguments of the one call
// (vLLM's streaming of a named tool choice).
type namedStream struct {
	name    string
	started bool
}

func (s *namedStream) feed(text string) (string, []toolDelta) {
	if !s.started {
		s.started = true
		return "", []toolDelta{{id: newToolCallID(), name: s.name, args: text, hasArgs: true}}
	}
	if text == "" {
		return "", nil
	}
	return "", []toolDelta{{args: text, hasArgs: true}}
}

func (s *namedStream) end(reason string) (string, []toolDelta, string) { return "", nil, reason }

// requiredStream reads the JSON array of tool_choice "required" as it comes:
// a call's first delta (id, name and its parameters so far) once its name is
// complete and its parameters have begun, then the parameters' text as it grows.
type requiredStream struct {
	buf      strings.Builder
	scan     *callScan
	sent     []int // per call whose first delta went: bytes of its arguments sent
	streamed bool
}

func (s *requiredStream) feed(text string) (string, []toolDelta) {
	s.buf.WriteString(text)
	all := s.buf.String()
	s.scan.scan(all)
	var out []toolDelta
	for i := range s.scan.calls {
		c := &s.scan.calls[i]
		args := c.args(all, s.scan.pos)
		if i == len(s.sent) {
			name, ok := c.name(all)
			if !ok || (c.argsStart < 0 && !c.closed) {
				break // calls go out in order
			}
			out = append(out, toolDelta{index: i, id: newToolCallID(), name: name, args: args, hasArgs: true})
			s.sent = append(s.sent, len(args))
			continue
		}
		if len(args) > s.sent[i] {
			out = append(out, toolDelta{index: i, args: args[s.sent[i]:], hasArgs: true})
			s.sent[i] = len(args)
		}
	}
	if len(out) > 0 {
		s.streamed = true
	}
	return "", out
}

func (s *requiredStream) end(reason string) (string, []toolDelta, string) {
	if s.streamed {
		return "", nil, "tool_calls"
	}
	return "", nil, reason
}

// appendToolDelta appends a chunk's delta: its content when there is some,
// then its tool calls.
func appendToolDelta(b []byte, content string, calls []toolDelta) []byte {
	b = append(b, `"delta":{`...)
	if content != "" {
		b = append(b, `"content":`...)
		b = appendJSONString(b, content)
	}
	if len(calls) > 0 {
		if content != "" {
			b = append(b, ',')
		}
		b = append(b, `"tool_calls":[`...)
		for i, c := range calls {
			if i > 0 {
				b = append(b, ',')
			}
			b = append(b, '{')
			if c.id != "" {
				b = append(b, `"id":`...)
				b = appendJSONString(b, c.id)
				b = append(b, `,"type":"function",`...)
			}
			b = append(b, `"index":`...)
			b = strconv.AppendInt(b, int64(c.index), 10)
			b = append(b, `,"function":{`...)
			if c.id != "" {
				b = append(b, `"name":`...)
				b = appendJSONString(b, c.name)
				if c.hasArgs {
					b = append(b, ',')
				}
			}
			if c.hasArgs {
				b = append(b, `"arguments":`...)
				b = appendJSONString(b, c.args)
			}
			b = append(b, "}}"...)
		}
		b = append(b, ']')
	}
	return append(b, '}')
}

// appendToolMessage appends a finished choice's message with tool calling.
func appendToolMessage(b []byte, a *toolAnswer) []byte {
	b = append(b, `"message":{"role":"assistant","content":`...)
	if a.null {
		b = append(b, "null"...)
	} else {
		b = appendJSONString(b, a.content)
	}
	if len(a.calls) > 0 {
		b = append(b, `,"tool_calls":[`...)
		for i, c := range a.calls {
			if i > 0 {
				b = append(b, ',')
			}
			b = append(b, `{"id":`...)
			b = appendJSONString(b, c.id)
			b = append(b, `,"type":"function","function":{"name":`...)
			b = appendJSONString(b, c.name)
			b = append(b, `,"arguments":`...)
			b = appendJSONString(b, c.args)
			b = append(b, "}}"...)
		}
		b = append(b, ']')
	}
	return append(b, '}')
}

// toolTextAt is textAt for a choice whose output is read for tool calls: it
// writes what the parser releases (nothing while it holds text back, unless
// the chunk's token ids or logprobs were asked for).
func (o *sseOutput) toolTextAt(c *streamChoice, delta string, ids []uint32, lps []*frmpsv1.TokenLogprobs) error {
	content, calls := c.tools.feed(delta)
	calls = o.tools.keep(calls)
	if c.echo != "" {
		content, c.echo = c.echo+content, ""
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	c.u.completion += len(ids)
	if content == "" && len(calls) == 0 && !o.returnIDs && (o.lp == nil || len(ids) == 0) {
		return nil
	}
	b := append(o.buf[:0], c.head...)
	b = appendToolDelta(b, content, calls)
	o.buf = o.appendChunkEnd(b, c, ids, lps)
	return o.writeLocked()
}

// appendToolEnd appends, for a choice read for tool calls, what its parser
// releases at the finish, and gives the finish reason to send; o.mu held.
func (o *sseOutput) appendToolEnd(b []byte, c *streamChoice, reason string) ([]byte, string) {
	if c.tools == nil {
		return b, reason
	}
	content, calls, reason := c.tools.end(reason)
	calls = o.tools.keep(calls)
	if c.echo != "" {
		content, c.echo = c.echo+content, ""
	}
	if content == "" && len(calls) == 0 {
		return b, reason
	}
	b = append(b, c.head...)
	b = appendToolDelta(b, content, calls)
	b = append(b, `,"logprobs":null,"finish_reason":null}]`...)
	return o.appendTail(b, c), reason
}

// result is a finished choice of a JSON body: its text, and with tool calling
// its message (content after the echo, calls, finish reason).
func (o *jsonOutput) result(reason string) choiceResult {
	r := choiceResult{text: o.sb.String(), ids: o.ids, lps: o.lps, reason: reason}
	if o.tools != nil {
		a := o.tools.answer(r.text[o.echoLen:], reason)
		if o.echoLen > 0 {
			a.content, a.null = r.text[:o.echoLen]+a.content, false
		}
		r.answer, r.reason = &a, a.reason
	}
	return r
}
