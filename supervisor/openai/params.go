package openai

// The sampling parameters of a chat or completions request: logprobs, the
// sampler's settings, stops, penalties and the structured-outputs constraint.

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"strconv"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
)

// parseLogprobs reads what a request asks of logprobs: completions' `logprobs`
// (how many top tokens, 0 to 20), chat's `logprobs` (true/false) with
// `top_logprobs` (0 to 20). nil: none.
func parseLogprobs(w *wireRequest, ep endpoint) (*lpFormat, *apiError) {
	set := len(w.Logprobs) != 0 && !isNull(w.Logprobs)
	f := &lpFormat{chat: ep == endpointChat, asIDs: w.ReturnTokensAsTokenIDs != nil && *w.ReturnTokensAsTokenIDs}
	if ep == endpointCompletions {
		if !set { // top_logprobs is chat's: ignored here, as vLLM ignores it
			return nil, nil
		}
		var k int64
		if err := json.Unmarshal(w.Logprobs, &k); err != nil {
			return nil, badRequest("logprobs", "`logprobs` must be an integer (the number of top tokens) for completions.")
		}
		if k < 0 || k > maxLogprobs {
			return nil, badRequest("logprobs", fmt.Sprintf("`logprobs` must be between 0 and %d.", maxLogprobs))
		}
		f.top = int(k)
		return f, nil
	}
	on := false
	if set {
		if err := json.Unmarshal(w.Logprobs, &on); err != nil {
			return nil, badRequest("logprobs", "`logprobs` must be true or false for chat completions.")
		}
	}
	if w.TopLogprobs != nil {
		if *w.TopLogprobs < 0 || *w.TopLogprobs > maxLogprobs {
			return nil, badRequest("top_logprobs", fmt.Sprintf("`top_logprobs` must be between 0 and %d.", maxLogprobs))
		}
		if *w.TopLogprobs > 0 && !on {
			return nil, badRequest("top_logprobs", "`top_logprobs` needs `logprobs` set to true.")
		}
		f.top = int(*w.TopLogprobs)
	}
	if !on {
		return nil, nil
	}
	return f, nil
}

func parseParams(w *wireRequest, model ModelInfo, cfg *Config) (*frmpsv1.SamplingParams, *apiError) {
	p := &frmpsv1.SamplingParams{Temperature: 1, TopP: 1}
	maxTok := w.MaxTokens
	param := "max_tokens"
	if w.MaxCompletionTokens != nil {
		maxTok, param = w.MaxCompletionTokens, "max_completion_tokens"
	}
	switch {
	case maxTok != nil && *maxTok < 1:
		return nil, badRequest(param, fmt.Sprintf("`%s` must be at least 1.", param))
	case maxTok != nil && model.MaxModelLen > 0 && *maxTok >= int64(model.MaxModelLen):
		return nil, &apiError{Status: 400, Type: typeInvalidRequest, Param: param, Code: "context_length_exceeded",
			Message: fmt.Sprintf("`%s`=%d does not fit the model's maximum context length of %d tokens.", param, *maxTok, model.MaxModelLen)}
	case maxTok != nil && *maxTok > math.MaxUint32:
		return nil, badRequest(param, fmt.Sprintf("`%s` is too large.", param))
	case maxTok != nil:
		p.MaxTokens = uint32(*maxTok)
	default:
		p.MaxTokens = uint32(cfg.DefaultMaxTokens)
	}
	if t := w.Temperature; t != nil {
		if math.IsNaN(*t) || *t < 0 || *t > 2 {
			return nil, badRequest("temperature", "`temperature` must be between 0 and 2.")
		}
		p.Temperature = float32(*t)
	}
	if t := w.TopP; t != nil {
		if math.IsNaN(*t) || *t <= 0 || *t > 1 {
			return nil, badRequest("top_p", "`top_p` must be in (0, 1].")
		}
		p.TopP = float32(*t)
	}
	if k := w.TopK; k != nil {
		switch {
		case *k == -1 || *k == 0: // -1 is vLLM's "disabled"; 0 is ours
		case *k < -1 || *k > math.MaxInt32:
			return nil, badRequest("top_k", "`top_k` must be -1 (disabled) or a positive integer.")
		default:
			p.TopK = int32(*k)
		}
	}
	if w.Seed != nil {
		seed := uint64(*w.Seed) // two's complement: negative seeds stay distinct and deterministic
		p.Seed = &seed
	}
	stops, e := parseStop(w.Stop)
	if e != nil {
		return nil, e
	}
	p.Stop = stops
	for i, id := range w.StopTokenIDs {
		if id < 0 || id > math.MaxUint32 {
			return nil, badRequest("stop_token_ids", fmt.Sprintf("stop_token_ids[%d] is not a valid token id.", i))
		}
		p.StopTokenIds = append(p.StopTokenIds, uint32(id))
	}
	if w.IgnoreEOS != nil {
		p.IgnoreEos = *w.IgnoreEOS
	}
	if e := parsePenalties(w, p); e != nil {
		return nil, e
	}
	so, e := parseStructured(w)
	if e != nil {
		return nil, e
	}
	p.StructuredOutputs = so
	if w.IncludeStopStrInOutput != nil {
		p.IncludeStopStrInOutput = *w.IncludeStopStrInOutput
	}
	return p, nil
}

