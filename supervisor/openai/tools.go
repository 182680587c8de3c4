package openai

import (
	"encoding/json"
	"fmt"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
)

// Tool calling in /v1/chat/completions, as vLLM's OpenAI server does it
// (0.26.0, `vllm serve --enable-auto-tool-choice --tool-call-parser hermes`):
//
//   - The request's tools go to the engine (GenerateRequest.tools_json), whose
//     chat template renders them into the prompt, whatever tool_choice says
//     ("none" too). History messages carry their tool calls and tool results.
//   - tool_choice "auto": the output is free; the hermes parser reads
//     <tool_call>{"name": …, "arguments": …}</tool_call> blocks out of it
//     (toolparse_hermes.go). "required": the output is constrained to a JSON
//     array of {name, parameters}, one of the tools each; a named function: to
//     that function's parameters. Both through the structured-outputs
//     constraint response_format uses (a JSON schema), and read back as calls
//     (toolcalls.go).
//   - Without the parser (Config.EnableAutoToolChoice and ToolCallParser),
//     "auto", "required" and a named function are refused with vLLM's 400s; so
//     is a request with tools and no tool_choice, which means "auto".
//
// The parser's state lives here, per choice, and sees every token before and
// after a failover: a stream resumed in the middle of a call continues it.

// toolMode is how a choice's output becomes tool calls.
type toolMode uint8

const (
	toolsAuto     toolMode = iota + 1 // the hermes parser reads calls out of free text
	toolsRequired                     // the output is a JSON array of {name, parameters}
	toolsNamed                        // the output is the named function's arguments
)

// toolPlan is a chat request's tool calling; nil: the output is plain content.
type toolPlan struct {
	mode     toolMode
	name     string // toolsNamed: the function
	parallel bool   // parallel_tool_calls (default true); false keeps the first call only
}

// toolRequest is what parseTools read from a chat request.
type toolRequest struct {
	toolsJSON string    // the tools for the chat template; "" for none
	plan      *toolPlan // nil: plain content
	// schema: named and required replace the request's own constraint with
	// this JSON schema ("" keeps it: no tool constraint).
	schema string
}

// autoTools says whether the front door parses tool calls (vLLM's
// --enable-auto-tool-choice with a --tool-call-parser).
func (c *Config) autoTools() bool { return c.EnableAutoToolChoice && c.ToolCallParser != "" }

// ToolCallParsers are the --tool-call-parser names the front door implements.
var ToolCallParsers = []string{"hermes"}

// parseTools reads tools, tool_choice and parallel_tool_calls with vLLM's
// checks, in vLLM's order.
func parseTools(w *wireRequest, cfg *Config) (*toolRequest, *apiError) {
	tools, e := parseToolList(w.Tools)
	if e != nil {
		return nil, e
	}
	r := &toolRequest{}
	if tools != nil {
		r.toolsJSON = string(tools.appendCompact(nil))
	}
	choice, named, e := parseToolChoice(w.ToolChoice, tools)
	if e != nil {
		return nil, e
	}
	if (named != "" || choice == "null") && hasSOConstraint(w.StructuredOutputs) {
		return nil, badRequest("structured_outputs", "You can only either use constraints for structured outputs or tools, not both.")
	}
	switch choice {
	case "none", "null":
		return r, nil
	}
	if !cfg.autoTools() {
		switch {
		case choice == "auto":
			return nil, badRequest("tool_choice", `"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set`)
		case named != "":
			return nil, badRequest("tool_choice", fmt.Sprintf(`tool_choice=function "%s" requires --tool-call-parser to be set`, named))
		default:
			return nil, badRequest("tool_choice", `tool_choice="required" requires --tool-call-parser to be set`)
		}
	}
	r.plan = &toolPlan{parallel: w.ParallelToolCalls == nil || *w.ParallelToolCalls}
	switch {
	case named != "":
		r.plan.mode, r.plan.name = toolsNamed, named
		for _, t := range tools.vals {
			f := t.get("function")
			if f.get("name").str == named {
				if p := f.get("parameters"); p.kind != 'n' {
					r.schema = string(p.appendCompact(nil))
				}
				break
			}
		}
	case choice == "required":
		r.plan.mode = toolsRequired
		if r.schema, e = requiredSchema(tools); e != nil {
			return nil, e
		}
	default:
		r.plan.mode = toolsAuto
	}
	return r, nil
}

