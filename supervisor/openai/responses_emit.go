package openai

import (
	"net/http"
	"strconv"
	"strings"
	"time"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
)

// responsesOutput answers a Responses API request: one response object, or a
// stream of events as vLLM 0.26.0 sends them (`event: <type>` and `data:`
// lines, each event with its type and sequence_number, no [DONE]):
//
//	response.created, response.in_progress (the response, status in_progress)
//	response.output_item.added, response.content_part.added (at the first text)
//	response.output_text.delta (one per engine chunk with text)
//	response.output_text.done, response.content_part.done, response.output_item.done
//	response.completed (the whole response; status incomplete at max_output_tokens)
//
// The output is one assistant message with one output_text part (none when
// there is no text). A stream that fails after its headers ends with an
// `error` event, and no response.completed.
type responsesOutput struct {
	w           http.ResponseWriter
	sse         *sseOutput // a stream's writer, lock and keep-alives; nil for one JSON body
	echo        *responsesEcho
	lp          *lpFormat
	head        responseHead
	msgID       string
	maxTokens   int // the max_tokens sent to the engine (0: until the context is full)
	maxModelLen int

	promptTokens int
	sb           strings.Builder // the text so far
	ids          []uint32        // with logprobs: every token, for the response's logprobs
	lps          []*frmpsv1.TokenLogprobs
	lpSent       int // a stream's tokens whose logprobs went out in a delta
	u            usage
	seq          int  // the next event's sequence_number
	opened       bool // the message item and its part were announced
	done         bool
}

func newResponsesOutput(w http.ResponseWriter, j *job, head responseHead, keepAlive time.Duration, maxModelLen int) *responsesOutput {
	o := &responsesOutput{w: w, echo: j.resp, lp: j.lp, head: head, msgID: "msg_" + randomID(16),
		maxTokens: int(j.gen.GetParams().GetMaxTokens()), maxModelLen: maxModelLen}
	if j.stream {
		o.sse = newSSEOutput(w, j, head, keepAlive)
		o.sse.errorEvent = o.appendError
	}
	return o
}

func (o *responsesOutput) start(promptTokens int) error {
	o.promptTokens = promptTokens
	if o.sse == nil {
		return nil
	}
	if err := o.sse.startChoices(nil); err != nil { // the headers
		return err
	}
	return o.sse.emit(false, func(b []byte) []byte {
		for _, typ := range []string{"response.created", "response.in_progress"} {
			b = o.openEvent(b, typ)
			b = append(b, `"response":`...)
			b = append(o.appendResponse(b, "in_progress", false), ',')
			b = o.closeEvent(b, typ)
		}
		return b
	})
}

func (o *responsesOutput) text(delta string, ids []uint32, lps []*frmpsv1.TokenLogprobs) error {
	o.sb.WriteString(delta)
	if o.lp != nil {
		o.ids = append(o.ids, ids...)
		o.lps = append(o.lps, lps...)
		for len(o.lps) < len(o.ids) { // an engine that sent fewer entries than tokens
			o.lps = append(o.lps, nil)
		}
	}
	if o.sse == nil || delta == "" {
		// As vLLM, no delta without text; a stream's logprobs of these tokens
		// go out with the next delta.
		return nil
	}
	return o.sse.emit(false, func(b []byte) []byte {
		if !o.opened {
			o.opened = true
			b = o.openEvent(b, "response.output_item.added")
			b = append(b, `"item":`...)
			b = o.appendMessage(b, "in_progress", false, false)
			b = append(b, `,"output_index":0,`...)
			b = o.closeEvent(b, "response.output_item.added")
			b = o.openEvent(b, "response.content_part.added")
			b = o.appendPartHead(b)
			b = append(b, `"part":{"annotations":[],"text":"","type":"output_text","logprobs":[]},`...)
			b = o.closeEvent(b, "response.content_part.added")
		}
		b = o.openEvent(b, "response.output_text.delta")
		b = append(b, `"content_index":0,"delta":`...)
		b = appendJSONString(b, delta)
		b = append(b, `,"item_id":`...)
		b = appendJSONString(b, o.msgID)
		b = append(b, `,"logprobs":`...)
		if o.lp != nil {
			b = o.lp.appendList(b, o.ids[o.lpSent:], o.lps[o.lpSent:], false)
			o.lpSent = len(o.ids)
		} else {
			b = append(b, "[]"...)
		}
		b = append(b, `,"output_index":0,`...)
		return o.closeEvent(b, "response.output_text.delta")
	})
}

