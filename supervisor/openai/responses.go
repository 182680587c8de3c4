package openai

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"strconv"
	"strings"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
)

// The Responses API, POST /v1/responses: the text subset of vLLM 0.26.0's.
// Its instructions and input become chat messages, and the rest a chat
// request's fields (max_output_tokens as max_tokens, text.format as
// response_format, include's logprobs as logprobs), which the chat path then
// validates and runs: one engine request with the chat template, a fixed
// seed and failover resume. Only the answer has its own shapes
// (responses_emit.go). Like `vllm serve` by default, the server keeps no
// responses: `store` is accepted and ignored, and `previous_response_id`,
// GET /v1/responses/{id} and its cancel answer 404 (not found).

// responsesWire is a Responses API request body. Unknown fields are ignored,
// as elsewhere.
type responsesWire struct {
	Model              *string         `json:"model"`
	Input              json.RawMessage `json:"input"`
	Instructions       *string         `json:"instructions"`
	MaxOutputTokens    *int64          `json:"max_output_tokens"`
	Temperature        *float64        `json:"temperature"`
	TopP               *float64        `json:"top_p"`
	TopK               *int64          `json:"top_k"` // vLLM's extension
	Seed               *int64          `json:"seed"`
	Stream             *bool           `json:"stream"`
	Text               json.RawMessage `json:"text"`
	User               *string         `json:"user"`
	Metadata           json.RawMessage `json:"metadata"`
	Store              *bool           `json:"store"`
	Background         *bool           `json:"background"`
	PreviousResponseID *string         `json:"previous_response_id"`
	Prompt             json.RawMessage `json:"prompt"`
	Tools              json.RawMessage `json:"tools"`
	ToolChoice         json.RawMessage `json:"tool_choice"`
	ParallelToolCalls  *bool           `json:"parallel_tool_calls"`
	MaxToolCalls       *int64          `json:"max_tool_calls"`
	Reasoning          json.RawMessage `json:"reasoning"`
	Include            []string        `json:"include"`
	TopLogprobs        *int64          `json:"top_logprobs"`
	Truncation         *string         `json:"truncation"`
	ServiceTier        *string         `json:"service_tier"`
	// vLLM's sampling extensions, as chat takes them.
	Stop                   json.RawMessage    `json:"stop"`
	IgnoreEOS              *bool              `json:"ignore_eos"`
	IncludeStopStrInOutput *bool              `json:"include_stop_str_in_output"`
	LogitBias              map[string]float64 `json:"logit_bias"`
	PresencePenalty        *float64           `json:"presence_penalty"`
	FrequencyPenalty       *float64           `json:"frequency_penalty"`
	RepetitionPenalty      *float64           `json:"repetition_penalty"`
	StructuredOutputs      json.RawMessage    `json:"structured_outputs"`
}

// responsesEcho holds what a response repeats of its request, in the order of
// vLLM's ResponsesResponse, as JSON fragments encoded once: each ends with a
// comma, the fields in between (id, output, status, usage, …) are the
// response's own (responsesOutput.appendResponse).
type responsesEcho struct {
	instructionsMetadata []byte // "instructions","metadata"
	toolsSampling        []byte // "parallel_tool_calls" … "background"
	afterMaxTokens       []byte // "max_tool_calls" … "service_tier"
	afterStatus          []byte // "text","top_logprobs","truncation"
	afterUsage           []byte // "user","presence_penalty","frequency_penalty" (closes the object)
}

// includeValues are the values vLLM's `include` takes; only the logprobs' one
// changes anything here (the others are about tools and images).
var includeValues = map[string]bool{
	"code_interpreter_call.outputs": true, "computer_call_output.output.image_url": true, "file_search_call.results": true,
	"message.input_image.image_url": true, "message.output_text.logprobs": true, "reasoning.encrypted_content": true,
}

var serviceTiers = map[string]bool{"auto": true, "default": true, "flex": true, "scale": true, "priority": true}

