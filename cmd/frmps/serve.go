package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"os"
	"os/signal"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"golang.org/x/sync/errgroup"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
	"github.com/frmps/frmps/ringbuf"
	"github.com/frmps/frmps/supervisor"
	"github.com/frmps/frmps/supervisor/admin"
	"github.com/frmps/frmps/supervisor/engine"
	"github.com/frmps/frmps/supervisor/mps"
	"github.com/frmps/frmps/supervisor/openai"
	"github.com/frmps/frmps/supervisor/sdnotify"
	"github.com/frmps/frmps/supervisor/vllmfront"
)

// serveOptions are `frmps serve`'s settings: the deployment the supervisor
// runs (supervisor.Config, whose defaults and rules are
// supervisor.DefaultConfig and Config.Validate), and what serve runs around it:
// the OpenAI endpoint, the admin API, the engines' environment, logging. The
// flags bind to these fields; a --config file's keys are the flags' names
// (applyConfigFile).
type serveOptions struct {
	supervisor.Config

	StandbyKV    string   // FRMPS_STANDBY_KV in the engines' environment
	Exact        bool     // batch-invariant engines: a resumed stream equals the no-fault one (exactArgs)
	VllmArgs     []string // vLLM's flags, for the engines and vLLM's API server
	Frontend     string
	FrontendArgs []string
	// Tool calling, vLLM's flags: the front door parses calls (or, with
	// --frontend vllm, vLLM's API server gets the flags).
	EnableAutoToolChoice bool
	ToolCallParser       string
	Host                 string
	Port                 int
	AdminAddr            string
	AdminAllowRemote     bool
	MaxConcurrent        int
	MaxChoices           int
	MaxQueue             int
	MaxBodyBytes         int64
	MaxConnections       int
	APIKeyFile           string
	LogLevel             string
	LogJSON              bool
}

func defaultServeOptions() serveOptions {
	return serveOptions{
		Config:    supervisor.DefaultConfig(),
		StandbyKV: "writable", Frontend: "frmps", Port: 8000, AdminAddr: "127.0.0.1:8001", LogLevel: "info",
	}
}

func newServeCmd() *cobra.Command {
	opts := defaultServeOptions()
	var configFile string
	d := supervisor.DefaultConfig()
	refModel, _ := supervisor.DefaultModel("ref")
	vllmModel, _ := supervisor.DefaultModel("vllm")
	cmd := &cobra.Command{
		Use:   "serve",
		Short: "Run an active/standby engine pair behind an OpenAI-compatible endpoint",
		Long: fmt.Sprintf(`Run an active/standby engine pair behind an OpenAI-compatible endpoint.

The active engine runs inside a private MPS session (unless --no-mps), the
standby outside it, asleep with the shared weights and KV cache mapped. On a
GPU shared through the operator's MPS daemon (e.g. Kubernetes MPS sharing),
--mps-pipe-dir joins that daemon instead: frmps checks that it answers, runs
the active in it, and never starts, stops or restarts it. A GPU in
Exclusive_Process compute mode is refused at start: the standby needs a CUDA
context of its own outside MPS. When
the active dies the standby takes over its requests; a fresh standby is then
started. SIGTERM or SIGINT shuts everything down gracefully.

Settings may also come from a JSON file (--config) whose keys are the flag
names with underscores (e.g. {"model": "qwen2.5-0.5b", "sync_every": 8,
"restart_window": "2m"}); flags given on the command line override the file.

Hang detection: the active's heartbeats come from a thread that never waits
on the device. When they stop for --heartbeat-timeout (%s; a stopped or
frozen process), or when one engine step runs longer than
max(--step-timeout-min, --step-timeout-factor × the engine's estimate for it)
(max(%s, %g × estimate); a kernel that never returns), or longer than
--step-timeout-default (%s) while the engine has no estimate (its first
steps, a far larger batch than before), the active is fenced and the standby
takes over.

--device, --memory and --engine default to auto: on a host with a visible GPU
the engines run vLLM on it with cuda-vmm pools (the reference engine, said in
one line, where vLLM is not installed in the engines' interpreter); without a
GPU, the reference engine on the CPU with host-shm pools. --model defaults to
the engine's default model: %q, the reference engine's small preset that
runs on a CPU in seconds, or %q for vLLM. What was resolved, and
why, is logged at start and shown by frmps status; a flag given explicitly is
taken as given (e.g. --model qwen2.5-14b on a GPU runs vLLM with 14B).`,
			d.HeartbeatTimeout, d.StepTimeoutMin, d.StepTimeoutFactor, d.StepTimeoutDefault, refModel, vllmModel),
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if configFile != "" {
				if err := applyConfigFile(cmd.Flags(), configFile); err != nil {
					return err
				}
			}
			fixRingIfGiven(cmd.Flags(), &opts)
			return runServe(cmd.Context(), opts, cmd.ErrOrStderr())
		},
	}
	bindServeFlags(cmd.Flags(), &opts, &configFile)
	return cmd
}