func (o *responsesOutput) gap(open bool) {
	if o.sse != nil {
		o.sse.gap(open)
	}
}

func (o *responsesOutput) finish(reason string, u usage) error {
	o.done = true
	status := "completed"
	if reason == "length" {
		status = "incomplete" // vLLM: any "length" finish, with reason max_output_tokens
	}
	o.u = u
	if o.sse == nil {
		size := 1536 + o.sb.Len() + o.sb.Len()/8
		if o.lp != nil {
			size += len(o.ids) * (96 + 64*o.lp.top)
		}
		b := append(o.appendResponse(make([]byte, 0, size), status, true), '\n')
		h := o.w.Header()
		h.Set("Content-Type", "application/json")
		h.Set("Content-Length", strconv.Itoa(len(b)))
		o.w.WriteHeader(http.StatusOK)
		_, err := o.w.Write(b)
		return err
	}
	o.sse.stopKeepAlive()
	return o.sse.emit(true, func(b []byte) []byte {
		if o.opened {
			b = o.openEvent(b, "response.output_text.done")
			b = append(b, `"content_index":0,"item_id":`...)
			b = appendJSONString(b, o.msgID)
			b = append(b, `,"logprobs":[],"output_index":0,"text":`...)
			b = appendJSONString(b, o.sb.String())
			b = append(b, ',')
			b = o.closeEvent(b, "response.output_text.done")
			b = o.openEvent(b, "response.content_part.done")
			b = o.appendPartHead(b)
			b = append(b, `"part":`...)
			b = append(o.appendPart(b, false), ',')
			b = o.closeEvent(b, "response.content_part.done")
			b = o.openEvent(b, "response.output_item.done")
			b = append(b, `"item":`...)
			b = o.appendMessage(b, "completed", true, false)
			b = append(b, `,"output_index":0,`...)
			b = o.closeEvent(b, "response.output_item.done")
		}
		b = o.openEvent(b, "response.completed")
		b = append(b, `"response":`...)
		b = o.appendResponse(b, status, true)
		b = append(b, ',')
		return o.closeEvent(b, "response.completed")
	})
}

func (o *responsesOutput) fail(e *apiError) {
	if o.sse != nil {
		o.sse.fail(e)
		return
	}
	if !o.done {
		o.done = true
		e.write(o.w)
	}
}

func (o *responsesOutput) close() {
	if o.sse != nil {
		o.sse.close()
	}
}

// openEvent starts event typ: its SSE lines up to the data object's first field.
func (o *responsesOutput) openEvent(b []byte, typ string) []byte {
	b = append(b, "event: "...)
	b = append(b, typ...)
	return append(b, "\ndata: {"...)
}

// closeEvent ends event typ, whose fields so far end with a comma: its
// sequence_number and type, as vLLM's events end.
func (o *responsesOutput) closeEvent(b []byte, typ string) []byte {
	b = append(b, `"sequence_number":`...)
	b = strconv.AppendInt(b, int64(o.seq), 10)
	o.seq++
	b = append(b, `,"type":"`...)
	b = append(b, typ...)
	return append(b, "\"}\n\n"...)
}

// appendError is the stream's last event when it fails after its headers:
// OpenAI's error event ({type: error, code, message, param, sequence_number}),
// which also carries the error object as the other endpoints' streams do, so
// that a client which raises on `"error"` in an event (OpenAI's SDK) raises here too.
func (o *responsesOutput) appendError(b []byte, e *apiError) []byte {
	b = o.openEvent(b, "error")
	b = append(b, `"code":`...)
	b = appendNullableString(b, e.Code)
	b = append(b, `,"message":`...)
	b = appendJSONString(b, e.Message)
	b = append(b, `,"param":`...)
	b = appendNullableString(b, e.Param)
	b = append(b, `,"error":`...)
	b = append(e.appendObject(b), ',')
	return o.closeEvent(b, "error")
}

// appendPartHead appends the fields that locate the message's one part.
func (o *responsesOutput) appendPartHead(b []byte) []byte {
	b = append(b, `"content_index":0,"item_id":`...)
	b = appendJSONString(b, o.msgID)
	return append(b, `,"output_index":0,`...)
}

