package openai

import "strings"

// The hermes tool-call format (Qwen2.5's, and vLLM's --tool-call-parser
// hermes): the model writes each call as
//
//	<tool_call>
//	{"name": "get_weather", "arguments": {"city": "Paris"}}
//	</tool_call>
//
// after an optional text, which is the answer's content.

const (
	hermesOpen  = "<tool_call>"
	hermesClose = "</tool_call>"
)

// hermesBodies splits text at its <tool_call> blocks: the text before the
// first, and each block's body (a block that is never closed runs to the end).
// ok false: no block.
func hermesBodies(text string) (before string, bodies []string, ok bool) {
	first := strings.Index(text, hermesOpen)
	if first < 0 {
		return text, nil, false
	}
	for pos := first; ; {
		i := strings.Index(text[pos:], hermesOpen)
		if i < 0 {
			break
		}
		start := pos + i + len(hermesOpen)
		j := strings.Index(text[start:], hermesClose)
		if j < 0 {
			bodies = append(bodies, text[start:])
			break
		}
		bodies = append(bodies, text[start:start+j])
		pos = start + j + len(hermesClose)
	}
	return text[:first], bodies, true
}

// hermesExtract reads a finished output: the text before the first block and
// one call per block, each block a JSON object with a string "name" and
// "arguments" (any value, written back as Python's json.dumps writes it). ok
// false when there is no block or any block does not read: the output is then
// all content (vLLM's extract_tool_calls).
func hermesExtract(text string) (content string, calls []toolCall, ok bool) {
	before, bodies, found := hermesBodies(text)
	if !found {
		return text, nil, false
	}
	calls = make([]toolCall, 0, len(bodies))
	for _, body := range bodies {
		v, err := parseJNode([]byte(body))
		if err != nil || v.kind != '{' {
			return text, nil, false
		}
		name, args := v.get("name"), v.get("arguments")
		if name == nil || name.kind != '"' || args == nil {
			return text, nil, false
		}
		calls = append(calls, toolCall{id: newToolCallID(), name: name.str, args: args.pyDumps()})
	}
	return before, calls, true
}

// partialTagOverlap is the length of the longest proper prefix of tag that
// ends text (text may end with the start of tag: hold it back).
func partialTagOverlap(text, tag string) int {
	for k := min(len(tag)-1, len(text)); k > 0; k-- {
		if strings.HasSuffix(text, tag[:k]) {
			return k
		}
	}
	return 0
}

// hermesStream reads the format as it is generated, as vLLM's hermes parser
// streams it: content until a <tool_call> begins (holding back a suffix that
// may be the tag's start), then per block, in order, a first delta with the
// call's id and name once the name is complete, and the arguments' text as it
// grows (the text of the "arguments" value as the model wrote it). A block
// whose name never comes stops the reading of later blocks. Each byte is read
// once: the blocks' JSON is scanned incrementally.
type hermesStream struct {
	pending string // content held back: it may be the start of <tool_call>
	inCalls bool   // a <tool_call> was seen: no more content
	buf     strings.Builder
	// The current block: its body starts at start in buf; closeAt is where its
	// </tool_call> is (-1: not seen; closeFrom: where to look for it next).
	start, closeAt, closeFrom int
	between                   bool // the current block is done; looking for the next <tool_call> from openFrom
	openFrom                  int
	n                         int // the current block's index
	scan                      *callScan
	named                     bool // the current block's first delta went
	argsSent                  int
	stopped                   bool // a closed block without a name: later blocks are not read
	streamed                  bool
}

func (h *hermesStream) feed(delta string) (string, []toolDelta) {
	if !h.inCalls {
		s := h.pending + delta
		i := strings.Index(s, hermesOpen)
		if i < 0 {
			k := partialTagOverlap(s, hermesOpen)
			h.pending = s[len(s)-k:]
			return s[:len(s)-k], nil
		}
		h.inCalls, h.pending = true, ""
		h.buf.WriteString(s[i+len(hermesOpen):])
		h.startBlock(0)
		return s[:i], h.calls()
	}
	h.buf.WriteString(delta)
	return "", h.calls()
}

func (h *hermesStream) startBlock(at int) {
	h.start, h.closeAt, h.closeFrom = at, -1, at
	h.between, h.named, h.argsSent = false, false, 0
	h.scan = newCallScan(1, "name", "arguments", true)
}

// calls reads what the blocks released since the last call.
func (h *hermesStream) calls() []toolDelta {
	var out []toolDelta
	text := h.buf.String()
	for !h.stopped {
		if h.between {
			i := strings.Index(text[h.openFrom:], hermesOpen)
			if i < 0 {
				h.openFrom = max(h.openFrom, len(text)-len(hermesOpen)+1)
				break
			}
			h.n++
			h.startBlock(h.openFrom + i + len(hermesOpen))
		}
		if h.closeAt < 0 {
			if j := strings.Index(text[h.closeFrom:], hermesClose); j >= 0 {
				h.closeAt = h.closeFrom + j
			} else {
				h.closeFrom = max(h.closeFrom, len(text)-len(hermesClose)+1)
			}
		}
		limit := h.closeAt
		if limit < 0 {
			limit = len(text) - partialTagOverlap(text[h.start:], hermesClose)
		}
		body := text[h.start:limit]
		h.scan.scan(body)
		var c *scannedCall
		if len(h.scan.calls) > 0 {
			c = &h.scan.calls[0]
		}
		if !h.named {
			name, ok := "", false
			if c != nil {
				name, ok = c.name(body)
			}
			if !ok {
				h.stopped = h.closeAt >= 0
				break
			}
			h.named = true
			out = append(out, toolDelta{index: h.n, id: newToolCallID(), name: name})
		}
		if args := c.args(body, len(body)); len(args) > h.argsSent {
			out = append(out, toolDelta{index: h.n, args: args[h.argsSent:], hasArgs: true})
			h.argsSent = len(args)
		}
		if h.closeAt < 0 {
			break
		}
		h.between, h.openFrom = true, h.closeAt+len(hermesClose)
	}
	if len(out) > 0 {
		h.streamed = true
	}
	return out
}

// end releases content held back as a possible tag start that never became
// one (vLLM drops it), and gives "tool_calls" once a call was streamed.
func (h *hermesStream) end(reason string) (string, []toolDelta, string) {
	content := h.pending
	h.pending = ""
	if h.streamed {
		return content, nil, "tool_calls"
	}
	return content, nil, reason
}