func bindServeFlags(f *pflag.FlagSet, opts *serveOptions, configFile *string) {
	f.StringVar(configFile, "config", "", "JSON config file (flags override it)")
	refModel, _ := supervisor.DefaultModel("ref")
	vllmModel, _ := supervisor.DefaultModel("vllm")
	f.StringVar(&opts.Model, "model", opts.Model, fmt.Sprintf("model: a preset name (tiny, qwen2.5-0.5b, …, qwen2.5-14b) or a model directory (default: the engine's default model, %s for ref, %s for vllm)", refModel, vllmModel))
	f.StringVar(&opts.ServedModelName, "served-model-name", opts.ServedModelName, "the model name clients send and /v1/models lists (default: --model as given, as vllm serve does)")
	f.StringVar(&opts.Engine, "engine", opts.Engine, "engine: auto (vllm on a GPU where vLLM is installed, else ref), ref (the reference engine), vllm, or a Python adapter factory as package.module:Factory (proto/frmps/v1/ENGINE.md); checked by the engine side before anything starts")
	f.StringVar(&opts.Python, "python", opts.Python, "Python interpreter that runs the engines, with frmps_engine importable (default: $FRMPS_PYTHON, else the .venv of the source checkout holding this binary, else python3)")
	f.Uint32Var(&opts.SyncEvery, "sync-every", opts.SyncEvery, "engine steps between forward-state syncs to the ring (1: every step; the publish overlaps the device, and a takeover replays at most one token)")
	f.BoolVar(&opts.NoMPSFaultWatch, "no-mps-fault-watch", opts.NoMPSFaultWatch, "do not follow the MPS server's log: fail over when the active dies of a fault, not as soon as the server says it tears the active's context down")
	f.StringVar(&opts.Spare, "spare", opts.Spare, "keep one engine process started ahead of need (interpreter up, engine imports done, GPU untouched), so the engine launched after a fault skips Python's start-up: auto (on for --device cuda), on or off")
	f.IntVar(&opts.Spares, "spares", opts.Spares, fmt.Sprintf("how many spare engine processes to keep when --spare is on (1 to %d): more than one keeps the restore after a fault fast when faults come faster than a spare's imports (20-30 s with vLLM), at the host memory of one imported engine each", supervisor.MaxSpares))
	f.BoolVar(&opts.NoFailback, "no-failback", opts.NoFailback, "after a failover, leave the promoted active outside MPS (by default a standby starts inside MPS and the pair swaps back in a planned handover)")
	f.StringVar(&opts.StandbyKV, "standby-kv", opts.StandbyKV, "how a sleeping standby maps the shared KV cache (the weights are always read-only): writable, so that a takeover changes no access (after a fault that change waits on the MPS server tearing the dead context down, 2-20 ms at 14B on an H100); or readonly, so that the driver faults any write a sleeping standby makes, and the KV cache is made writable during the takeover")
	f.BoolVar(&opts.PrimeFaultPath, "prime-fault-path", opts.PrimeFaultPath, "before the first engine starts, fault once per GPU in a throwaway client of frmps's own MPS daemon: a GPU's first fault since the machine started keeps the MPS server ~330 ms tearing its clients down (later ones ~50-90 ms), and the standby's takeover waits for it; this pays that cost at start (~3 s per GPU). Leaves an Xid 13 and 43 per GPU in the kernel log; not with --mps-pipe-dir or --no-mps")
	f.DurationVar(&opts.FailbackDelay, "failback-delay", opts.FailbackDelay, "wait this long after the standby in MPS is ready before handing over to it")
	f.DurationVar(&opts.HandoffTimeout, "handoff-timeout", opts.HandoffTimeout, "an active that does not yield within this long during a handover is fenced and the standby takes over")
	f.StringVar(&opts.Host, "host", opts.Host, "address the OpenAI endpoint binds (empty: all interfaces)")
	f.IntVar(&opts.Port, "port", opts.Port, "port of the OpenAI endpoint")
	f.StringVar(&opts.AdminAddr, "admin-addr", opts.AdminAddr, "admin API address (gRPC and REST); loopback only unless --admin-allow-remote")
	f.BoolVar(&opts.AdminAllowRemote, "admin-allow-remote", opts.AdminAllowRemote, "allow a non-loopback --admin-addr (the admin API can kill engines)")
	f.BoolVar(&opts.NoMPS, "no-mps", opts.NoMPS, "do not start an MPS daemon; the active runs outside MPS")
	f.StringVar(&opts.MPSControlBinary, "mps-control", opts.MPSControlBinary, "the nvidia-cuda-mps-control binary")
	f.StringVar(&opts.MPSPipeDir, "mps-pipe-dir", opts.MPSPipeDir, "join the operator's MPS daemon at this pipe directory (its CUDA_MPS_PIPE_DIRECTORY) instead of starting one: the active runs in it, the standby outside; frmps checks it answers and never starts, stops or restarts it")
	f.StringVar(&opts.MPSLogDir, "mps-log-dir", opts.MPSLogDir, "that daemon's CUDA_MPS_LOG_DIRECTORY, given to the active (with --mps-pipe-dir)")
	f.StringVar(&opts.RunDir, "run-dir", opts.RunDir, "private run directory for sockets and logs, created 0700 and removed at exit (empty: a fresh temp dir)")
	f.StringVar(&opts.LogDir, "engine-log-dir", opts.LogDir, "directory for the engines' log files, kept after exit (empty: inside the run dir, removed at exit)")
	f.StringVar(&opts.RingDir, "ring-dir", opts.RingDir, "directory of the forward-state ring (empty: /dev/shm)")
	f.Uint64Var(&opts.RingCapacity, "ring-capacity", opts.RingCapacity, fmt.Sprintf("ring size in bytes: a power of two from %d to %d. Not given: this size, grown before the first active attaches to hold a snapshot of its largest batch (up to %d; vLLM at `vllm serve`'s batch limits needs tens of MiB); given: exactly this size", uint64(ringbuf.MinCapacity), uint64(ringbuf.MaxCapacity), supervisor.RingGrowMax))
	f.StringVar(&opts.StateDir, "state-dir", opts.StateDir, "private directory (0700) of launch records: at start, the ring, run dir and MPS daemon of an frmps that was killed before it could clean up are removed (default: $XDG_RUNTIME_DIR/frmps, else /run/frmps as root, else <temp dir>/frmps-<uid>; empty: no records)")
	f.StringVar(&opts.Device, "device", opts.Device, "engine device: auto (cuda where a GPU is visible: nvidia-smi -L, honouring CUDA_VISIBLE_DEVICES; else cpu), cpu or cuda")
	f.StringVar(&opts.Memory, "memory", opts.Memory, "shared memory backend: auto (cuda-vmm on cuda, else host-shm), host-shm (CPU) or cuda-vmm (GPU)")
	f.IntVar(&opts.NumBlocks, "num-blocks", opts.NumBlocks, "KV cache blocks (0: the engine's default; --engine vllm: sized from --gpu-memory-utilization by the active, and every later engine gets its count)")
	f.Float64Var(&opts.GPUMemoryUtilization, "gpu-memory-utilization", opts.GPUMemoryUtilization, "with --engine vllm and no --num-blocks: the fraction of the GPU the whole deployment may use (both engines, the shared weights and KV pools, the MPS server), as `vllm serve`'s; the KV cache gets what is left. The reference engine sizes its cache from --max-model-len")
	f.IntVar(&opts.MaxModelLen, "max-model-len", opts.MaxModelLen, "maximum sequence length (0: the engine's default)")
	f.IntVar(&opts.TensorParallelSize, "tensor-parallel-size", opts.TensorParallelSize, "shard the model over this many GPUs per engine (both engines): each engine is a group of this many processes, rank r on GPU r of the visible devices; the group fails over as a unit. On the CPU (tests) the ranks share the host")
	f.StringArrayVar(&opts.EngineArgs, "engine-arg", opts.EngineArgs, "extra argument for the engine's command line, repeatable (e.g. --engine-arg=--max-num-seqs=64)")
	f.BoolVar(&opts.Exact, "exact", opts.Exact, "engines whose output does not depend on what else is in their batch, so that a stream resumed after a takeover equals, token for token, what it would have been with no fault under any load: with --engine vllm, vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT=1 in the engines' environment, and TORCHINDUCTOR_DETERMINISTIC=1 so that every engine compiles the same reductions) with its Triton attention backend (--vllm-arg=--attention-backend=TRITON_ATTN unless an attention backend is given), slower than vLLM's default kernels; with the reference engine its exact scheduler mode (--engine-arg=--exact, already its default on a GPU). Without it a vLLM takeover continues every stream from the adopted KV cache, but under a changing batch a near-tied token may come out otherwise, as it may in vLLM itself")
	f.StringArrayVar(&opts.VllmArgs, "vllm-arg", opts.VllmArgs, "with --engine vllm: one of vLLM's own flags as `vllm serve` spells it, for the engines and, with --frontend vllm, vLLM's API server alike, repeatable (e.g. --vllm-arg=--max-logprobs=50); the engines refuse the flags frmps sets itself (model, sizes, dtype, seed)")
	f.StringVar(&opts.Frontend, "frontend", opts.Frontend, "the OpenAI endpoint: frmps (frmps's front door, both engines) or vllm (vLLM's own API server, every route of `vllm serve`, with --engine vllm; the engine is the unit of failover, vllmpatch/OPENAI.md)")
	f.StringArrayVar(&opts.FrontendArgs, "frontend-arg", opts.FrontendArgs, "with --frontend vllm: extra argument for vLLM's API server as `vllm serve` spells it, repeatable (e.g. --frontend-arg=--enable-prefix-caching)")
	f.BoolVar(&opts.EnableAutoToolChoice, "enable-auto-tool-choice", opts.EnableAutoToolChoice, "chat tool calling, as vllm serve's flag: tool_choice auto reads tool calls out of the output with --tool-call-parser (needs it), and required and named functions constrain the output to calls; without it they are refused (400), as vLLM refuses them. With --frontend vllm it goes to vLLM's API server")
	f.StringVar(&opts.ToolCallParser, "tool-call-parser", opts.ToolCallParser, "the tool-call format --enable-auto-tool-choice reads: hermes (<tool_call>{…}</tool_call>, Qwen2.5's), the only one frmps's front door implements; with --frontend vllm any parser of vLLM's, which checks the name")
	f.IntVar(&opts.MaxConcurrent, "max-concurrent", opts.MaxConcurrent, "most requests running against the engine at once (0: 512)")
	f.IntVar(&opts.MaxChoices, "max-choices", opts.MaxChoices, "most choices one request may ask for, n times the prompts of a batch, each an engine request of its own (0: 128)")
	f.IntVar(&opts.MaxQueue, "max-queue", opts.MaxQueue, "most requests waiting for a slot before 429 (0: 1024; negative: no queue)")
	f.Int64Var(&opts.MaxBodyBytes, "max-body-bytes", opts.MaxBodyBytes, "largest request body accepted before 413 (0: 4 MiB)")
	f.IntVar(&opts.MaxConnections, "max-connections", opts.MaxConnections, "most client connections open at once; more wait to be accepted (0: 4096; negative: no bound)")
	f.StringVar(&opts.APIKeyFile, "api-key-file", opts.APIKeyFile, "file holding the API key clients must send as a Bearer token (else FRMPS_API_KEY, else none)")
	f.IntVar(&opts.Breaker.MaxRestarts, "max-restarts", opts.Breaker.MaxRestarts, "crash-loop breaker: an engine role dying more than this many times within --restart-window, or more than this many launches in a row never becoming ready (however long each takes), is not restarted; before any engine has served, frmps serve then exits 1 with the engine's reason")
	f.DurationVar(&opts.Breaker.Window, "restart-window", opts.Breaker.Window, "crash-loop breaker window")
	f.DurationVar(&opts.HeartbeatTimeout, "heartbeat-timeout", opts.HeartbeatTimeout, "hang detection, liveness: fail over from an active whose heartbeats stop for this long (a stopped or frozen process: the heartbeat thread never waits on the device); negative disables hang detection")
	f.Float64Var(&opts.StepTimeoutFactor, "step-timeout-factor", opts.StepTimeoutFactor, "hang detection, progress: fail over from an active whose step runs longer than this many times the engine's own estimate for it (recent step times scaled to the step's tokens), and longer than --step-timeout-min")
	f.DurationVar(&opts.StepTimeoutMin, "step-timeout-min", opts.StepTimeoutMin, "hang detection, progress: the shortest bound of one engine step")
	f.DurationVar(&opts.StepTimeoutDefault, "step-timeout-default", opts.StepTimeoutDefault, "hang detection, progress: the bound of a step the engine has no estimate for (its first serving steps, a batch far larger than its recent ones)")
	f.DurationVar(&opts.HeartbeatTimeout, "stall-timeout", opts.HeartbeatTimeout, "the older name of --heartbeat-timeout")
	_ = f.MarkDeprecated("stall-timeout", "use --heartbeat-timeout (the step bound is --step-timeout-factor/-min/-default)")
	f.DurationVar(&opts.ShutdownGrace, "shutdown-grace", opts.ShutdownGrace, "how long engines get to exit on shutdown before being killed")
	f.StringVar(&opts.LogLevel, "log-level", opts.LogLevel, "log level: trace, debug, info, warn, error")
	f.BoolVar(&opts.LogJSON, "log-json", opts.LogJSON, "log as JSON lines")
}