// parseToolList checks `tools` and normalizes each to what vLLM hands the
// chat template: {"type": "function", "function": {"name", "description",
// "parameters"[, "strict"]}}, description and parameters null when not given.
// nil: no tools.
func parseToolList(raw json.RawMessage) (*jnode, *apiError) {
	if len(raw) == 0 || isNull(raw) {
		return nil, nil
	}
	list, err := parseJNode(raw)
	if err != nil || list.kind != '[' {
		return nil, badRequest("tools", ``+"`tools`"+` must be an array of {"type": "function", "function": {"name", "description", "parameters"}} objects.`)
	}
	if len(list.vals) == 0 {
		return nil, badRequest("tools", "`tools` must not be an empty array. Either provide at least one tool or omit the field entirely.")
	}
	out := &jnode{kind: '['}
	for i, t := range list.vals {
		param := fmt.Sprintf("tools[%d]", i)
		if t.kind != '{' {
			return nil, badRequest(param, param+" must be an object.")
		}
		if ty := t.get("type"); ty != nil && (ty.kind != '"' || ty.str != "function") {
			return nil, badRequest(param+".type", param+`.type must be "function".`)
		}
		f := t.get("function")
		if f == nil || f.kind != '{' {
			return nil, badRequest(param+".function", param+".function must be an object with a `name`.")
		}
		name := f.get("name")
		if name == nil || name.kind != '"' {
			return nil, badRequest(param+".function.name", param+".function.name must be a string.")
		}
		fn := &jnode{kind: '{'}
		fn.set("name", name)
		for _, m := range []struct {
			key  string
			kind byte
			what string
		}{{"description", '"', "a string"}, {"parameters", '{', "an object (a JSON schema)"}} {
			v := f.get(m.key)
			if v == nil {
				v = &jnode{kind: 'n'}
			}
			if v.kind != 'n' && v.kind != m.kind {
				return nil, badRequest(param+".function."+m.key, fmt.Sprintf("%s.function.%s must be %s or null.", param, m.key, m.what))
			}
			fn.set(m.key, v)
		}
		if s := f.get("strict"); s != nil && s.kind != 'n' {
			if s.kind != 't' && s.kind != 'f' {
				return nil, badRequest(param+".function.strict", param+".function.strict must be true, false or null.")
			}
			fn.set("strict", s)
		}
		tool := &jnode{kind: '{'}
		tool.set("type", &jnode{kind: '"', str: "function"})
		tool.set("function", fn)
		out.vals = append(out.vals, tool)
	}
	return out, nil
}

// parseToolChoice reads tool_choice: "none", "auto", "required", "null" (given
// as null) or, for a named function, "" and its name.
func parseToolChoice(raw json.RawMessage, tools *jnode) (choice, named string, e *apiError) {
	if len(raw) == 0 {
		if tools != nil {
			return "auto", "", nil // vLLM's default with tools
		}
		return "none", "", nil
	}
	if isNull(raw) {
		return "null", "", nil
	}
	v, err := parseJNode(raw)
	if err != nil {
		return "", "", badRequest("tool_choice", "`tool_choice` is not valid JSON.")
	}
	if v.kind == '"' && v.str == "none" {
		return "none", "", nil
	}
	if tools == nil {
		return "", "", badRequest("tool_choice", "When using `tool_choice`, `tools` must be set.")
	}
	if v.kind == '"' && (v.str == "auto" || v.str == "required") {
		return v.str, "", nil
	}
	if v.kind != '{' {
		return "", "", badRequest("tool_choice", fmt.Sprintf("Invalid value for `tool_choice`: %s! Only named tools, \"none\", \"auto\" or \"required\" are supported.", raw))
	}
	const usage = "Correct usage: `{\"type\": \"function\", \"function\": {\"name\": \"my_function\"}}`"
	if ty := v.get("type"); ty != nil && (ty.kind != '"' || ty.str != "function") {
		return "", "", badRequest("tool_choice.type", "`tool_choice.type` must be \"function\". "+usage)
	}
	f := v.get("function")
	if f == nil || f.kind != '{' {
		return "", "", badRequest("tool_choice.function", "Invalid value for `function` in `tool_choice`! "+usage)
	}
	n := f.get("name")
	if n == nil {
		return "", "", badRequest("tool_choice.function.name", "Expected field `name` in `function` in `tool_choice`! "+usage)
	}
	if n.kind != '"' || n.str == "" {
		return "", "", badRequest("tool_choice.function.name", "Invalid `name` in `function` in `tool_choice`! "+usage)
	}
	for _, t := range tools.vals {
		if t.get("function").get("name").str == n.str {
			return "", n.str, nil
		}
	}
	return "", "", badRequest("tool_choice", "The tool specified in `tool_choice` does not match any of the specified `tools`")
}