// parseResponses decodes and validates a Responses API request into a chat job.
func parseResponses(body []byte, model ModelInfo, cfg *Config) (*job, *apiError) {
	var r responsesWire
	if e := decodeBody(body, &r); e != nil {
		return nil, e
	}
	if e := checkModel(r.Model, model.Name); e != nil {
		return nil, e
	}
	msgs, e := parseInput(r.Input, r.Instructions)
	if e != nil {
		return nil, e
	}
	if e := refuseResponsesFeatures(&r); e != nil {
		return nil, e
	}
	w := wireRequest{Model: r.Model, msgs: msgs, Temperature: r.Temperature, TopP: r.TopP, TopK: r.TopK, Seed: r.Seed,
		Stream: r.Stream, Stop: r.Stop, IgnoreEOS: r.IgnoreEOS, IncludeStopStrInOutput: r.IncludeStopStrInOutput,
		LogitBias: r.LogitBias, PresencePenalty: r.PresencePenalty, FrequencyPenalty: r.FrequencyPenalty,
		RepetitionPenalty: r.RepetitionPenalty, StructuredOutputs: r.StructuredOutputs}
	if m := r.MaxOutputTokens; m != nil {
		// Checked here so that an error names max_output_tokens; chat's own checks then pass.
		switch {
		case *m < 1:
			return nil, badRequest("max_output_tokens", "`max_output_tokens` must be at least 1.")
		case model.MaxModelLen > 0 && *m >= int64(model.MaxModelLen):
			return nil, &apiError{Status: 400, Type: typeInvalidRequest, Param: "max_output_tokens", Code: "context_length_exceeded",
				Message: fmt.Sprintf("`max_output_tokens`=%d does not fit the model's maximum context length of %d tokens.", *m, model.MaxModelLen)}
		case *m > math.MaxUint32:
			return nil, badRequest("max_output_tokens", "`max_output_tokens` is too large.")
		}
		w.MaxTokens = m
	}
	rf, textEcho, e := parseTextConfig(r.Text)
	if e != nil {
		return nil, e
	}
	if rf != nil && len(r.StructuredOutputs) != 0 && !isNull(r.StructuredOutputs) {
		return nil, badRequest("structured_outputs", "Cannot specify both `structured_outputs` and `text.format`.")
	}
	w.ResponseFormat = rf
	logprobs := false
	for _, v := range r.Include {
		if !includeValues[v] {
			return nil, badRequest("include", fmt.Sprintf("`include` value %q is not one of the supported values.", v))
		}
		logprobs = logprobs || v == "message.output_text.logprobs"
	}
	if logprobs { // vLLM reads top_logprobs only then
		w.Logprobs, w.TopLogprobs = json.RawMessage("true"), r.TopLogprobs
	}
	j, e := parseWire(endpointChat, &w, model, cfg)
	if e != nil {
		return nil, e
	}
	j.endpoint = endpointResponses
	if j.resp, e = newResponsesEcho(&r, j, textEcho); e != nil {
		return nil, e
	}
	if id := r.PreviousResponseID; id != nil {
		// vLLM without its store (the default) finds no earlier response.
		return nil, &apiError{Status: http.StatusNotFound, Type: typeInvalidRequest, Param: "previous_response_id",
			Message: fmt.Sprintf("Response with id '%s' not found. This server stores no responses (`store` is ignored), "+
				"so `previous_response_id` cannot be used; send the conversation in `input`.", *id)}
	}
	return j, nil
}

// responsesRoles are the roles of a Responses API message item.
var responsesRoles = map[string]bool{"user": true, "system": true, "developer": true, "assistant": true}