// fileKeyFlags are the --config file's keys that are not their flag's name
// with underscores: the repeatable flags, whose keys are plural.
var fileKeyFlags = map[string]string{"engine_args": "engine-arg", "vllm_args": "vllm-arg", "frontend_args": "frontend-arg"}

// applyConfigFile sets the flags of flags from the JSON file at path, whose
// keys are the flags' names with underscores (e.g. "sync_every"; a list for a
// repeatable flag), except the settings given on the command line, which win.
// The file's values go through the flags, so they meet the same parsing and,
// later, the same checks as the command line's.
func applyConfigFile(flags *pflag.FlagSet, path string) error {
	data, err := os.ReadFile(path)
	if err != nil {
		return fmt.Errorf("read config: %w", err)
	}
	var file map[string]json.RawMessage
	if err := json.Unmarshal(data, &file); err != nil {
		return fmt.Errorf("config %s: %w", path, err)
	}
	// By value, not name: a flag's older name (--stall-timeout) sets the same variable.
	given := map[pflag.Value]bool{}
	flags.Visit(func(f *pflag.Flag) { given[f.Value] = true })
	for _, key := range slices.Sorted(maps.Keys(file)) {
		name, ok := fileKeyFlags[key]
		if !ok {
			name = strings.ReplaceAll(key, "_", "-")
		}
		f := flags.Lookup(name)
		if f == nil || name == "config" || strings.Contains(key, "-") || !ok && f.Value.Type() == "stringArray" {
			return fmt.Errorf("config %s: unknown key %q", path, key)
		}
		if given[f.Value] {
			continue
		}
		values, err := fileValues(f.Value.Type(), file[key])
		if err != nil {
			return fmt.Errorf("config %s: %s: %w", path, key, err)
		}
		for _, v := range values {
			if err := flags.Set(name, v); err != nil {
				return fmt.Errorf("config %s: %s: %w", path, key, err)
			}
		}
	}
	return nil
}