// appendPart appends the output_text part with the text so far; its logprobs
// (when asked for) only in the final response, null elsewhere, as vLLM.
func (o *responsesOutput) appendPart(b []byte, withLogprobs bool) []byte {
	b = append(b, `{"annotations":[],"text":`...)
	b = appendJSONString(b, o.sb.String())
	b = append(b, `,"type":"output_text","logprobs":`...)
	if withLogprobs && o.lp != nil {
		b = o.lp.appendList(b, o.ids, o.lps, true)
	} else {
		b = append(b, "null"...)
	}
	return append(b, '}')
}

// appendMessage appends the output message; with content, its part (none
// while it is being announced, or when there is no text).
func (o *responsesOutput) appendMessage(b []byte, status string, content, withLogprobs bool) []byte {
	b = append(b, `{"id":`...)
	b = appendJSONString(b, o.msgID)
	b = append(b, `,"content":[`...)
	if content && o.sb.Len() > 0 {
		b = o.appendPart(b, withLogprobs)
	}
	b = append(b, `],"role":"assistant","status":`...)
	b = appendJSONString(b, status)
	return append(b, `,"type":"message"}`...)
}

// maxOutputTokens is the response's max_output_tokens as vLLM gives it: the
// tokens the request may generate, the request's limit or the room left in
// the context, whichever is less; 0 when not known.
func (o *responsesOutput) maxOutputTokens() int {
	n := o.maxTokens
	if o.maxModelLen > 0 && o.promptTokens > 0 {
		if room := o.maxModelLen - o.promptTokens; n == 0 || room < n {
			n = room
		}
	}
	return n
}

// appendResponse appends the response object: status and, when final, the
// output and usage (before, output [] and usage null, as vLLM's first events).
func (o *responsesOutput) appendResponse(b []byte, status string, final bool) []byte {
	ec := o.echo
	b = append(b, `{"id":`...)
	b = appendJSONString(b, o.head.id)
	b = append(b, `,"created_at":`...)
	b = strconv.AppendInt(b, o.head.created, 10)
	b = append(b, `,"incomplete_details":`...)
	if status == "incomplete" {
		b = append(b, `{"reason":"max_output_tokens"}`...)
	} else {
		b = append(b, "null"...)
	}
	b = append(b, ',')
	b = append(b, ec.instructionsMetadata...)
	b = append(b, `"model":`...)
	b = appendJSONString(b, o.head.model)
	b = append(b, `,"object":"response","output":[`...)
	if final {
		b = o.appendMessage(b, "completed", true, true)
	}
	b = append(b, "],"...)
	b = append(b, ec.toolsSampling...)
	b = append(b, `"max_output_tokens":`...)
	if n := o.maxOutputTokens(); n > 0 {
		b = strconv.AppendInt(b, int64(n), 10)
	} else {
		b = append(b, "null"...)
	}
	b = append(b, ',')
	b = append(b, ec.afterMaxTokens...)
	b = append(b, `"status":`...)
	b = appendJSONString(b, status)
	b = append(b, ',')
	b = append(b, ec.afterStatus...)
	b = append(b, `"usage":`...)
	if final {
		b = o.appendUsage(b)
	} else {
		b = append(b, "null"...)
	}
	b = append(b, ',')
	return append(b, ec.afterUsage...)
}

// appendUsage appends the response's usage in vLLM's shape (no cached, reasoning
// or tool tokens here; the per-turn lists are empty for a one-turn response).
func (o *responsesOutput) appendUsage(b []byte) []byte {
	b = append(b, `{"input_tokens":`...)
	b = strconv.AppendInt(b, int64(o.u.prompt), 10)
	b = append(b, `,"input_tokens_details":{"cached_tokens":0,"input_tokens_per_turn":[],"cached_tokens_per_turn":[]},"output_tokens":`...)
	b = strconv.AppendInt(b, int64(o.u.completion), 10)
	b = append(b, `,"output_tokens_details":{"reasoning_tokens":0,"tool_output_tokens":0,"output_tokens_per_turn":[],"tool_output_tokens_per_turn":[]},"total_tokens":`...)
	b = strconv.AppendInt(b, int64(o.u.prompt+o.u.completion), 10)
	return append(b, '}')
}