// parseInput reads the instructions (a system message first, as vLLM puts
// them) and the input: a string is one user message; a list holds message
// items, {role, content} with content a string or text parts.
func parseInput(raw json.RawMessage, instructions *string) ([]*frmpsv1.ChatMessage, *apiError) {
	if len(raw) == 0 || isNull(raw) {
		return nil, badRequest("input", "You must provide `input`.")
	}
	var msgs []*frmpsv1.ChatMessage
	if instructions != nil && *instructions != "" {
		msgs = append(msgs, &frmpsv1.ChatMessage{Role: "system", Content: *instructions})
	}
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return append(msgs, &frmpsv1.ChatMessage{Role: "user", Content: s}), nil
	}
	var items []struct {
		Type    *string         `json:"type"`
		Role    *string         `json:"role"`
		Content json.RawMessage `json:"content"`
		Status  *string         `json:"status"`
	}
	if err := json.Unmarshal(raw, &items); err != nil {
		return nil, badRequest("input", "`input` must be a string or a list of message items ({role, content}).")
	}
	for i, it := range items {
		param := fmt.Sprintf("input[%d]", i)
		if it.Type != nil && *it.Type != "message" {
			return nil, badRequest(param+".type", fmt.Sprintf("Input items of type %q are not supported: this server takes message items (text) only, with no tools.", *it.Type))
		}
		if it.Role == nil || !responsesRoles[*it.Role] {
			return nil, badRequest(param+".role", "Each input message needs a role: user, system, developer or assistant.")
		}
		if i == len(items)-1 && it.Status != nil && (*it.Status == "in_progress" || *it.Status == "incomplete") {
			return nil, badRequest(param+".status", "Continuing a partial last message (status in_progress or incomplete) is not supported.")
		}
		content, e := parseInputContent(it.Content, param+".content")
		if e != nil {
			return nil, e
		}
		msgs = append(msgs, &frmpsv1.ChatMessage{Role: *it.Role, Content: content})
	}
	if len(msgs) == 0 {
		return nil, badRequest("input", "`input` must not be empty.")
	}
	return msgs, nil
}

// parseInputContent accepts a string or a list of text parts (input_text,
// output_text), joined with newlines as vLLM joins a text model's parts.
func parseInputContent(raw json.RawMessage, param string) (string, *apiError) {
	if len(raw) == 0 || isNull(raw) {
		return "", badRequest(param, "Each input message needs `content`.")
	}
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s, nil
	}
	var parts []struct {
		Type string  `json:"type"`
		Text *string `json:"text"`
	}
	if err := json.Unmarshal(raw, &parts); err != nil {
		return "", badRequest(param, "Message content must be a string or a list of text parts.")
	}
	texts := make([]string, 0, len(parts))
	for _, p := range parts {
		if (p.Type != "input_text" && p.Type != "output_text") || p.Text == nil {
			return "", badRequest(param, fmt.Sprintf("Content part type %q is not supported; only input_text and output_text, with their text.", p.Type))
		}
		texts = append(texts, *p.Text)
	}
	return strings.Join(texts, "\n"), nil
}

// refuseResponsesFeatures refuses what needs state or tools this server does
// not have, with vLLM's reasons where it gives them.
func refuseResponsesFeatures(r *responsesWire) *apiError {
	if r.Background != nil && *r.Background {
		if r.Store != nil && !*r.Store {
			return badRequest("background", "background can only be used when `store` is true")
		}
		return badRequest("background", "This server stores no responses (`store` is ignored), so it does not support background mode.")
	}
	if len(r.Prompt) != 0 && !isNull(r.Prompt) {
		return badRequest("prompt", "prompt template is not supported")
	}
	if len(r.Tools) != 0 && !isNull(r.Tools) {
		var tools []json.RawMessage
		if err := json.Unmarshal(r.Tools, &tools); err != nil {
			return badRequest("tools", "`tools` must be a list.")
		}
		if len(tools) > 0 {
			return badRequest("tools", "Tools are not supported by this server yet: send no `tools` (and `tool_choice` \"none\" or \"auto\").")
		}
	}
	if len(r.ToolChoice) != 0 && !isNull(r.ToolChoice) {
		var choice string
		if err := json.Unmarshal(r.ToolChoice, &choice); err != nil {
			return badRequest("tool_choice", "`tool_choice` names a tool, and this server serves no tools yet: use \"none\" or \"auto\".")
		}
		switch choice {
		case "none", "auto":
		case "required":
			return badRequest("tool_choice", "Tool choice 'required' must be specified with 'tools' parameter.")
		default:
			return badRequest("tool_choice", fmt.Sprintf("`tool_choice` must be \"none\" or \"auto\" (no tools are supported yet), got %q.", choice))
		}
	}
	if t := r.Truncation; t != nil && *t != "disabled" {
		if *t == "auto" {
			return badRequest("truncation", "`truncation` \"auto\" is not supported: this server does not cut prompts; use \"disabled\".")
		}
		return badRequest("truncation", fmt.Sprintf("`truncation` must be \"auto\" or \"disabled\", got %q.", *t))
	}
	if t := r.ServiceTier; t != nil && !serviceTiers[*t] {
		return badRequest("service_tier", fmt.Sprintf("`service_tier` must be auto, default, flex, scale or priority, got %q.", *t))
	}
	return nil
}