// fileValues turns a --config value into the text(s) its flag parses: a JSON
// string for a string or a duration ("90s"), a number, a boolean, and a list
// of strings for a repeatable flag. null leaves the flag as it is.
func fileValues(flagType string, raw json.RawMessage) ([]string, error) {
	if string(raw) == "null" {
		return nil, nil
	}
	switch flagType {
	case "string", "duration":
		var v string
		if err := json.Unmarshal(raw, &v); err != nil {
			return nil, fmt.Errorf("want a string: %w", err)
		}
		return []string{v}, nil
	case "stringArray":
		var v []string
		if err := json.Unmarshal(raw, &v); err != nil {
			return nil, fmt.Errorf("want a list of strings: %w", err)
		}
		return v, nil
	case "bool":
		var v bool
		if err := json.Unmarshal(raw, &v); err != nil {
			return nil, fmt.Errorf("want true or false: %w", err)
		}
		return []string{strconv.FormatBool(v)}, nil
	default: // the numbers: int, int64, uint32, uint64, float64
		var v json.Number
		if err := json.Unmarshal(raw, &v); err != nil || raw[0] == '"' {
			return nil, fmt.Errorf("want a number, got %s", raw)
		}
		return []string{v.String()}, nil
	}
}

// resolveModel names the served model as the user gave it (a preset name, not
// the directory it resolves to, as vllm serve names a model by its argument)
// unless --served-model-name says otherwise, and turns a preset into its
// model directory for vLLM (resolveDir), which reads only directories.
func (o *serveOptions) resolveModel(resolveDir func(string) (string, error)) error {
	if o.ServedModelName == "" {
		o.ServedModelName = o.Model
	}
	if o.Engine != "vllm" {
		return nil
	}
	dir, err := resolveDir(o.Model)
	if err != nil {
		return err
	}
	o.Model = dir
	return nil
}

