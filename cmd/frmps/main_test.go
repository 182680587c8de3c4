package main

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/spf13/pflag"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
	"github.com/frmps/frmps/supervisor/engine"
)

// parseServe reads a serve command line as `frmps serve` does: the flags, then
// the --config file if one is named (a flag given wins over its key).
func parseServe(t *testing.T, args ...string) serveOptions {
	t.Helper()
	opts := defaultServeOptions()
	var cfgFile string
	f := pflag.NewFlagSet("serve", pflag.ContinueOnError)
	bindServeFlags(f, &opts, &cfgFile)
	if err := f.Parse(args); err != nil {
		t.Fatal(err)
	}
	if cfgFile != "" {
		if err := applyConfigFile(f, cfgFile); err != nil {
			t.Fatal(err)
		}
	}
	fixRingIfGiven(f, &opts)
	return opts
}

// writeConfig writes a --config file with body and returns its path.
func writeConfig(t *testing.T, body string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "frmps.json")
	if err := os.WriteFile(path, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

func TestConfigFileFlagsWin(t *testing.T) {
	path := writeConfig(t, `{"model":"qwen2.5-0.5b","sync_every":8,"port":9000,"restart_window":"2m","stall_timeout":"45s","no_mps":true}`)
	opts := parseServe(t, "--config", path, "--sync-every", "4", "--port", "8000")
	if opts.Model != "qwen2.5-0.5b" || !opts.NoMPS || opts.Breaker.Window != 2*time.Minute || opts.HeartbeatTimeout != 45*time.Second {
		t.Fatalf("file not applied: %+v", opts)
	}
	if opts.SyncEvery != 4 || opts.Port != 8000 {
		t.Fatalf("flags did not win: sync-every %d port %d", opts.SyncEvery, opts.Port)
	}
}

// --tensor-parallel-size from the file and the flag; it reaches the engines'
// command line only when above 1 (one process stays exactly as before).
func TestTensorParallelFlag(t *testing.T) {
	path := filepath.Join(t.TempDir(), "frmps.json")
	if err := os.WriteFile(path, []byte(`{"tensor_parallel_size":2}`), 0o600); err != nil {
		t.Fatal(err)
	}
	opts := defaultServeOptions()
	if opts.TensorParallelSize != 1 {
		t.Fatalf("default tensor parallel size %d, want 1", opts.TensorParallelSize)
	}
	var cfgFile string
	f := pflag.NewFlagSet("serve", pflag.ContinueOnError)
	bindServeFlags(f, &opts, &cfgFile)
	if err := f.Parse([]string{"--config", path}); err != nil {
		t.Fatal(err)
	}
	if err := applyConfigFile(f, cfgFile); err != nil {
		t.Fatal(err)
	}
	if opts.TensorParallelSize != 2 || opts.validate() != nil {
		t.Fatalf("tensor parallel size %d from the file (validate: %v)", opts.TensorParallelSize, opts.validate())
	}
	if got := opts.supervisorConfig(pythonEnv{}).TensorParallelSize; got != 2 {
		t.Fatalf("supervisor config tensor parallel size %d, want 2", got)
	}
	if err := f.Parse([]string{"--tensor-parallel-size", "1"}); err != nil || opts.TensorParallelSize != 1 {
		t.Fatalf("flag: %v, size %d", err, opts.TensorParallelSize)
	}
	inv := engine.Invocation{Role: engine.RoleActive, Model: "tiny", ControlSocket: "c", GenerationSocket: "g"}
	for _, tc := range []struct {
		n    int
		want bool
	}{{0, false}, {1, false}, {2, true}} {
		inv.TensorParallelSize = tc.n
		_, args, err := engine.PythonCLI{Engine: "ref"}.Command(inv)
		if err != nil {
			t.Fatal(err)
		}
		joined := strings.Join(args, " ")
		if got := strings.Contains(joined, "--tensor-parallel-size"); got != tc.want {
			t.Errorf("size %d: command line %q", tc.n, joined)
		}
		if tc.want && !strings.Contains(joined, "--tensor-parallel-size 2") {
			t.Errorf("size %d: command line %q", tc.n, joined)
		}
	}
	// vLLM takes TP > 1 too (frmps serve once refused it before the supervisor could see it).
	opts.Engine, opts.TensorParallelSize = "vllm", 2
	if err := opts.validate(); err != nil {
		t.Errorf("vllm TP=2: %v", err)
	}
}

// The hang thresholds from flags and from the file, and --stall-timeout as
// the older name of --heartbeat-timeout.
func TestHangFlags(t *testing.T) {
	path := writeConfig(t, `{"heartbeat_timeout":"2s","step_timeout_factor":4,"step_timeout_min":"3s","step_timeout_default":"2m"}`)
	opts := parseServe(t, "--config", path, "--step-timeout-min", "500ms")
	c := opts.supervisorConfig(pythonEnv{})
	if c.HeartbeatTimeout != 2*time.Second || c.StepTimeoutFactor != 4 || c.StepTimeoutMin != 500*time.Millisecond || c.StepTimeoutDefault != 2*time.Minute {
		t.Fatalf("config %+v", c)
	}
	opts = parseServe(t, "--stall-timeout", "7s")
	if opts.HeartbeatTimeout != 7*time.Second {
		t.Fatalf("--stall-timeout set the heartbeat timeout to %s", opts.HeartbeatTimeout)
	}
	if d := defaultServeOptions().supervisorConfig(pythonEnv{}); d.HeartbeatTimeout != time.Second || d.StepTimeoutFactor != 8 ||
		d.StepTimeoutMin != time.Second || d.StepTimeoutDefault != time.Minute {
		t.Fatalf("defaults %+v", d)
	}
}

func TestSharedMPSFlags(t *testing.T) {
	opts := parseServe(t, "--config", writeConfig(t, `{"mps_pipe_dir":"/op/mps/pipe","mps_log_dir":"/op/mps/log"}`))
	if c := opts.supervisorConfig(pythonEnv{}); c.MPSPipeDir != "/op/mps/pipe" || c.MPSLogDir != "/op/mps/log" || c.NoMPS {
		t.Fatalf("config %+v", c)
	}
	if err := opts.validate(); err != nil {
		t.Fatal(err)
	}
}

func TestConfigFileErrors(t *testing.T) {
	dir := t.TempDir()
	for name, body := range map[string]string{
		"unknown.json": `{"modle":"x"}`,
		"badjson.json": `{`,
		"baddur.json":  `{"restart_window":"soon"}`,
	} {
		p := filepath.Join(dir, name)
		os.WriteFile(p, []byte(body), 0o600)
		if err := applyConfigFile(newServeCmd().Flags(), p); err == nil {
			t.Errorf("%s accepted", name)
		}
	}
	if err := applyConfigFile(newServeCmd().Flags(), filepath.Join(dir, "missing.json")); err == nil {
		t.Error("missing file accepted")
	}
}

func TestServeRejectsBadOptions(t *testing.T) {
	for _, mod := range []func(*serveOptions){
		func(o *serveOptions) { o.Port = 70000 },
		func(o *serveOptions) { o.LogLevel = "loud" },
		func(o *serveOptions) { o.AdminAddr = "0.0.0.0:8001" },
		func(o *serveOptions) { o.SyncEvery = 0 },
		func(o *serveOptions) { o.Breaker.MaxRestarts = 0 },
		func(o *serveOptions) { o.Breaker.Window = 0 },
		func(o *serveOptions) { o.RingCapacity = 5000000 },
		func(o *serveOptions) { o.Device = "cuda:0" },
		func(o *serveOptions) { o.StepTimeoutFactor = 0.5 },
		func(o *serveOptions) { o.StepTimeoutMin = 0 },
		func(o *serveOptions) { o.StepTimeoutDefault = -time.Second },
		func(o *serveOptions) { o.HeartbeatTimeout = 0 },
		func(o *serveOptions) { o.MPSPipeDir, o.NoMPS = "/op/mps", true },
		func(o *serveOptions) { o.MPSLogDir = "/op/log" },
		func(o *serveOptions) { o.MPSPipeDir = "op/mps" },
		func(o *serveOptions) { o.TensorParallelSize = 0 },
		func(o *serveOptions) { o.Spares = 0 },
		func(o *serveOptions) { o.Spares = 9 },
		func(o *serveOptions) { o.StandbyKV = "rw" },
	} {
		o := defaultServeOptions()
		mod(&o)
		if err := o.validate(); err == nil {
			t.Errorf("options %+v accepted", o)
		}
		if err := runServe(t.Context(), o, &bytes.Buffer{}); err == nil {
			t.Errorf("runServe accepted %+v", o)
		}
	}
	if err := defaultServeOptions().validate(); err != nil {
		t.Fatalf("defaults rejected: %v", err)
	}
}

func TestPrintStatus(t *testing.T) {
	now := time.Unix(1000, 0)
	st := &frmpsv1.Status{State: "serving_ready", StateCause: "standby ready", Model: "tiny", Engine: "ref", SyncEvery: 16,
		Mps: true, MpsState: "running", CrashLoopOpen: true, TensorParallelSize: 2,
		Engines: []*frmpsv1.EngineStatus{{Role: "active", Pid: 12, State: "serving", InMps: true, StartedUnixNanos: time.Unix(940, 0).UnixNano(),
			Engine: "vllm 0.26.0", Device: "cuda:0", InitSeconds: 61.2, Running: 3, Waiting: 1, Weights: "loaded:/models/q"},
			{Role: "standby", Pid: 13, State: "ready", Engine: "vllm 0.26.0", Device: "cuda:0", InitSeconds: 9.3, FromSpare: true}},
		Failovers: []*frmpsv1.FailoverRecord{{Seq: 3, Cause: "misaligned_address", DurationSeconds: 0.0042, ResumedRequests: 5, Ok: true, Detail: "x"}},
		Spare: &frmpsv1.Spare{Enabled: true, State: "ready", Pid: 14, Activations: 2, ColdStarts: 1, LastReadySeconds: 19.6,
			Size: 2, ReadyCount: 1, RssBytes: 3 << 30},
		Frontend: &frmpsv1.FrontendStatus{Kind: "vllm", Pid: 15, State: "serving", EngineConnected: true, OpenRequests: 4,
			VllmVersion: "0.26.0", EngineLost: 3, EngineBack: 3},
		Resolved: &frmpsv1.Resolved{Device: "cuda", Memory: "cuda-vmm", Engine: "vllm", Model: "qwen2.5-14b", Reason: "GPU visible (nvidia-smi -L lists 1); vLLM 0.26.0 installed"},
	}
	var b bytes.Buffer
	if err := printStatus(&b, st, now); err != nil {
		t.Fatal(err)
	}
	out := b.String()
	for _, want := range []string{"serving_ready", "(standby ready)", "OPEN", "active", "serving", "1m0s", "#3", "misaligned_address", "4.2ms", "running", "vllm 0.26.0 cuda:0 (up in 61.2s)", "3 running, 1 waiting", "tensor parallel 2",
		"(up in 9.3s from a spare)", "WEIGHTS", "loaded:/models/q  ", "spare:", "ready (pid 14), 1 of 2 ready, 3072 MiB host memory, 2 engines launched from spares, 1 cold, imports took 19.6s",
		"frontend:", "vllm 0.26.0 (pid 15): serving, engine connected, 4 open requests, 3 engines lost, 3 back",
		"device=cuda memory=cuda-vmm engine=vllm model=qwen2.5-14b", "(why: GPU visible (nvidia-smi -L lists 1); vLLM 0.26.0 installed)"} {
		if !strings.Contains(out, want) {
			t.Errorf("status output lacks %q:\n%s", want, out)
		}
	}
}

func TestServedModelName(t *testing.T) {
	dir := func(m string) (string, error) { return "/cache/models/" + m, nil }
	for _, tc := range []struct {
		args          []string
		model, served string
	}{
		// vLLM reads a directory, but clients keep the name they were told to use.
		{[]string{"--engine", "vllm", "--model", "qwen2.5-0.5b"}, "/cache/models/qwen2.5-0.5b", "qwen2.5-0.5b"},
		{[]string{"--engine", "vllm", "--model", "qwen2.5-0.5b", "--served-model-name", "qwen"}, "/cache/models/qwen2.5-0.5b", "qwen"},
		{[]string{"--engine", "ref", "--model", "tiny"}, "tiny", "tiny"},
	} {
		opts := defaultServeOptions()
		var cfgFile string
		f := pflag.NewFlagSet("serve", pflag.ContinueOnError)
		bindServeFlags(f, &opts, &cfgFile)
		if err := f.Parse(tc.args); err != nil {
			t.Fatal(err)
		}
		if err := opts.resolveModel(dir); err != nil {
			t.Fatal(err)
		}
		if c := opts.supervisorConfig(pythonEnv{}); c.Model != tc.model || c.ServedModelName != tc.served {
			t.Fatalf("%v: model %q served as %q, want %q as %q", tc.args, c.Model, c.ServedModelName, tc.model, tc.served)
		}
	}
	opts := defaultServeOptions()
	opts.Engine, opts.Model = "vllm", "nope"
	if err := opts.resolveModel(func(string) (string, error) { return "", errors.New("no preset nope") }); err == nil {
		t.Fatal("a model that does not resolve must fail the start")
	}
}

// --standby-kv (and its file key) reaches every engine's environment; writable by default.
func TestStandbyKVFlag(t *testing.T) {
	env := func(o serveOptions) string {
		got := ""
		for _, e := range o.supervisorConfig(pythonEnv{Env: []string{"FRMPS_STANDBY_KV=from-the-shell"}}).BaseEnv {
			if v, ok := strings.CutPrefix(e, "FRMPS_STANDBY_KV="); ok {
				got = v // the last one wins, as in the engines' environment
			}
		}
		return got
	}
	if got := env(defaultServeOptions()); got != "writable" {
		t.Fatalf("default: %q", got)
	}
	if opts := parseServe(t, "--standby-kv", "readonly"); env(opts) != "readonly" || opts.validate() != nil {
		t.Fatalf("flag: %q, %v", env(opts), opts.validate())
	}
	if opts := parseServe(t, "--config", writeConfig(t, `{"standby_kv":"readonly"}`)); env(opts) != "readonly" {
		t.Fatalf("file: %q", env(opts))
	}
}

// --prime-fault-path (and its file key) reaches the supervisor's config.
func TestPrimeFaultPathFlag(t *testing.T) {
	if defaultServeOptions().supervisorConfig(pythonEnv{}).PrimeFaultPath {
		t.Fatal("fault path primed by default")
	}
	if !parseServe(t, "--prime-fault-path").supervisorConfig(pythonEnv{}).PrimeFaultPath {
		t.Fatal("flag not applied")
	}
	if !parseServe(t, "--config", writeConfig(t, `{"prime_fault_path":true}`)).PrimeFaultPath {
		t.Fatal("file key not applied")
	}
}

// --exact: vLLM's batch-invariant mode in the engines' (and vLLM's API server's)
// environment with Triton attention unless a backend is given; the reference
// engine's --exact; nothing without it; refused with --enforce-eager.
func TestExactFlag(t *testing.T) {
	has := func(xs []string, x string) bool { return slices.Contains(xs, x) }
	o := parseServe(t, "--exact", "--engine", "vllm")
	c := o.supervisorConfig(pythonEnv{Env: []string{"VLLM_BATCH_INVARIANT=0", "TORCHINDUCTOR_DETERMINISTIC=0", "PATH=/bin"}})
	if !has(c.EngineArgs, "--vllm-arg=--attention-backend=TRITON_ATTN") || !has(c.BaseEnv, "VLLM_BATCH_INVARIANT=1") ||
		has(c.BaseEnv, "VLLM_BATCH_INVARIANT=0") || !has(c.BaseEnv, "TORCHINDUCTOR_DETERMINISTIC=1") ||
		has(c.BaseEnv, "TORCHINDUCTOR_DETERMINISTIC=0") || !has(c.BaseEnv, "PATH=/bin") || has(c.EngineArgs, "--exact") || o.validate() != nil {
		t.Fatalf("vllm --exact: args %q env %q err %v", c.EngineArgs, c.BaseEnv, o.validate())
	}
	if f := o.vllmFrontConfig(pythonEnv{}, ""); !has(f.Env, "VLLM_BATCH_INVARIANT=1") || !has(f.Env, "TORCHINDUCTOR_DETERMINISTIC=1") ||
		!has(f.VLLMArgs, "--attention-backend=TRITON_ATTN") {
		t.Fatalf("vllm --exact, the API server: env %q args %q", f.Env, f.VLLMArgs)
	}
	o = parseServe(t, "--exact", "--engine", "vllm", "--vllm-arg=--attention-backend=FLEX_ATTENTION")
	if a := o.engineArgs(); has(a, "--vllm-arg=--attention-backend=TRITON_ATTN") || !has(a, "--vllm-arg=--attention-backend=FLEX_ATTENTION") {
		t.Fatalf("a given backend is kept: %q", a)
	}
	o = parseServe(t, "--exact", "--engine", "ref")
	if c := o.supervisorConfig(pythonEnv{}); !has(c.EngineArgs, "--exact") || has(c.BaseEnv, "VLLM_BATCH_INVARIANT=1") {
		t.Fatalf("ref --exact: args %q env %q", c.EngineArgs, c.BaseEnv)
	}
	for _, o := range []serveOptions{parseServe(t, "--engine", "vllm"), parseServe(t, "--engine", "ref")} {
		if c := o.supervisorConfig(pythonEnv{}); has(c.EngineArgs, "--exact") || has(c.BaseEnv, "VLLM_BATCH_INVARIANT=1") ||
			has(c.BaseEnv, "TORCHINDUCTOR_DETERMINISTIC=1") ||
			slices.ContainsFunc(c.EngineArgs, func(a string) bool { return strings.Contains(a, "attention-backend") }) {
			t.Fatalf("no --exact: args %q env %q", c.EngineArgs, c.BaseEnv)
		}
	}
	if err := parseServe(t, "--exact", "--engine", "vllm", "--vllm-arg=--enforce-eager").validate(); err == nil ||
		!strings.Contains(err.Error(), "enforce-eager") {
		t.Fatalf("--exact with --enforce-eager: %v", err)
	}
}

// The ring grows for the first active's largest snapshot at frmps's default
// size only: a --ring-capacity given (flag or file) stays.
func TestRingGrowOnlyAtTheDefault(t *testing.T) {
	grow := func(args ...string) bool { return !parseServe(t, args...).supervisorConfig(pythonEnv{}).RingFixed }
	if !grow() || grow("--ring-capacity", "8388608") || grow("--config", writeConfig(t, `{"ring_capacity": 65536}`)) {
		t.Fatalf("default %v, flag %v, file %v", grow(), grow("--ring-capacity", "8388608"),
			grow("--config", writeConfig(t, `{"ring_capacity": 65536}`)))
	}
}