const maxStops = 16

// parseStructured reads a constraint on the output: OpenAI's response_format
// (json_object, or json_schema with its schema) or vLLM's structured_outputs
// (one of json, json_object, regex, choice, grammar). nil: none.
func parseStructured(w *wireRequest) (*frmpsv1.StructuredOutputs, *apiError) {
	hasRF := len(w.ResponseFormat) != 0 && !isNull(w.ResponseFormat)
	hasSO := len(w.StructuredOutputs) != 0 && !isNull(w.StructuredOutputs)
	switch {
	case hasRF && hasSO:
		return nil, badRequest("response_format", "Give `response_format` or `structured_outputs`, not both.")
	case hasRF:
		var rf struct {
			Type       string `json:"type"`
			JSONSchema *struct {
				Schema json.RawMessage `json:"schema"`
			} `json:"json_schema"`
		}
		if err := json.Unmarshal(w.ResponseFormat, &rf); err != nil {
			return nil, badRequest("response_format", "`response_format` must be an object with a `type`.")
		}
		switch rf.Type {
		case "text":
			return nil, nil
		case "json_object":
			return &frmpsv1.StructuredOutputs{Kind: &frmpsv1.StructuredOutputs_JsonObject{JsonObject: true}}, nil
		case "json_schema":
			if rf.JSONSchema == nil || len(rf.JSONSchema.Schema) == 0 || isNull(rf.JSONSchema.Schema) {
				return nil, badRequest("response_format", "`response_format.json_schema.schema` is required.")
			}
			return jsonSchema(rf.JSONSchema.Schema, "response_format")
		}
		return nil, badRequest("response_format", fmt.Sprintf("`response_format.type` must be text, json_object or json_schema, got %q.", rf.Type))
	case hasSO:
		var so struct {
			JSON       json.RawMessage `json:"json"`
			JSONObject *bool           `json:"json_object"`
			Regex      *string         `json:"regex"`
			Choice     []string        `json:"choice"`
			Grammar    *string         `json:"grammar"`
		}
		if err := json.Unmarshal(w.StructuredOutputs, &so); err != nil {
			return nil, badRequest("structured_outputs", "`structured_outputs` must be an object: one of json, json_object, regex, choice, grammar.")
		}
		var out []*frmpsv1.StructuredOutputs
		if len(so.JSON) != 0 && !isNull(so.JSON) {
			// A schema, or a schema given as a JSON string (vLLM takes both).
			raw := so.JSON
			var str string
			if json.Unmarshal(raw, &str) == nil {
				raw = json.RawMessage(str)
			}
			j, e := jsonSchema(raw, "structured_outputs")
			if e != nil {
				return nil, e
			}
			out = append(out, j)
		}
		if so.JSONObject != nil && *so.JSONObject {
			out = append(out, &frmpsv1.StructuredOutputs{Kind: &frmpsv1.StructuredOutputs_JsonObject{JsonObject: true}})
		}
		if so.Regex != nil {
			out = append(out, &frmpsv1.StructuredOutputs{Kind: &frmpsv1.StructuredOutputs_Regex{Regex: *so.Regex}})
		}
		if so.Choice != nil {
			if len(so.Choice) == 0 {
				return nil, badRequest("structured_outputs", "`structured_outputs.choice` must not be empty.")
			}
			out = append(out, &frmpsv1.StructuredOutputs{Kind: &frmpsv1.StructuredOutputs_Choice{Choice: &frmpsv1.Choices{Values: so.Choice}}})
		}
		if so.Grammar != nil {
			out = append(out, &frmpsv1.StructuredOutputs{Kind: &frmpsv1.StructuredOutputs_Grammar{Grammar: *so.Grammar}})
		}
		if len(out) != 1 {
			return nil, badRequest("structured_outputs", fmt.Sprintf("`structured_outputs` must give exactly one of json, json_object, regex, choice, grammar; got %d.", len(out)))
		}
		return out[0], nil
	}
	return nil, nil
}