// fixRingIfGiven keeps a --ring-capacity given on the command line or in the
// --config file (both set the flag) as it is: only frmps's own default grows
// (Config.RingFixed).
func fixRingIfGiven(f *pflag.FlagSet, o *serveOptions) {
	if f.Changed("ring-capacity") {
		o.RingFixed = true
	}
}

// supervisorConfig is the Config the supervisor runs: the options' own, with
// the engines' interpreter and environment (FRMPS_STANDBY_KV added) and their
// extra arguments (engineArgs).
func (o serveOptions) supervisorConfig(py pythonEnv) supervisor.Config {
	c := o.Config
	c.Python = py.Python
	c.BaseEnv = append(o.exactEnv(sdnotify.StripEnv(py.Env)), "FRMPS_STANDBY_KV="+o.StandbyKV)
	c.EngineArgs = o.engineArgs()
	return c
}

// exactEnvVars is what --exact sets in vLLM's processes, replacing any value
// the environment gives:
//   - VLLM_BATCH_INVARIANT=1: vLLM's batch-invariant kernels, so that a
//     token does not depend on what else is in its batch;
//   - TORCHINDUCTOR_DETERMINISTIC=1: Inductor picks each compiled reduction's
//     block sizes and warps by its heuristics instead of timing the candidates
//     when a kernel first runs. Timed, the choice is a property of one process
//     (of what else ran on the GPU while it timed), and a reduction's rounding
//     depends on it (torch/_inductor/runtime/triton_heuristics.py,
//     filter_reduction_configs_for_determinism): two engines of one deployment
//     could then compute a token differently, and a stream taken over from one
//     by the other would not be exact. vLLM's batch-invariant mode leaves
//     Inductor's timing on (0.26.0). The engines pin the mode on for the
//     process and turn vLLM's combo kernels off, whose timed grouping the mode
//     refuses (vllmpatch/src/frmps_engine/vllm/envpolicy.py).
//
// Both are read when torch and vLLM are imported, so they are in the
// environment before any engine (a spare preloads vLLM) starts.
var exactEnvVars = []string{"VLLM_BATCH_INVARIANT=1", "TORCHINDUCTOR_DETERMINISTIC=1"}

// exactEnv is env with what --exact asks of vLLM's processes (engines and API
// server): exactEnvVars.
func (o serveOptions) exactEnv(env []string) []string {
	if !o.Exact || o.Engine != "vllm" {
		return env
	}
	out := slices.DeleteFunc(slices.Clone(env), func(kv string) bool {
		return slices.ContainsFunc(exactEnvVars, func(v string) bool {
			return strings.HasPrefix(kv, v[:strings.IndexByte(v, '=')+1])
		})
	})
	return append(out, exactEnvVars...)
}

