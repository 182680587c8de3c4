package openai

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strings"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
)

type endpoint uint8

const (
	endpointChat endpoint = iota
	endpointCompletions
	// endpointResponses is the Responses API: a chat request to the engine
	// (responses.go), answered in its own shapes (responses_emit.go).
	endpointResponses
)

// endpoints lists every endpoint, for the metrics' series known in advance.
var endpoints = []endpoint{endpointChat, endpointCompletions, endpointResponses}

func (e endpoint) String() string {
	switch e {
	case endpointChat:
		return "chat_completions"
	case endpointResponses:
		return "responses"
	}
	return "completions"
}

// maxTokensParam and inputParam name the request fields that a context-length
// error is about.
func (e endpoint) maxTokensParam() string {
	if e == endpointResponses {
		return "max_output_tokens"
	}
	return "max_tokens"
}

func (e endpoint) inputParam() string {
	if e == endpointResponses {
		return "input"
	}
	return "prompt"
}

// wireRequest is the union of the chat and completions request bodies. Fields
// that take several JSON shapes stay raw and are decoded by hand; unknown
// fields are ignored, as vLLM does.
type wireRequest struct {
	Model               *string         `json:"model"`
	Messages            json.RawMessage `json:"messages"`
	Prompt              json.RawMessage `json:"prompt"`
	MaxTokens           *int64          `json:"max_tokens"`
	MaxCompletionTokens *int64          `json:"max_completion_tokens"`
	Temperature         *float64        `json:"temperature"`
	TopP                *float64        `json:"top_p"`
	TopK                *int64          `json:"top_k"`
	Seed                *int64          `json:"seed"`
	Stop                json.RawMessage `json:"stop"`
	StopTokenIDs        []int64         `json:"stop_token_ids"`
	N                   *int64          `json:"n"`
	BestOf              *int64          `json:"best_of"`
	Stream              *bool           `json:"stream"`
	StreamOptions       *struct {
		IncludeUsage         *bool `json:"include_usage"`
		ContinuousUsageStats *bool `json:"continuous_usage_stats"`
	} `json:"stream_options"`
	User                   json.RawMessage `json:"user"`
	IgnoreEOS              *bool           `json:"ignore_eos"`
	IncludeStopStrInOutput *bool           `json:"include_stop_str_in_output"`
	AddGenerationPrompt    *bool           `json:"add_generation_prompt"`
	// vLLM's extension: return the generated token ids with each choice.
	ReturnTokenIDs *bool           `json:"return_token_ids"`
	Echo           *bool           `json:"echo"`
	Logprobs       json.RawMessage `json:"logprobs"`
	TopLogprobs    *int64          `json:"top_logprobs"`
	// vLLM's extension: logprobs' tokens as "token_id:N".
	ReturnTokensAsTokenIDs *bool              `json:"return_tokens_as_token_ids"`
	LogitBias              map[string]float64 `json:"logit_bias"`
	MinTokens              *int64             `json:"min_tokens"`
	PresencePenalty        *float64           `json:"presence_penalty"`
	FrequencyPenalty       *float64           `json:"frequency_penalty"`
	RepetitionPenalty      *float64           `json:"repetition_penalty"`
	ResponseFormat         json.RawMessage    `json:"response_format"`
	StructuredOutputs      json.RawMessage    `json:"structured_outputs"`
	// Chat's tool calling (tools.go).
	Tools             json.RawMessage `json:"tools"`
	ToolChoice        json.RawMessage `json:"tool_choice"`
	ParallelToolCalls *bool           `json:"parallel_tool_calls"`

	// msgs: the messages already read from another shape (the Responses
	// API's input); Messages is not read then.
	msgs []*frmpsv1.ChatMessage
}