// hasSOConstraint: structured_outputs gives json, regex or choice (vLLM's
// count of constraints that cannot go with a named tool).
func hasSOConstraint(raw json.RawMessage) bool {
	if len(raw) == 0 || isNull(raw) {
		return false
	}
	v, err := parseJNode(raw)
	if err != nil {
		return false // parseStructured refuses it
	}
	for _, k := range []string{"json", "regex", "choice"} {
		if m := v.get(k); m != nil && m.kind != 'n' {
			return true
		}
	}
	return false
}

// requiredSchema is vLLM's schema for tool_choice "required": an array of at
// least one {name, parameters} object, each one of the tools, with the tools'
// $defs gathered at the top (a name defined twice differently is refused).
func requiredSchema(tools *jnode) (string, *apiError) {
	anyOf := &jnode{kind: '['}
	defs := &jnode{kind: '{'}
	for _, t := range tools.vals {
		f := t.get("function")
		params := f.get("parameters")
		if params.kind == 'n' || len(params.vals) == 0 {
			params = &jnode{kind: '{'}
			params.set("type", &jnode{kind: '"', str: "object"})
			params.set("properties", &jnode{kind: '{'})
		} else if d := params.get("$defs"); d != nil {
			if d.kind == '{' {
				for i, k := range d.keys {
					if prev := defs.get(k); prev != nil && !jnodeEqual(prev, d.vals[i]) {
						return "", badRequest("tools", fmt.Sprintf("Tool definition '%s' has multiple schemas, which is not supported.", k))
					}
					defs.set(k, d.vals[i])
				}
			}
			params = params.without("$defs")
		}
		nameSchema := &jnode{kind: '{'}
		nameSchema.set("type", &jnode{kind: '"', str: "string"})
		nameSchema.set("enum", &jnode{kind: '[', vals: []*jnode{f.get("name")}})
		props := &jnode{kind: '{'}
		props.set("name", nameSchema)
		props.set("parameters", params)
		one := &jnode{kind: '{'}
		one.set("properties", props)
		one.set("required", &jnode{kind: '[', vals: []*jnode{{kind: '"', str: "name"}, {kind: '"', str: "parameters"}}})
		anyOf.vals = append(anyOf.vals, one)
	}
	items := &jnode{kind: '{'}
	items.set("type", &jnode{kind: '"', str: "object"})
	items.set("anyOf", anyOf)
	s := &jnode{kind: '{'}
	s.set("type", &jnode{kind: '"', str: "array"})
	s.set("minItems", &jnode{kind: '0', str: "1"})
	s.set("items", items)
	if len(defs.keys) > 0 {
		s.set("$defs", defs)
	}
	return string(s.appendCompact(nil)), nil
}

// without is object n less its member k (a copy; n is left as it is).
func (n *jnode) without(k string) *jnode {
	out := &jnode{kind: '{'}
	for i, key := range n.keys {
		if key != k {
			out.set(key, n.vals[i])
		}
	}
	return out
}