// vllmArgs is --vllm-arg as given and, with --exact, vLLM's Triton attention
// backend where no backend is given: its batch-invariant mode holds with it,
// and not with every backend (FlashAttention 3 on Hopper stays batch-dependent).
func (o serveOptions) vllmArgs() []string {
	out := slices.Clone(o.VllmArgs)
	if o.Exact && o.Engine == "vllm" && !slices.ContainsFunc(out, func(a string) bool {
		return strings.HasPrefix(a, "--attention-backend") || strings.HasPrefix(a, "--attention-config") || strings.HasPrefix(a, "-ac")
	}) {
		out = append(out, "--attention-backend=TRITON_ATTN")
	}
	return out
}

// engineArgs is the engines' extra command line: --engine-arg as given (and
// --exact for the reference engine), then each of vllmArgs as the engine's
// own --vllm-arg.
func (o serveOptions) engineArgs() []string {
	out := slices.Clone(o.EngineArgs)
	if o.Exact && o.Engine == "ref" && !slices.ContainsFunc(out, func(a string) bool {
		return a == "--exact" || a == "--no-exact"
	}) {
		out = append(out, "--exact")
	}
	for _, a := range o.vllmArgs() {
		out = append(out, "--vllm-arg="+a)
	}
	return out
}

// validate checks what can be checked before anything starts: the
// deployment by its own rules (Config.Validate), then what serve adds.
func (o serveOptions) validate() error {
	if err := o.Config.Validate(); err != nil {
		return err
	}
	if o.Port < 0 || o.Port > 65535 {
		return fmt.Errorf("--port %d out of range", o.Port)
	}
	if hclog.LevelFromString(o.LogLevel) == hclog.NoLevel {
		return fmt.Errorf("--log-level %q: want trace, debug, info, warn or error", o.LogLevel)
	}
	if o.StandbyKV != "writable" && o.StandbyKV != "readonly" {
		return fmt.Errorf("--standby-kv %q: want writable or readonly", o.StandbyKV)
	}
	if len(o.VllmArgs) > 0 && o.Engine == "ref" {
		return errors.New("--vllm-arg is one of vLLM's flags: give --engine vllm")
	}
	if o.Exact && slices.ContainsFunc(o.VllmArgs, func(a string) bool { return a == "--enforce-eager" || a == "--enforce-eager=true" }) {
		return errors.New("--exact with --vllm-arg=--enforce-eager: vLLM's eager mode is not batch-invariant even in its batch-invariant mode; drop --enforce-eager")
	}
	parserArg := slices.ContainsFunc(o.FrontendArgs, func(a string) bool { return strings.HasPrefix(a, "--tool-call-parser") })
	if o.EnableAutoToolChoice && o.ToolCallParser == "" && !(o.Frontend == "vllm" && parserArg) {
		return errors.New("--enable-auto-tool-choice requires --tool-call-parser")
	}
	switch o.Frontend {
	case "frmps":
		if len(o.FrontendArgs) > 0 {
			return errors.New("--frontend-arg is for vLLM's API server: give --frontend vllm")
		}
		if o.ToolCallParser != "" && !slices.Contains(openai.ToolCallParsers, o.ToolCallParser) {
			return fmt.Errorf("--tool-call-parser %q: frmps's front door implements %s (Qwen2.5's format) only; vLLM's other parsers are served with --frontend vllm",
				o.ToolCallParser, strings.Join(openai.ToolCallParsers, ", "))
		}
	case "vllm":
		if o.Engine == "ref" {
			return errors.New("--frontend vllm serves through vLLM's API server, whose engines speak vLLM's engine-core protocol: " +
				"use --engine vllm (the reference engine serves through frmps's front door)")
		}
		if o.TensorParallelSize > 1 {
			return errors.New("--frontend vllm: one GPU per engine for now (--tensor-parallel-size 1)")
		}
		if o.ToolCallParser != "" && parserArg {
			return errors.New("--tool-call-parser is given twice, as a flag and as a --frontend-arg: give it once")
		}
	default:
		return fmt.Errorf("--frontend %q: want frmps or vllm", o.Frontend)
	}
	return admin.CheckAddr(o.AdminAddr, o.AdminAllowRemote)
}

// vllmFrontConfig is --frontend vllm's process: vLLM's API server for the
// model, on serve's address, with the API key (may be empty).
func (o serveOptions) vllmFrontConfig(py pythonEnv, apiKey string) vllmfront.Config {
	return vllmfront.Config{
		Python: py.Python, Env: o.exactEnv(py.Env), Model: o.Model, ServedModelName: o.ServedModelName,
		Host: o.Host, Port: o.Port, MaxModelLen: o.MaxModelLen, VLLMArgs: o.vllmArgs(), FrontendArgs: o.frontendArgs(), APIKey: apiKey,
	}
}

