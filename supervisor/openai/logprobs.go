package openai

import (
	"math"
	"strconv"
	"unicode/utf8"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
)

// maxLogprobs bounds logprobs / top_logprobs, as vLLM's default max_logprobs.
const maxLogprobs = 20

// lpFormat writes a choice's "logprobs" in OpenAI's shapes, as vLLM fills
// them: for completions {text_offset, token_logprobs, tokens, top_logprobs}
// with each position's top as an object of the sampled token and the top
// tokens (top + 1 entries); for chat {content: [{token, logprob, bytes,
// top_logprobs: [{token, logprob, bytes}]}]} with the top cut to top (the
// sampled token first, as vLLM lists it).
type lpFormat struct {
	chat  bool
	asIDs bool // vLLM's return_tokens_as_token_ids: tokens as "token_id:N"
	top   int
}

func (f *lpFormat) token(id uint32, text string) string {
	if f.asIDs {
		return "token_id:" + strconv.FormatUint(uint64(id), 10)
	}
	return text
}

// appendFloat writes a log probability; -inf (and NaN) as -9999.0, as vLLM clamps.
func appendLogprob(b []byte, v float32) []byte {
	if math.IsInf(float64(v), 0) || math.IsNaN(float64(v)) || v < -9999 {
		return append(b, "-9999.0"...)
	}
	return strconv.AppendFloat(b, float64(v), 'g', -1, 32)
}

func appendBytes(b []byte, s string) []byte {
	b = append(b, '[')
	for i := 0; i < len(s); i++ {
		if i > 0 {
			b = append(b, ',')
		}
		b = strconv.AppendUint(b, uint64(s[i]), 10)
	}
	return append(b, ']')
}

// tops lists a position's tokens as vLLM orders them: the sampled token, then
// the most likely ones without it, at most n.
func (f *lpFormat) tops(id uint32, e *frmpsv1.TokenLogprobs, n int, each func(id uint32, text string, lp float32)) {
	if n <= 0 {
		return
	}
	each(id, e.GetToken(), e.GetLogprob())
	n--
	ids, lps, texts := e.GetTopIds(), e.GetTopLogprobs(), e.GetTopTokens()
	for i := 0; i < len(ids) && n > 0; i++ {
		if ids[i] == id || i >= len(lps) {
			continue
		}
		text := ""
		if i < len(texts) {
			text = texts[i]
		}
		each(ids[i], text, lps[i])
		n--
	}
}

// appendValue appends the value of a choice's "logprobs" for ids (one entry of
// lps each); offset is the text offset of the first token (completions), moved
// past these tokens.
func (f *lpFormat) appendValue(b []byte, ids []uint32, lps []*frmpsv1.TokenLogprobs, offset *int) []byte {
	if f.chat {
		b = append(b, `{"content":`...)
		return append(f.appendList(b, ids, lps, true), '}')
	}
	b = append(b, `{"text_offset":[`...)
	for i, id := range ids {
		if i > 0 {
			b = append(b, ',')
		}
		b = strconv.AppendInt(b, int64(*offset), 10)
		*offset += utf8.RuneCountInString(f.token(id, entry(lps, i).GetToken()))
	}
	b = append(b, `],"token_logprobs":[`...)
	for i := range ids {
		if i > 0 {
			b = append(b, ',')
		}
		b = appendLogprob(b, entry(lps, i).GetLogprob())
	}
	b = append(b, `],"tokens":[`...)
	for i, id := range ids {
		if i > 0 {
			b = append(b, ',')
		}
		b = appendJSONString(b, f.token(id, entry(lps, i).GetToken()))
	}
	b = append(b, `],"top_logprobs":[`...)
	for i, id := range ids {
		if i > 0 {
			b = append(b, ',')
		}
		b = append(b, '{')
		seen := make(map[string]bool, f.top+1)
		f.tops(id, entry(lps, i), f.top+1, func(tid uint32, text string, lp float32) {
			t := f.token(tid, text)
			if seen[t] { // two ids with one text: an object keeps one key
				return
			}
			if len(seen) > 0 {
				b = append(b, ',')
			}
			seen[t] = true
			b = appendJSONString(b, t)
			b = append(b, ':')
			b = appendLogprob(b, lp)
		})
		b = append(b, '}')
	}
	return append(b, "]}"...)
}

// appendList appends chat's list of logprobs, one {token, logprob, bytes,
// top_logprobs: [{token, logprob, bytes}]} per token (also the Responses API's
// output_text logprobs); without bytes, the objects leave "bytes" out (the
// Responses API's stream deltas).
func (f *lpFormat) appendList(b []byte, ids []uint32, lps []*frmpsv1.TokenLogprobs, bytes bool) []byte {
	b = append(b, '[')
	for i, id := range ids {
		e := entry(lps, i)
		if i > 0 {
			b = append(b, ',')
		}
		b = appendChatLogprob(b, f.token(id, e.GetToken()), e.GetLogprob(), bytes)
		b = append(b, `,"top_logprobs":[`...)
		first := true
		f.tops(id, e, f.top, func(tid uint32, text string, lp float32) {
			if !first {
				b = append(b, ',')
			}
			first = false
			b = append(appendChatLogprob(b, f.token(tid, text), lp, bytes), '}')
		})
		b = append(b, "]}"...)
	}
	return append(b, ']')
}

// appendChatLogprob opens one of chat's {token, logprob, bytes, ...} objects
// (without bytes when not bytes); the caller adds what else it holds and closes it.
func appendChatLogprob(b []byte, tok string, lp float32, bytes bool) []byte {
	b = append(b, `{"token":`...)
	b = appendJSONString(b, tok)
	b = append(b, `,"logprob":`...)
	b = appendLogprob(b, lp)
	if !bytes {
		return b
	}
	b = append(b, `,"bytes":`...)
	return appendBytes(b, tok)
}

// entry is lps[i], or an empty entry where the engine sent fewer than the tokens.
func entry(lps []*frmpsv1.TokenLogprobs, i int) *frmpsv1.TokenLogprobs {
	if i < len(lps) {
		return lps[i]
	}
	return &frmpsv1.TokenLogprobs{}
}