// jsonSchema checks a schema is a JSON object and keeps it compact.
func jsonSchema(raw json.RawMessage, param string) (*frmpsv1.StructuredOutputs, *apiError) {
	var obj map[string]any
	if err := json.Unmarshal(raw, &obj); err != nil {
		return nil, badRequest(param, "The JSON schema must be a JSON object.")
	}
	var b bytes.Buffer
	if err := json.Compact(&b, raw); err != nil {
		return nil, badRequest(param, "The JSON schema is not valid JSON.")
	}
	return &frmpsv1.StructuredOutputs{Kind: &frmpsv1.StructuredOutputs_JsonSchema{JsonSchema: b.String()}}, nil
}

// parsePenalties reads logit_bias, min_tokens and the penalties, with vLLM's bounds.
func parsePenalties(w *wireRequest, p *frmpsv1.SamplingParams) *apiError {
	if len(w.LogitBias) > 0 {
		p.LogitBias = make(map[uint32]float32, len(w.LogitBias))
		for k, v := range w.LogitBias {
			id, err := strconv.ParseUint(k, 10, 32)
			if err != nil || math.IsNaN(v) {
				return badRequest("logit_bias", fmt.Sprintf("`logit_bias` maps token ids to numbers; got %q: %v.", k, v))
			}
			p.LogitBias[uint32(id)] = float32(min(100, max(-100, v))) // clamped, as vLLM does
		}
	}
	if w.MinTokens != nil {
		if *w.MinTokens < 0 || *w.MinTokens > math.MaxUint32 {
			return badRequest("min_tokens", "`min_tokens` must be at least 0.")
		}
		if p.MaxTokens > 0 && uint32(*w.MinTokens) > p.MaxTokens {
			return badRequest("min_tokens", fmt.Sprintf("`min_tokens` (%d) must not exceed `max_tokens` (%d).", *w.MinTokens, p.MaxTokens))
		}
		p.MinTokens = uint32(*w.MinTokens)
	}
	for _, f := range []struct {
		v     *float64
		to    *float32
		param string
	}{{w.PresencePenalty, &p.PresencePenalty, "presence_penalty"}, {w.FrequencyPenalty, &p.FrequencyPenalty, "frequency_penalty"}} {
		if f.v == nil {
			continue
		}
		if math.IsNaN(*f.v) || *f.v < -2 || *f.v > 2 {
			return badRequest(f.param, fmt.Sprintf("`%s` must be between -2 and 2.", f.param))
		}
		*f.to = float32(*f.v)
	}
	if r := w.RepetitionPenalty; r != nil {
		if math.IsNaN(*r) || math.IsInf(*r, 0) || *r <= 0 {
			return badRequest("repetition_penalty", "`repetition_penalty` must be a number greater than 0 (1: none).")
		}
		p.RepetitionPenalty = float32(*r)
	}
	return nil
}

func parseStop(raw json.RawMessage) ([]string, *apiError) {
	if len(raw) == 0 || isNull(raw) {
		return nil, nil
	}
	var s string
	if err := json.Unmarshal(raw, &s); err == nil {
		if s == "" {
			return nil, nil
		}
		return []string{s}, nil
	}
	var list []string
	if err := json.Unmarshal(raw, &list); err != nil {
		return nil, badRequest("stop", "`stop` must be a string or a list of strings.")
	}
	if len(list) > maxStops {
		return nil, badRequest("stop", fmt.Sprintf("At most %d stop sequences are supported.", maxStops))
	}
	out := list[:0]
	for _, s := range list {
		if s != "" {
			out = append(out, s)
		}
	}
	return out, nil
}