// frontendArgs is --frontend-arg with the tool-calling flags, which vLLM's API
// server takes as they are.
func (o serveOptions) frontendArgs() []string {
	out := slices.Clone(o.FrontendArgs)
	if o.EnableAutoToolChoice && !slices.Contains(out, "--enable-auto-tool-choice") {
		out = append(out, "--enable-auto-tool-choice")
	}
	if o.ToolCallParser != "" {
		out = append(out, "--tool-call-parser="+o.ToolCallParser)
	}
	return out
}

// serveGPUProbe replaces the host's GPU probe (tests); nil: the host's.
var serveGPUProbe gpuProbe

func runServe(ctx context.Context, o serveOptions, stderr io.Writer) error {
	if ctx == nil {
		ctx = context.Background()
	}
	if err := o.validate(); err != nil {
		return err
	}
	lvl := hclog.LevelFromString(o.LogLevel)
	log := hclog.New(&hclog.LoggerOptions{Name: "frmps", Level: lvl, JSONFormat: o.LogJSON, Output: stderr})
	gpu := serveGPUProbe
	if gpu == nil {
		gpu = realGPU(ctx)
	}
	device, deviceWhy := resolveDevice(o.Device, gpu)
	if strings.HasPrefix(device, "cuda") {
		// Before anything reads the environment: the engines, the MPS daemon and the
		// vLLM front end all start from it.
		pinVisibleGPUs(ctx, log, "", os.LookupEnv, os.Setenv)
	}

	py := findPython(o.Python, selfPath(), os.Environ())
	pre, err := engine.PythonCLI{Engine: o.Engine, Python: py.Python}.Check(ctx, py.Env)
	if nameErr := (*engine.EngineNameError)(nil); errors.As(err, &nameErr) {
		return err
	}
	if err != nil {
		return fmt.Errorf("%w (interpreter from %s); pass --python with an interpreter that has frmps_engine installed "+
			"(`make venv` creates .venv in a source checkout), or set FRMPS_PYTHON", err, py.Source)
	}
	ch, err := resolveChoices(device, deviceWhy, o.Memory, o.Engine, o.Model, vllmInfo{Version: pre.VLLM, Why: pre.VLLMWhy})
	if err != nil {
		return err
	}
	o.Device, o.Memory, o.Engine, o.Model = ch.Device, ch.Memory, ch.Engine, ch.Model
	if err := o.validate(); err != nil { // the checks that depend on the engine, now resolved
		return err
	}
	log.Info("resolved: " + ch.String())
	if o.Exact {
		log.Info("exact: batch-invariant engines", "engine_args", strings.Join(o.engineArgs(), " "), "env", strings.Join(o.exactEnv(nil), " "))
	}
	if err := o.resolveModel(func(m string) (string, error) { return resolveVLLMModel(ctx, py, m) }); err != nil {
		return err
	}
	log.Info("engine interpreter", "python", py.Python, "from", py.Source, "frmps_engine", pre.Package)

	notify, err := sdnotify.New(log.Named("systemd"))
	if err != nil {
		return err
	}
	defer notify.Close()

	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	var vfd *vllmfront.FrontDoor
	cfg := o.supervisorConfig(py)
	cfg.Resolved = &frmpsv1.Resolved{Device: ch.Device, Memory: ch.Memory, Engine: ch.Engine, Model: ch.Model, Reason: ch.Why}
	if o.Frontend == "vllm" {
		key, err := openai.LoadAPIKey(o.APIKeyFile, "FRMPS_API_KEY")
		if err != nil {
			return err
		}
		if vfd, err = vllmfront.New(o.vllmFrontConfig(py, key), log.Named("vllm-frontend")); err != nil {
			return err
		}
		// Removes its directory on every return (a second Shutdown after the
		// one below only closes what is closed).
		defer func() { _ = vfd.Shutdown(context.Background()) }()
		cfg.EngineCoreInput, cfg.EngineCoreOutput = vfd.EngineCoreAddrs()
	}
	sup, err := supervisor.New(cfg, log.Named("supervisor"), reg)
	if err != nil {
		return err
	}
	if every := notify.WatchdogInterval(); every > 0 {
		sup.SetWatchdog(notify, every)
	}
	var fd frontDoor = vfd
	if vfd == nil {
		if fd, err = newFrontDoor(o, sup, log.Named("openai"), reg); err != nil {
			return err
		}
	}
	adm, err := admin.New(admin.Config{Addr: o.AdminAddr, AllowNonLoopback: o.AdminAllowRemote, Gatherer: reg}, sup, log.Named("admin"))
	if err != nil {
		return err
	}
	admL, err := adm.Listen()
	if err != nil {
		return err
	}
	var apiL net.Listener // --frontend vllm: vLLM binds the port itself
	if vfd == nil {
		if apiL, err = net.Listen("tcp", net.JoinHostPort(o.Host, strconv.Itoa(o.Port))); err != nil {
			admL.Close()
			return fmt.Errorf("OpenAI endpoint listen: %w", err)
		}
	}
	sup.SetFrontDoor(fd)

	sigCtx, stopSignals := signal.NotifyContext(ctx, syscall.SIGTERM, syscall.SIGINT)
	defer stopSignals()
	// Every goroutine of serve runs in one group, and serve returns only once
	// each has returned: the supervisor, the admin API, the OpenAI endpoint,
	// the watch for a deployment that gave up, and systemd's readiness notice.
	// The first of the first four to return starts the shutdown (as does a
	// signal); serve's error is the first error any of them returned.
	var g errgroup.Group
	ended := make(chan struct{})
	var endOnce sync.Once
	member := func(f func() error) {
		g.Go(func() error {
			defer endOnce.Do(func() { close(ended) })
			return f()
		})
	}
	supCtx, stopSup := context.WithCancel(context.Background())
	defer stopSup()
	supReturned := make(chan struct{})
	member(func() error {
		defer close(supReturned)
		err := sup.Run(supCtx)
		if err == nil && supCtx.Err() == nil {
			err = errors.New("supervisor stopped unexpectedly")
		}
		return err
	})
	admCtx, stopAdm := context.WithCancel(context.Background())
	defer stopAdm()
	member(func() error { return adm.Serve(admCtx, admL) })
	var draining atomic.Bool // the front door was asked to shut down
	apiReturned := make(chan struct{})
	member(func() error {
		defer close(apiReturned)
		if err := fd.Serve(apiL); !draining.Load() {
			return err
		}
		return nil // what it says once shut down is not the deployment's error
	})
	stopWatch := make(chan struct{})
	member(func() error {
		select {
		case <-sup.GaveUp():
			// The breaker opened before any engine served (a configuration error):
			// there is nothing to keep up. Exit 1 with the engine's reason.
			return sup.GiveUpErr()
		case <-stopWatch:
			return nil
		}
	})
	log.Info("serving", "model", o.Model, "engine", o.Engine, "port", o.Port, "admin", admL.Addr().String())
	readyCtx, stopReady := context.WithCancel(context.Background())
	defer stopReady()
	readyReturned := make(chan struct{})
	g.Go(func() error {
		defer close(readyReturned)
		notifyReady(readyCtx, sup, notify, o.Model)
		return nil
	})

	select {
	case <-sigCtx.Done():
		log.Info("shutting down")
	case <-ended:
	}
	notify.Stopping("draining requests, then stopping the engines")
	stopReady()
	<-readyReturned
	// Order matters: stop taking requests and drain them, then the engines,
	// then the admin API (status stays readable during the drain).
	draining.Store(true)
	dctx, cancel := context.WithTimeout(context.Background(), o.ShutdownGrace+5*time.Second)
	if err := fd.Shutdown(dctx); err != nil {
		log.Warn("front door shutdown", "error", err)
	}
	cancel()
	<-apiReturned
	stopSup()
	<-supReturned
	stopAdm()
	close(stopWatch)
	return g.Wait()
}