// job is a validated request, ready for the engine.
type job struct {
	endpoint     endpoint
	model        string
	stream       bool
	includeUsage bool
	// continuousUsage: every chunk carries its choice's usage so far (vLLM's
	// stream_options.continuous_usage_stats, with include_usage).
	continuousUsage bool
	// returnTokenIDs: add "token_ids" to every choice (vLLM's extension).
	returnTokenIDs bool
	// lp formats the logprobs asked for; nil when none were.
	lp *lpFormat
	// tools: chat's tool calling, how the output becomes tool calls; nil: plain content.
	tools *toolPlan
	// maxTokens as the client asked (0 = not given); checked against the
	// context length once the engine reports the prompt length.
	maxTokens int
	// gen is the engine request of a one-choice request; choices is nil then.
	gen *frmpsv1.GenerateRequest
	// echo goes before the generated text (completions' echo of the prompt,
	// chat's echo of a last message in the answer's role).
	echo string
	// echoIDs: a prompt given as token ids to echo; the engine detokenizes it
	// into echo before the request starts (Server.detokenizeEchoes).
	echoIDs []uint32
	// choices are the engine requests of a request with several choices (n > 1,
	// or several prompts), in the order vLLM numbers them: prompt by prompt, n
	// each. Each is a request of its own to the engine and across a failover.
	choices []choice
	// resp: what a Responses API request echoes in its response; nil for the
	// other endpoints.
	resp *responsesEcho
}

// choice is one of a request's several choices.
type choice struct {
	gen *frmpsv1.GenerateRequest
	// sample is the choice's number among its prompt's n: vLLM seeds child
	// i of a seeded request with seed + i. 0 marks the prompt's first choice,
	// which alone counts the prompt in the usage.
	sample  int
	echo    string
	echoIDs []uint32
}

// fixSeeds gives every engine request a seed: the client's, or random() when
// it gave none. A fixed seed makes a resumed request sample exactly as the
// original would have, even if it never reached a ring sync.
func (j *job) fixSeeds(random func() uint64) {
	gens := []*frmpsv1.GenerateRequest{j.gen}
	if j.choices != nil {
		gens = gens[:0]
		for _, c := range j.choices {
			gens = append(gens, c.gen)
		}
	}
	var base uint64
	if s := gens[0].GetParams().Seed; s != nil {
		base = *s
	} else {
		base = random()
	}
	for i, g := range gens {
		seed := base
		if j.choices != nil {
			seed += uint64(j.choices[i].sample)
		}
		g.Params.Seed = &seed
	}
}

// parseRequest decodes and validates a request body. It never panics on bad input.
func parseRequest(ep endpoint, body []byte, model ModelInfo, cfg *Config) (*job, *apiError) {
	if ep == endpointResponses {
		return parseResponses(body, model, cfg)
	}
	var w wireRequest
	if e := decodeBody(body, &w); e != nil {
		return nil, e
	}
	return parseWire(ep, &w, model, cfg)
}

// decodeBody decodes one JSON object into v; unknown fields are ignored.
func decodeBody(body []byte, v any) *apiError {
	dec := json.NewDecoder(bytes.NewReader(body))
	if err := dec.Decode(v); err != nil {
		return decodeError(err)
	}
	if dec.More() {
		return badRequest("", "Invalid JSON body: unexpected data after the top-level object.")
	}
	return nil
}

