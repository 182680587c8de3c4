package openai

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"strconv"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
)

// vLLM's tokenizer routes, answered by the current engine with the tokenizer
// (and chat template) its Generate uses: /tokenize {model, prompt | messages,
// add_generation_prompt, tools} → {count, max_model_len, tokens, token_strs: null};
// /detokenize {model, tokens} → {prompt}. Unlike vLLM's they need the API key
// when one is set: they are not probes.

type tokenizeBody struct {
	Model               *string         `json:"model"`
	Prompt              json.RawMessage `json:"prompt"`
	Messages            json.RawMessage `json:"messages"`
	AddGenerationPrompt *bool           `json:"add_generation_prompt"`
	Tokens              []int64         `json:"tokens"`
	Tools               json.RawMessage `json:"tools"` // chat form: for the chat template, as vLLM's /tokenize takes them
}

func (s *Server) handleTokenize(w http.ResponseWriter, r *http.Request) {
	s.tokenizerRoute(w, r, "tokenize", func(ctx context.Context, eng Engine, b *tokenizeBody) ([]byte, *apiError) {
		req := &frmpsv1.TokenizeRequest{}
		switch {
		case len(b.Messages) != 0 && !isNull(b.Messages):
			msgs, e := parseMessages(b.Messages)
			if e != nil {
				return nil, e
			}
			req.Input = &frmpsv1.TokenizeRequest_Messages{Messages: &frmpsv1.ChatMessages{Messages: msgs}}
			req.AddGenerationPrompt = b.AddGenerationPrompt == nil || *b.AddGenerationPrompt
			if req.ToolsJson, e = toolsForTokenize(b.Tools); e != nil {
				return nil, e
			}
		case len(b.Prompt) != 0 && !isNull(b.Prompt):
			var p string
			if err := json.Unmarshal(b.Prompt, &p); err != nil {
				return nil, badRequest("prompt", "`prompt` must be a string.")
			}
			req.Input = &frmpsv1.TokenizeRequest_Prompt{Prompt: p}
		default:
			return nil, badRequest("prompt", "You must provide a `prompt` or `messages`.")
		}
		ids, err := eng.Client.Tokenize(ctx, req)
		if err != nil {
			return nil, tokenizerError(err, s.cfg.RetryAfter)
		}
		out := []byte(`{"count":`)
		out = strconv.AppendInt(out, int64(len(ids.GetIds())), 10)
		out = append(out, `,"max_model_len":`...)
		out = strconv.AppendInt(out, int64(s.modelInfo().MaxModelLen), 10)
		out = append(out, `,"tokens":[`...)
		for i, id := range ids.GetIds() {
			if i > 0 {
				out = append(out, ',')
			}
			out = strconv.AppendUint(out, uint64(id), 10)
		}
		return append(out, "],\"token_strs\":null}\n"...), nil
	})
}

func (s *Server) handleDetokenize(w http.ResponseWriter, r *http.Request) {
	s.tokenizerRoute(w, r, "detokenize", func(ctx context.Context, eng Engine, b *tokenizeBody) ([]byte, *apiError) {
		ids := make([]uint32, len(b.Tokens))
		for i, t := range b.Tokens {
			if t < 0 || t > math.MaxUint32 {
				return nil, badRequest("tokens", fmt.Sprintf("tokens[%d] is not a valid token id.", i))
			}
			ids[i] = uint32(t)
		}
		text, err := eng.Client.Detokenize(ctx, &frmpsv1.TokenIds{Ids: ids})
		if err != nil {
			return nil, tokenizerError(err, s.cfg.RetryAfter)
		}
		out := appendJSONString([]byte(`{"prompt":`), text.GetText())
		return append(out, "}\n"...), nil
	})
}

// tokenizerRoute reads and checks a tokenizer route's body, waits for an
// engine and writes what answer gives.
func (s *Server) tokenizerRoute(w http.ResponseWriter, r *http.Request, label string,
	answer func(context.Context, Engine, *tokenizeBody) ([]byte, *apiError)) {
	code := s.tokenizerRouteInner(w, r, answer)
	s.m.requests.WithLabelValues(label, strconv.Itoa(code)).Inc()
}

func (s *Server) tokenizerRouteInner(w http.ResponseWriter, r *http.Request,
	answer func(context.Context, Engine, *tokenizeBody) ([]byte, *apiError)) int {
	fail := func(e *apiError) int {
		e.write(w)
		return e.Status
	}
	if r.Method != http.MethodPost {
		methodNotAllowed(w, http.MethodPost)
		return http.StatusMethodNotAllowed
	}
	if !s.enter() {
		return fail(unavailable(s.cfg.RetryAfter, "server shutting down"))
	}
	defer s.leave()
	raw, e := s.readBody(w, r)
	if e != nil {
		return fail(e)
	}
	var b tokenizeBody
	if e := decodeBody(raw, &b); e != nil {
		return fail(e)
	}
	if e := checkModel(b.Model, s.model.Name); e != nil {
		return fail(e)
	}
	ctx, cancel := context.WithTimeout(r.Context(), s.cfg.EngineWaitTimeout)
	defer cancel()
	eng, err := s.currentEngine(ctx, 0)
	if err != nil {
		return s.failEarly(r.Context(), &jsonOutput{w: w}, err)
	}
	out, e := answer(ctx, eng, &b)
	if e != nil {
		return fail(e)
	}
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write(out)
	return http.StatusOK
}

// tokenizerError maps an engine's answer to a tokenizer call.
func tokenizerError(err error, retryAfter int) *apiError {
	switch status.Code(err) {
	case codes.Unimplemented:
		return &apiError{Status: 501, Type: typeServer, Code: "not_implemented", Message: "The engine has no tokenizer route: " + status.Convert(err).Message()}
	case codes.Unavailable, codes.Canceled, codes.DeadlineExceeded:
		return unavailable(retryAfter, "the engine did not answer: "+status.Convert(err).Message())
	}
	return engineError(err, retryAfter)
}

// detokenizeEchoes turns the echo of each prompt given as token ids into its
// text, by the current engine's tokenizer, before the request starts.
func (s *Server) detokenizeEchoes(ctx context.Context, j *job) *apiError {
	need := j.echoIDs != nil
	for _, c := range j.choices {
		need = need || c.echoIDs != nil
	}
	if !need {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, s.cfg.EngineWaitTimeout)
	defer cancel()
	eng, err := s.currentEngine(ctx, 0)
	if err != nil {
		return unavailable(s.cfg.RetryAfter, "no engine to detokenize the prompt to echo: "+err.Error())
	}
	detok := func(ids []uint32) (string, *apiError) {
		r, err := eng.Client.Detokenize(ctx, &frmpsv1.TokenIds{Ids: ids})
		if err != nil {
			return "", tokenizerError(err, s.cfg.RetryAfter)
		}
		return r.GetText(), nil
	}
	var e *apiError
	if j.echoIDs != nil {
		j.echo, e = detok(j.echoIDs)
	}
	for i := 0; i < len(j.choices) && e == nil; i++ {
		c := &j.choices[i]
		switch {
		case c.echoIDs == nil:
		case c.sample > 0: // the prompt's first choice has it already
			c.echo = j.choices[i-1].echo
		default:
			c.echo, e = detok(c.echoIDs)
		}
	}
	return e
}