// notifyReady tells systemd READY=1 once an engine serves (the first
// generation is published), and nothing if none ever does (a crash loop at
// start): systemd's start timeout then fails the unit.
func notifyReady(ctx context.Context, sup *supervisor.Supervisor, n *sdnotify.Notifier, model string) {
	if !n.Enabled() {
		return
	}
	if _, _, err := sup.Current(ctx, 1); err != nil {
		return
	}
	n.Ready("serving " + model)
}

// frontDoor is the OpenAI endpoint as serve drives it.
type frontDoor interface {
	supervisor.FrontDoor
	Serve(l net.Listener) error // returns nil after Shutdown
	Shutdown(ctx context.Context) error
}

// pinVisibleGPUs names the GPUs of CUDA_VISIBLE_DEVICES by UUID where it names
// them by index (mps.VisibleByUUID: MPS remaps indices for its clients, so the
// active inside MPS and the standby outside it would not read an index alike). Left as it is, with a warning, when nvidia-smi cannot say.
func pinVisibleGPUs(ctx context.Context, log hclog.Logger, smi string, lookup func(string) (string, bool), set func(string, string) error) {
	v, ok := lookup("CUDA_VISIBLE_DEVICES")
	if !ok || strings.TrimSpace(v) == "" {
		return
	}
	u, err := mps.VisibleByUUID(ctx, smi, v)
	if err != nil {
		log.Warn("CUDA_VISIBLE_DEVICES left as it is; MPS renumbers GPUs for its clients, so an index may not name the same GPU to the active inside MPS as to the standby: name GPUs by UUID",
			"CUDA_VISIBLE_DEVICES", v, "error", err)
		return
	}
	if u == v {
		return
	}
	if err := set("CUDA_VISIBLE_DEVICES", u); err != nil {
		log.Warn("cannot set CUDA_VISIBLE_DEVICES", "error", err)
		return
	}
	log.Info("GPUs named by UUID for MPS (it remaps indices for its clients)", "CUDA_VISIBLE_DEVICES", u, "was", v)
}