// parseWire validates a decoded chat or completions request (also the chat
// request a Responses API request becomes) and builds its job.
func parseWire(ep endpoint, w *wireRequest, model ModelInfo, cfg *Config) (*job, *apiError) {
	if e := checkModel(w.Model, model.Name); e != nil {
		return nil, e
	}
	j := &job{endpoint: ep, model: model.Name}
	n := 1
	if w.N != nil {
		if *w.N < 1 {
			return nil, badRequest("n", "`n` must be at least 1.")
		}
		if *w.N > int64(cfg.MaxChoices) {
			return nil, badRequest("n", fmt.Sprintf("n=%d is more than the %d choices a request may ask for.", *w.N, cfg.MaxChoices))
		}
		n = int(*w.N)
	}
	var inputs []promptInput
	addGen := false
	var tr *toolRequest
	switch ep {
	case endpointChat:
		if len(w.Prompt) != 0 && !isNull(w.Prompt) {
			return nil, badRequest("prompt", "Chat completions take `messages`, not `prompt`.")
		}
		msgs := w.msgs
		var e *apiError
		if msgs == nil {
			if msgs, e = parseMessages(w.Messages); e != nil {
				return nil, e
			}
		}
		if tr, e = parseTools(w, cfg); e != nil {
			return nil, e
		}
		j.tools = tr.plan
		addGen = true
		if w.AddGenerationPrompt != nil {
			addGen = *w.AddGenerationPrompt
		}
		in := promptInput{in: &frmpsv1.GenerateRequest{Input: &frmpsv1.GenerateRequest_Messages{Messages: &frmpsv1.ChatMessages{Messages: msgs}}}}
		// vLLM's echo for chat: the answer starts with the last message when it is
		// in the answer's role (the assistant's, or the last message's own role
		// when no generation prompt is added).
		if w.Echo != nil && *w.Echo && (!addGen || msgs[len(msgs)-1].GetRole() == "assistant") {
			in.echo = msgs[len(msgs)-1].GetContent()
		}
		inputs = []promptInput{in}
	case endpointCompletions:
		var e *apiError
		if inputs, e = parsePrompts(w.Prompt, model.MaxModelLen, cfg.MaxChoices); e != nil {
			return nil, e
		}
		if w.Echo != nil && *w.Echo {
			for i := range inputs {
				switch p := inputs[i].in.Input.(type) {
				case *frmpsv1.GenerateRequest_Prompt:
					inputs[i].echo = p.Prompt
				case *frmpsv1.GenerateRequest_PromptTokenIds:
					inputs[i].echoIDs = p.PromptTokenIds.GetIds()
				}
			}
		}
	}
	if len(inputs)*n > cfg.MaxChoices {
		return nil, badRequest("n", fmt.Sprintf("%d prompts × n=%d is more than the %d choices a request may ask for.", len(inputs), n, cfg.MaxChoices))
	}
	if e := rejectUnsupported(w); e != nil {
		return nil, e
	}
	p, e := parseParams(w, model, cfg)
	if e != nil {
		return nil, e
	}
	toolsJSON := ""
	if tr != nil {
		tr.applyToolConstraint(p)
		toolsJSON = tr.toolsJSON
	}
	if j.lp, e = parseLogprobs(w, ep); e != nil {
		return nil, e
	}
	if j.lp != nil {
		if ep == endpointCompletions && w.Echo != nil && *w.Echo {
			return nil, badRequest("echo", "`echo` with `logprobs` would need the prompt's logprobs, which this server does not compute.")
		}
		k := uint32(j.lp.top)
		p.Logprobs = &k
	}
	if len(inputs) == 1 && n == 1 {
		j.gen = &frmpsv1.GenerateRequest{Input: inputs[0].in.Input, Params: p, AddGenerationPrompt: addGen, ToolsJson: toolsJSON}
		j.echo, j.echoIDs = inputs[0].echo, inputs[0].echoIDs
	} else {
		j.choices = make([]choice, 0, len(inputs)*n)
		for _, in := range inputs {
			for i := 0; i < n; i++ {
				g := &frmpsv1.GenerateRequest{Input: in.in.Input, Params: cloneParams(p), AddGenerationPrompt: addGen, ToolsJson: toolsJSON}
				j.choices = append(j.choices, choice{gen: g, sample: i, echo: in.echo, echoIDs: in.echoIDs})
			}
		}
	}
	if w.MaxCompletionTokens != nil {
		j.maxTokens = int(*w.MaxCompletionTokens)
	} else if w.MaxTokens != nil {
		j.maxTokens = int(*w.MaxTokens)
	}
	if w.Stream != nil {
		j.stream = *w.Stream
	}
	if w.ReturnTokenIDs != nil {
		j.returnTokenIDs = *w.ReturnTokenIDs
	}
	if w.StreamOptions != nil && w.StreamOptions.IncludeUsage != nil {
		if !j.stream {
			return nil, badRequest("stream_options", "`stream_options` is only allowed when `stream` is true.")
		}
		j.includeUsage = *w.StreamOptions.IncludeUsage
	}
	if w.StreamOptions != nil && w.StreamOptions.ContinuousUsageStats != nil {
		if !j.stream {
			return nil, badRequest("stream_options", "`stream_options` is only allowed when `stream` is true.")
		}
		j.continuousUsage = j.includeUsage && *w.StreamOptions.ContinuousUsageStats
	}
	return j, nil
}

// checkModel refuses a request that names no model or another than the served one.
func checkModel(m *string, served string) *apiError {
	if m == nil || *m == "" {
		return badRequest("model", "You must provide a model parameter.")
	}
	if *m != served {
		return &apiError{Status: 404, Type: typeNotFound, Param: "model", Code: "model_not_found",
			Message: fmt.Sprintf("The model `%s` does not exist. This server serves `%s`.", *m, served)}
	}
	return nil
}

