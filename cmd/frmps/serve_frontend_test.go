package main

import (
	"slices"
	"strings"
	"testing"

	"github.com/frmps/frmps/supervisor/vllmfront"
)

func TestServeFrontendValidation(t *testing.T) {
	for _, c := range []struct {
		mod  func(*serveOptions)
		want string
	}{
		{func(o *serveOptions) { o.Frontend, o.Engine = "vllm", "ref" }, "use --engine vllm"},
		{func(o *serveOptions) { o.Frontend = "nginx" }, "want frmps or vllm"},
		{func(o *serveOptions) { o.FrontendArgs = []string{"--x"} }, "give --frontend vllm"},
		{func(o *serveOptions) { o.Frontend, o.Engine, o.TensorParallelSize = "vllm", "vllm", 2 }, "tensor-parallel"},
		{func(o *serveOptions) { o.Engine, o.VllmArgs = "ref", []string{"--max-logprobs=5"} }, "give --engine vllm"},
	} {
		o := defaultServeOptions()
		c.mod(&o)
		if err := o.validate(); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("validate: %v, want %q", err, c.want)
		}
	}
	o := defaultServeOptions()
	o.Frontend, o.Engine = "vllm", "vllm"
	if err := o.validate(); err != nil {
		t.Errorf("--frontend vllm --engine vllm: %v", err)
	}
}

// --vllm-arg reaches the engines (as their --vllm-arg) and vLLM's API server
// (before --frontend-arg, which is the API server's only).
func TestVllmArgsReachEnginesAndFrontend(t *testing.T) {
	o := defaultServeOptions()
	o.Engine, o.Frontend, o.Model, o.ServedModelName = "vllm", "vllm", "/models/q", "q"
	o.EngineArgs = []string{"--max-num-seqs=8"}
	o.VllmArgs = []string{"--max-logprobs=50", "--enable-prefix-caching"}
	o.FrontendArgs = []string{"--enable-auto-tool-choice"}
	if err := o.validate(); err != nil {
		t.Fatal(err)
	}
	if got := o.supervisorConfig(pythonEnv{Python: "python3"}).EngineArgs; !slices.Equal(got,
		[]string{"--max-num-seqs=8", "--vllm-arg=--max-logprobs=50", "--vllm-arg=--enable-prefix-caching"}) {
		t.Fatalf("engine args %q", got)
	}
	if got := strings.Join(vllmfront.Args(o.vllmFrontConfig(pythonEnv{Python: "python3"}, "")), " "); !strings.HasSuffix(got, "--max-logprobs=50 --enable-prefix-caching --enable-auto-tool-choice") {
		t.Fatalf("frontend args %q", got)
	}
}

// The tool-calling flags: vLLM's names; frmps's front door implements hermes
// only; with --frontend vllm they go to vLLM's API server as they are.
func TestToolCallFlags(t *testing.T) {
	o := parseServe(t, "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
	if !o.EnableAutoToolChoice || o.ToolCallParser != "hermes" || o.validate() != nil {
		t.Fatalf("%+v: %v", o, o.validate())
	}
	o = parseServe(t, "--config", writeConfig(t, `{"enable_auto_tool_choice": true, "tool_call_parser": "hermes"}`))
	if !o.EnableAutoToolChoice || o.ToolCallParser != "hermes" {
		t.Fatalf("from --config: %+v", o)
	}
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--enable-auto-tool-choice"}, "--enable-auto-tool-choice requires --tool-call-parser"},
		{[]string{"--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"}, `--tool-call-parser "llama3_json": frmps's front door implements hermes`},
		{[]string{"--tool-call-parser", "mistral"}, `--tool-call-parser "mistral"`},
		{[]string{"--frontend", "vllm", "--engine", "vllm", "--tool-call-parser", "hermes", "--frontend-arg=--tool-call-parser=pythonic"}, "given twice"},
	} {
		o := parseServe(t, c.args...)
		if err := o.validate(); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%q: validate %v, want %q", c.args, err, c.want)
		}
	}
	// --frontend vllm: any of vLLM's parsers, forwarded (and a parser given as a
	// --frontend-arg is one too).
	o = parseServe(t, "--frontend", "vllm", "--engine", "vllm", "--model", "/models/q", "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json")
	if err := o.validate(); err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(vllmfront.Args(o.vllmFrontConfig(pythonEnv{Python: "python3"}, "")), " "); !strings.HasSuffix(got, " --enable-auto-tool-choice --tool-call-parser=llama3_json") {
		t.Errorf("frontend args %q", got)
	}
	o = parseServe(t, "--frontend", "vllm", "--engine", "vllm", "--enable-auto-tool-choice", "--frontend-arg=--tool-call-parser=pythonic", "--frontend-arg=--enable-auto-tool-choice")
	if err := o.validate(); err != nil {
		t.Fatal(err)
	}
	if got := o.frontendArgs(); !slices.Equal(got, []string{"--tool-call-parser=pythonic", "--enable-auto-tool-choice"}) {
		t.Errorf("frontend args %q (the flag given twice: once)", got)
	}
}