// parseTextConfig reads `text` ({format, verbosity}): the response_format
// that text.format is for chat (nil: none), and the config as the response
// echoes it, with vLLM's defaults spelled out (null: no config).
func parseTextConfig(raw json.RawMessage) (rf json.RawMessage, echo []byte, e *apiError) {
	if len(raw) == 0 || isNull(raw) {
		return nil, []byte("null"), nil
	}
	var t struct {
		Format    json.RawMessage `json:"format"`
		Verbosity *string         `json:"verbosity"`
	}
	if err := json.Unmarshal(raw, &t); err != nil {
		return nil, nil, badRequest("text", "`text` must be an object: {format, verbosity}.")
	}
	if v := t.Verbosity; v != nil && *v != "low" && *v != "medium" && *v != "high" {
		return nil, nil, badRequest("text.verbosity", "`text.verbosity` must be low, medium or high.")
	}
	echo = []byte(`{"format":`)
	if len(t.Format) == 0 || isNull(t.Format) {
		echo = append(echo, "null"...)
	} else {
		var f struct {
			Type        string          `json:"type"`
			Name        *string         `json:"name"`
			Schema      json.RawMessage `json:"schema"`
			Description *string         `json:"description"`
			Strict      *bool           `json:"strict"`
		}
		if err := json.Unmarshal(t.Format, &f); err != nil {
			return nil, nil, badRequest("text.format", "`text.format` must be an object with a `type`.")
		}
		switch f.Type {
		case "text":
			echo = append(echo, `{"type":"text"}`...)
		case "json_object":
			rf = json.RawMessage(`{"type":"json_object"}`)
			echo = append(echo, rf...)
		case "json_schema":
			if f.Name == nil {
				return nil, nil, badRequest("text.format.name", "`text.format.name` is required for json_schema.")
			}
			if len(f.Schema) == 0 || isNull(f.Schema) {
				return nil, nil, badRequest("text.format.schema", "`text.format.schema` is required for json_schema.")
			}
			so, e := jsonSchema(f.Schema, "text.format.schema")
			if e != nil {
				return nil, nil, e
			}
			schema := so.GetJsonSchema() // compact
			rf = json.RawMessage(`{"type":"json_schema","json_schema":{"schema":` + schema + `}}`)
			echo = append(echo, `{"name":`...)
			echo = appendJSONString(echo, *f.Name)
			echo = append(echo, `,"schema":`...)
			echo = append(echo, schema...)
			echo = append(echo, `,"type":"json_schema","description":`...)
			echo = appendNullable(echo, f.Description)
			echo = append(echo, `,"strict":`...)
			if f.Strict == nil {
				echo = append(echo, "null"...)
			} else {
				echo = strconv.AppendBool(echo, *f.Strict)
			}
			echo = append(echo, '}')
		default:
			return nil, nil, badRequest("text.format", fmt.Sprintf("`text.format.type` must be text, json_object or json_schema, got %q.", f.Type))
		}
	}
	echo = append(echo, `,"verbosity":`...)
	return rf, append(appendNullable(echo, t.Verbosity), '}'), nil
}

func appendNullable(b []byte, s *string) []byte {
	if s == nil {
		return append(b, "null"...)
	}
	return appendJSONString(b, *s)
}

func appendFloat32(b []byte, v float32) []byte {
	return strconv.AppendFloat(b, float64(v), 'g', -1, 32)
}