func decodeError(err error) *apiError {
	var te *json.UnmarshalTypeError
	if errors.As(err, &te) {
		param := te.Field
		return badRequest(param, fmt.Sprintf("Invalid type for `%s`: expected %s, got JSON %s.", param, te.Type, te.Value))
	}
	if errors.Is(err, errEmptyBody) || err.Error() == "EOF" {
		return badRequest("", "The request body is empty; expected a JSON object.")
	}
	return badRequest("", "Invalid JSON body: "+err.Error())
}

var errEmptyBody = errors.New("empty body")

func isNull(raw json.RawMessage) bool { return string(bytes.TrimSpace(raw)) == "null" }

var chatRoles = map[string]bool{"system": true, "developer": true, "user": true, "assistant": true, "tool": true}

func parseMessages(raw json.RawMessage) ([]*frmpsv1.ChatMessage, *apiError) {
	if len(raw) == 0 || isNull(raw) {
		return nil, badRequest("messages", "You must provide `messages`.")
	}
	var msgs []struct {
		Role       *string         `json:"role"`
		Content    json.RawMessage `json:"content"`
		Name       json.RawMessage `json:"name"`
		ToolCallID json.RawMessage `json:"tool_call_id"`
		ToolCalls  json.RawMessage `json:"tool_calls"`
	}
	if err := json.Unmarshal(raw, &msgs); err != nil {
		return nil, badRequest("messages", "`messages` must be an array of {role, content} objects.")
	}
	if len(msgs) == 0 {
		return nil, badRequest("messages", "`messages` must not be empty.")
	}
	out := make([]*frmpsv1.ChatMessage, 0, len(msgs))
	for i, m := range msgs {
		param := fmt.Sprintf("messages[%d]", i)
		if m.Role == nil || !chatRoles[*m.Role] {
			return nil, badRequest(param+".role", "Each message needs a role: system, developer, user, assistant or tool.")
		}
		content, e := parseContent(m.Content, param+".content")
		if e != nil {
			return nil, e
		}
		cm := &frmpsv1.ChatMessage{Role: *m.Role, Content: content}
		// What vLLM hands the chat template besides role and content: an
		// assistant's tool calls, a tool result's call id, a name.
		switch *m.Role {
		case "assistant":
			if cm.ToolCallsJson, e = historyToolCalls(m.ToolCalls, param+".tool_calls"); e != nil {
				return nil, e
			}
		case "tool":
			if id, ok := historyString(m.ToolCallID); ok {
				cm.ToolCallId = &id
			}
		}
		if name, ok := historyString(m.Name); ok {
			cm.Name = &name
		}
		out = append(out, cm)
	}
	return out, nil
}

// parseContent accepts a string, null, or an array of text parts (joined with
// newlines, as vLLM does for text-only models).
func parseContent(raw json.RawMessage, param string) (string, *apiError) {
	if len(raw) == 0 || isNull(raw) {
		return "", nil
	}
	var s string
	if err := json.Unmarshal(raw, &s); err == nil {
		return s, nil
	}
	var parts []struct {
		Type string  `json:"type"`
		Text *string `json:"text"`
	}
	if err := json.Unmarshal(raw, &parts); err != nil {
		return "", badRequest(param, "Message content must be a string or an array of text parts.")
	}
	texts := make([]string, 0, len(parts))
	for _, p := range parts {
		if p.Type != "text" || p.Text == nil {
			return "", badRequest(param, fmt.Sprintf("Content part type %q is not supported; only text.", p.Type))
		}
		texts = append(texts, *p.Text)
	}
	return strings.Join(texts, "\n"), nil
}

// promptInput is one prompt of a request, and the text its echo shows.
type promptInput struct {
	in      *frmpsv1.GenerateRequest // Input only
	echo    string
	echoIDs []uint32 // a token-id prompt to echo
}