// jnodeEqual compares two values as Python compares parsed JSON (objects
// whatever their key order; 1 == 1.0).
func jnodeEqual(a, b *jnode) bool {
	if a.kind == '0' && b.kind == '0' {
		return pyNumber(a.str) == pyNumber(b.str) || numEqual(a.str, b.str)
	}
	if a.kind != b.kind || a.str != b.str || len(a.vals) != len(b.vals) {
		return false
	}
	switch a.kind {
	case '[':
		for i := range a.vals {
			if !jnodeEqual(a.vals[i], b.vals[i]) {
				return false
			}
		}
	case '{':
		for i, k := range a.keys {
			o := b.get(k)
			if o == nil || !jnodeEqual(a.vals[i], o) {
				return false
			}
		}
	}
	return true
}

func numEqual(a, b string) bool {
	var x, y float64
	return json.Unmarshal([]byte(a), &x) == nil && json.Unmarshal([]byte(b), &y) == nil && x == y
}

// applyToolConstraint puts a named or required tool choice's schema in place
// of the request's own constraint, as vLLM does.
func (r *toolRequest) applyToolConstraint(p *frmpsv1.SamplingParams) {
	if r.schema != "" {
		p.StructuredOutputs = &frmpsv1.StructuredOutputs{Kind: &frmpsv1.StructuredOutputs_JsonSchema{JsonSchema: r.schema}}
	}
}

// historyToolCalls reads an assistant message's tool_calls for the chat
// template: each a {"type": "function", "function": {…}} object kept as given,
// its arguments decoded from OpenAI's JSON string ({} when empty), as vLLM
// hands them to the template. "" for none.
func historyToolCalls(raw json.RawMessage, param string) (string, *apiError) {
	if len(raw) == 0 || isNull(raw) {
		return "", nil
	}
	list, err := parseJNode(raw)
	if err != nil || list.kind != '[' {
		return "", badRequest(param, param+" must be an array of tool calls.")
	}
	if len(list.vals) == 0 {
		return "", nil // dropped, so that templates take the plain assistant path
	}
	const onlyFunctions = "chat completions only support assistant tool_calls of type 'function'."
	for _, c := range list.vals {
		if c.kind != '{' {
			return "", badRequest(param, "assistant tool_calls entries must be objects.")
		}
		if ty := c.get("type"); ty != nil && (ty.kind != '"' || ty.str != "function") {
			return "", badRequest(param, onlyFunctions)
		}
		f := c.get("function")
		if f == nil || f.kind != '{' {
			return "", badRequest(param, onlyFunctions)
		}
		args := f.get("arguments")
		switch {
		case args == nil || !args.truthy():
			args = &jnode{kind: '{'}
		case args.kind == '"':
			v, err := parseJNode([]byte(args.str))
			if err != nil {
				return "", badRequest(param, fmt.Sprintf("The arguments of an assistant tool call are not valid JSON: %v", err))
			}
			if v.kind == 'n' {
				v = &jnode{kind: '{'}
			}
			args = v
		case args.kind != '{' && args.kind != '[':
			return "", badRequest(param, "The arguments of an assistant tool call must be a JSON string.")
		}
		f.set("arguments", args)
	}
	return string(list.appendCompact(nil)), nil
}

// historyString reads an optional string member of a message (tool_call_id,
// name); ok false when absent, null or not a string.
func historyString(raw json.RawMessage) (string, bool) {
	if len(raw) == 0 || isNull(raw) {
		return "", false
	}
	var s string
	if json.Unmarshal(raw, &s) != nil {
		return "", false
	}
	return s, true
}

// toolsForTokenize reads /tokenize's tools (vLLM's tokenize route takes them
// for the chat template; an empty list is no tools).
func toolsForTokenize(raw json.RawMessage) (string, *apiError) {
	if len(raw) == 0 || isNull(raw) {
		return "", nil
	}
	if l, err := parseJNode(raw); err == nil && l.kind == '[' && len(l.vals) == 0 {
		return "", nil
	}
	tools, e := parseToolList(raw)
	if e != nil || tools == nil {
		return "", e
	}
	return string(tools.appendCompact(nil)), nil
}