// newResponsesEcho encodes what the response repeats of request r, with the
// sampling values the engine request carries (vLLM echoes its sampling
// parameters, defaults included).
func newResponsesEcho(r *responsesWire, j *job, text []byte) (*responsesEcho, *apiError) {
	p := j.gen.GetParams()
	ec := &responsesEcho{}

	b := append([]byte(nil), `"instructions":`...)
	b = appendNullable(b, r.Instructions)
	b = append(b, `,"metadata":`...)
	if len(r.Metadata) == 0 || isNull(r.Metadata) {
		b = append(b, "null"...)
	} else {
		var md map[string]string
		if err := json.Unmarshal(r.Metadata, &md); err != nil {
			return nil, badRequest("metadata", "`metadata` must be an object of string values.")
		}
		var c bytes.Buffer
		_ = json.Compact(&c, r.Metadata) // valid: it decoded
		b = append(b, c.Bytes()...)
	}
	ec.instructionsMetadata = append(b, ',')

	b = append([]byte(nil), `"parallel_tool_calls":`...)
	b = strconv.AppendBool(b, r.ParallelToolCalls == nil || *r.ParallelToolCalls)
	b = append(b, `,"temperature":`...)
	b = appendFloat32(b, p.GetTemperature())
	// With no tools, vLLM answers tool_choice "auto" as "none".
	b = append(b, `,"tool_choice":"none","tools":[],"top_p":`...)
	b = appendFloat32(b, p.GetTopP())
	ec.toolsSampling = append(b, `,"background":false,`...)

	b = append([]byte(nil), `"max_tool_calls":`...)
	if r.MaxToolCalls == nil {
		b = append(b, "null"...)
	} else {
		b = strconv.AppendInt(b, *r.MaxToolCalls, 10)
	}
	b = append(b, `,"previous_response_id":null,"prompt":null,"reasoning":`...)
	reasoning, e := reasoningEcho(r.Reasoning)
	if e != nil {
		return nil, e
	}
	b = append(b, reasoning...)
	b = append(b, `,"service_tier":`...)
	tier := "auto"
	if r.ServiceTier != nil {
		tier = *r.ServiceTier
	}
	b = appendJSONString(b, tier)
	ec.afterMaxTokens = append(b, ',')

	b = append([]byte(`"text":`), text...)
	b = append(b, `,"top_logprobs":`...)
	if j.lp != nil {
		b = strconv.AppendInt(b, int64(j.lp.top), 10)
	} else {
		b = append(b, "null"...)
	}
	ec.afterStatus = append(b, `,"truncation":"disabled",`...)

	b = append([]byte(nil), `"user":`...)
	b = appendNullable(b, r.User)
	b = append(b, `,"presence_penalty":`...)
	b = appendFloat32(b, p.GetPresencePenalty())
	b = append(b, `,"frequency_penalty":`...)
	b = appendFloat32(b, p.GetFrequencyPenalty())
	ec.afterUsage = append(b, '}')
	return ec, nil
}

// reasoningEcho checks `reasoning` and spells it out as vLLM echoes it. A
// text model has nothing to do with it (vLLM passes the effort to the chat
// template, which a non-reasoning model's ignores).
func reasoningEcho(raw json.RawMessage) ([]byte, *apiError) {
	if len(raw) == 0 || isNull(raw) {
		return []byte("null"), nil
	}
	var rs struct {
		Effort          *string `json:"effort"`
		GenerateSummary *string `json:"generate_summary"`
		Summary         *string `json:"summary"`
	}
	if err := json.Unmarshal(raw, &rs); err != nil {
		return nil, badRequest("reasoning", "`reasoning` must be an object: {effort, summary}.")
	}
	b := appendNullable([]byte(`{"effort":`), rs.Effort)
	b = appendNullable(append(b, `,"generate_summary":`...), rs.GenerateSummary)
	b = appendNullable(append(b, `,"summary":`...), rs.Summary)
	return append(b, '}'), nil
}

// handleStoredResponse answers GET /v1/responses/{id} and POST
// /v1/responses/{id}/cancel as vLLM does without its store: not found.
func (s *Server) handleStoredResponse(w http.ResponseWriter, r *http.Request) {
	id := strings.TrimPrefix(r.URL.Path, "/v1/responses/")
	id, cancel := strings.CutSuffix(id, "/cancel")
	if id == "" || strings.Contains(id, "/") {
		(&apiError{Status: 404, Type: typeNotFound, Message: fmt.Sprintf("Unknown path %s.", r.URL.Path)}).write(w)
		return
	}
	method := http.MethodGet
	if cancel {
		method = http.MethodPost
	}
	if r.Method != method {
		methodNotAllowed(w, method)
		return
	}
	(&apiError{Status: http.StatusNotFound, Type: typeInvalidRequest, Param: "response_id",
		Message: fmt.Sprintf("Response with id '%s' not found. This server stores no responses.", id)}).write(w)
}