// parsePrompts accepts what vLLM accepts: a string, a list of token ids, or a
// batch, a list of strings or of token-id lists (one choice per prompt, or n).
func parsePrompts(raw json.RawMessage, maxModelLen, maxPrompts int) ([]promptInput, *apiError) {
	if len(raw) == 0 || isNull(raw) {
		return nil, badRequest("prompt", "You must provide a `prompt`.")
	}
	var s string
	if err := json.Unmarshal(raw, &s); err == nil {
		if s == "" {
			return nil, badRequest("prompt", "`prompt` must not be empty.")
		}
		return []promptInput{{in: &frmpsv1.GenerateRequest{Input: &frmpsv1.GenerateRequest_Prompt{Prompt: s}}}}, nil
	}
	var list []json.RawMessage
	if err := json.Unmarshal(raw, &list); err != nil {
		return nil, badRequest("prompt", "`prompt` must be a string, a list of strings, a list of token ids or a list of token-id lists.")
	}
	if len(list) == 0 {
		return nil, badRequest("prompt", "`prompt` must not be empty.")
	}
	first := bytes.TrimSpace(list[0])
	if len(first) == 0 || (first[0] != '"' && first[0] != '[') {
		ids, e := parseTokenIDs(list, "prompt", maxModelLen)
		if e != nil {
			return nil, e
		}
		return []promptInput{{in: &frmpsv1.GenerateRequest{Input: &frmpsv1.GenerateRequest_PromptTokenIds{PromptTokenIds: &frmpsv1.TokenIds{Ids: ids}}}}}, nil
	}
	if len(list) > maxPrompts {
		return nil, badRequest("prompt", fmt.Sprintf("%d prompts is more than the %d choices a request may ask for.", len(list), maxPrompts))
	}
	out := make([]promptInput, 0, len(list))
	for i, r := range list {
		param := fmt.Sprintf("prompt[%d]", i)
		r = bytes.TrimSpace(r)
		if len(r) == 0 || r[0] != first[0] {
			return nil, badRequest(param, "A batch of prompts must be all strings or all token-id lists.")
		}
		if r[0] == '"' {
			var s string
			if err := json.Unmarshal(r, &s); err != nil || s == "" {
				return nil, badRequest(param, fmt.Sprintf("%s must be a non-empty string.", param))
			}
			out = append(out, promptInput{in: &frmpsv1.GenerateRequest{Input: &frmpsv1.GenerateRequest_Prompt{Prompt: s}}})
			continue
		}
		var elems []json.RawMessage
		if err := json.Unmarshal(r, &elems); err != nil || len(elems) == 0 {
			return nil, badRequest(param, fmt.Sprintf("%s must be a non-empty list of token ids.", param))
		}
		ids, e := parseTokenIDs(elems, param, maxModelLen)
		if e != nil {
			return nil, e
		}
		out = append(out, promptInput{in: &frmpsv1.GenerateRequest{Input: &frmpsv1.GenerateRequest_PromptTokenIds{PromptTokenIds: &frmpsv1.TokenIds{Ids: ids}}}})
	}
	return out, nil
}

// parseTokenIDs reads a prompt given as token ids.
func parseTokenIDs(list []json.RawMessage, param string, maxModelLen int) ([]uint32, *apiError) {
	ids := make([]uint32, len(list))
	for i, r := range list {
		var v int64
		if err := json.Unmarshal(r, &v); err != nil || v < 0 || v > math.MaxUint32 {
			return nil, badRequest("prompt", fmt.Sprintf("%s[%d] is not a valid token id.", param, i))
		}
		ids[i] = uint32(v)
	}
	if maxModelLen > 0 && len(ids) >= maxModelLen {
		return nil, promptTooLong(len(ids), maxModelLen, "prompt")
	}
	return ids, nil
}

func promptTooLong(promptTokens, maxModelLen int, param string) *apiError {
	return &apiError{Status: 400, Type: typeInvalidRequest, Param: param, Code: "context_length_exceeded",
		Message: fmt.Sprintf("This model's maximum context length is %d tokens. However, your prompt has %d tokens, which leaves no room for output.", maxModelLen, promptTokens)}
}

func contextTooLong(promptTokens, maxTokens, maxModelLen int, param string) *apiError {
	return &apiError{Status: 400, Type: typeInvalidRequest, Param: param, Code: "context_length_exceeded",
		Message: fmt.Sprintf("This model's maximum context length is %d tokens. However, you requested %d tokens (%d in the prompt, %d for the completion). Please reduce the prompt or %s.",
			maxModelLen, promptTokens+maxTokens, promptTokens, maxTokens, param)}
}

func rejectUnsupported(w *wireRequest) *apiError {
	if w.BestOf != nil && *w.BestOf > 1 {
		return badRequest("best_of", "`best_of` > 1 is not supported.")
	}
	return nil
}
