package supervisor

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
	"github.com/frmps/frmps/ringbuf"
	"github.com/frmps/frmps/supervisor/failover"
	"github.com/frmps/frmps/supervisor/leftover"
	"github.com/frmps/frmps/supervisor/mps"
)

// Config and its defaults. Read-only once NewWithDeps has returned.

// Config of one deployment. Its defaults are DefaultConfig, its rules
// Validate: frmps serve binds its flags to a Config and takes both from here.
type Config struct {
	Model string // preset name or model directory, passed to the engine
	// ServedModelName is the name the OpenAI API serves the model under;
	// empty: Model.
	ServedModelName string
	Engine          string // --engine of the engine CLI, which validates it (frmps_engine.sdk.adapters)
	Python          string // interpreter for Python engines
	SyncEvery       uint32 // ring publish interval in engine steps
	RunDir          string // created 0700, must not exist; empty: a fresh temp dir
	// LogDir keeps the engines' log files (<role>-<n>.log) after exit; empty:
	// inside RunDir, removed with it.
	LogDir  string
	RingDir string // where the ring file goes; empty: /dev/shm if present, else RunDir
	// RingCapacity is the ring's data region in bytes, a power of two
	// (ringbuf.CheckCapacity); 0 means 8 MiB.
	RingCapacity uint64
	// RingFixed keeps the ring at RingCapacity. Otherwise (the default) it
	// grows once, before the first active attaches, to hold a snapshot of that
	// engine's largest batch (Hello.ring_record_bytes), up to RingGrowMax;
	// frmps serve fixes it when --ring-capacity is given.
	RingFixed bool
	// StateDir holds launch records (package leftover): at start the ring,
	// run dir and MPS daemon of supervisors that died without cleaning up
	// are removed, and this one's record is kept until it has cleaned up.
	// Empty: no launch record. DefaultConfig (frmps serve's default) sets
	// leftover.DefaultDir().
	StateDir string
	NoMPS    bool
	// MPSControlBinary is nvidia-cuda-mps-control (looked up in PATH when bare).
	MPSControlBinary string
	// MPSPipeDir joins the operator's MPS daemon at this pipe directory
	// instead of starting one: frmps places the active in it, checks that it
	// answers and never starts, stops or restarts it. MPSLogDir is that
	// daemon's log directory, given to the active when set.
	MPSPipeDir string
	MPSLogDir  string
	// NvidiaSMI reads the GPU's compute mode at start ("" = nvidia-smi in PATH).
	NvidiaSMI string
	// Device: cpu or cuda; empty: cpu. Memory: host-shm (CPU)
	// or cuda-vmm (GPU); empty: DefaultMemory(Device). Auto, for both and for
	// Engine, is frmps serve's, resolved before New (which refuses it).
	Device      string
	Memory      string
	NumBlocks   int
	MaxModelLen int
	// GPUMemoryUtilization is the fraction of the GPU the deployment may use,
	// in (0, 1], passed to every engine (the vLLM adapter sizes its KV cache
	// from it when NumBlocks is 0); 0 means 0.9.
	GPUMemoryUtilization float64
	// TensorParallelSize shards the model over this many GPUs per engine
	// (0 means 1). Each engine process the supervisor launches is rank 0 of
	// its group and starts the other ranks itself, in its process group, so
	// fencing the engine fences the group; the supervisor still sees one
	// active and one standby.
	TensorParallelSize int
	// EngineArgs are appended to every engine's command line (engine-specific
	// options the supervisor does not interpret).
	EngineArgs []string
	// EngineCoreInput/EngineCoreOutput: every engine serves vLLM's
	// engine-core protocol to vLLM's API server at these addresses (serve
	// --frontend vllm) instead of frmps's generation API.
	EngineCoreInput, EngineCoreOutput string
	Breaker                           failover.BreakerConfig
	// PollInterval between ring polls; 0 means 500µs.
	PollInterval time.Duration
	// HandshakeTimeout bounds launch → Ready; 0 means 10 minutes (weights load).
	HandshakeTimeout time.Duration
	// ResumeTimeout bounds Resume → Reply; 0 means 30s.
	ResumeTimeout time.Duration
	// ShutdownGrace is how long engines get to exit after Shutdown; 0 means 10s.
	ShutdownGrace time.Duration
	// Hang detection (hang.go) fences a serving active that is connected but
	// wedged. HeartbeatTimeout: its heartbeats stopped for this long (the
	// process is stopped or frozen as a whole); 0 means 1s; negative disables
	// hang detection. StepTimeoutFactor, StepTimeoutMin: a step that runs
	// longer than max(StepTimeoutMin, StepTimeoutFactor × the engine's own
	// estimate for it) is hung; 0 means 8 and 1s. StepTimeoutDefault bounds a
	// step the engine has no estimate for (its first serving steps, a batch far
	// larger than any it measured), and judges engines without hang reporting;
	// 0 means 60s. Engines that send no heartbeats are not judged.
	HeartbeatTimeout   time.Duration
	StepTimeoutFactor  float64
	StepTimeoutMin     time.Duration
	StepTimeoutDefault time.Duration
	// MaxFailoverRecords kept for status; 0 means 32.
	MaxFailoverRecords int
	// NoFailback keeps the pair where a failover left it (the active outside
	// MPS). By default, after a failover the fresh standby starts inside MPS
	// and the pair swaps in a planned handover once it is ready.
	NoFailback bool
	// PrimeFaultPath runs one deliberate fault per GPU of the deployment in
	// frmps's own MPS daemon before the first active starts
	// (`python -m frmps_engine.cli prime-fault`, a throwaway client alone in
	// its MPS server). The first fatal fault of an MPS client on a GPU since
	// the machine started takes the MPS server ~330 ms to tear down, every
	// later one ~50-90 ms, in any daemon; the standby's takeover waits for that
	// teardown (bench/results/2026-11-27-h200x2-fault-path). Priming pays that
	// once while nothing serves. It leaves an Xid 13 and 43 in the kernel log
	// per GPU and costs ~3 s per GPU at start; refused with the operator's daemon (a
	// fault there would kill its other clients) and without MPS.
	PrimeFaultPath bool
	// FailbackDelay is the wait between the standby in MPS being ready and the
	// handover (0: at once).
	FailbackDelay time.Duration
	// FailbackBaseBackoff and FailbackMaxBackoff space handovers after failed
	// ones: the base doubled per consecutive failure, capped. 0 means 1s and 5m.
	FailbackBaseBackoff time.Duration
	FailbackMaxBackoff  time.Duration
	// HandoffTimeout bounds Handoff → the active's reply (it finishes one step
	// and publishes); an active that does not yield in time is fenced and the
	// standby takes over. 0 means 10s.
	HandoffTimeout time.Duration
	// MPSRecoveryWindow: for this long after an active inside MPS died, a
	// standby launched into MPS that dies before Ready is taken for one the
	// recovering MPS server did not admit (after a fatal fault the server
	// resets the device and refuses or breaks new clients for seconds): it is
	// relaunched every failover.MPSRetryDelay without counting against the
	// crash-loop breaker. An engine's own refusal (exit code 2) always counts.
	// 0 means 60s; negative: every such death counts.
	MPSRecoveryWindow time.Duration
	// NoMPSFaultWatch turns off the early fault signal: by default the
	// supervisor follows the MPS server's log (mps.ServerLog) and fails
	// over as soon as the server says it tears the active's context down after
	// a fatal GPU error, instead of waiting for the active to die of it.
	NoMPSFaultWatch bool
	// Spare keeps one engine process started ahead of need (spare.go): "on",
	// "off", or "auto" / "" = on for GPU devices, where an engine's Python
	// start-up is most of the time it takes to restore the pair after a fault.
	Spare string
	// Spares is how many spare processes to keep when spares are on (0 = 1).
	// More than one keeps the restore fast when faults come faster than a
	// spare's imports; each costs the host memory of an imported engine.
	Spares int
	// Resolved is how the caller chose Device, Memory, Engine and Model (frmps
	// serve's "auto" defaults, and why), shown in Status; nil: not reported.
	Resolved *frmpsv1.Resolved
	// BaseEnv is the environment every engine starts from; nil means os.Environ().
	BaseEnv []string
}

// sparesOn: whether to keep a spare (Config.Spare).
func (c *Config) sparesOn() bool {
	switch c.Spare {
	case "on":
		return true
	case "off":
		return false
	}
	return strings.HasPrefix(c.Device, "cuda")
}

// MaxSpares bounds Config.Spares (and serve's --spares): each spare holds an
// imported engine's host memory.
const MaxSpares = 8

// spareCount: how many spares to keep when they are on (Config.Spares).
func (c *Config) spareCount() int { return max(c.Spares, 1) }

// Auto is the value of Device, Memory and Engine that frmps serve resolves
// from the host before it builds a supervisor (cmd/frmps/resolve.go): a
// visible GPU, vLLM installed in the engines' interpreter. Memory follows the
// device (DefaultMemory), the model the engine (DefaultModel). New takes only
// resolved values.
const Auto = "auto"

// DefaultModel is the model an engine serves when none is given: the
// reference engine's CPU preset, and for vLLM the smallest Qwen2.5 preset,
// which every GPU frmps runs on holds twice over (weights and KV cache for the
// pair). ok is false for other engines (adapter factories), which have none.
func DefaultModel(engine string) (model string, ok bool) {
	switch engine {
	case "ref":
		return "tiny", true
	case "vllm":
		return "qwen2.5-0.5b", true
	}
	return "", false
}

// RingGrowMax bounds the ring's growth (Config.RingFixed): a ring file lives in /dev/shm, and a snapshot
// larger than a quarter of this is published in part (requests left out of it
// are re-prefilled at a takeover).
const RingGrowMax = 1 << 30

// DefaultMemory is the pools' backend for a device: cuda-vmm on a GPU,
// host-shm on the CPU.
func DefaultMemory(device string) string {
	if device == "cuda" {
		return "cuda-vmm"
	}
	return "host-shm"
}

// DefaultConfig is a deployment before anything is chosen: every default,
// those of frmps serve's flags included. Device, Memory and Engine are Auto
// and Model is empty (the engine's default model): serve resolves them. New
// fills a field left at its zero value, where zero means "the default", from
// here (setDefaults).
func DefaultConfig() Config {
	return Config{
		Engine: Auto, Device: Auto, Memory: Auto,
		SyncEvery:            DefaultSyncEvery,
		RingCapacity:         8 << 20,
		StateDir:             leftover.DefaultDir(),
		MPSControlBinary:     mps.DefaultControlBinary,
		GPUMemoryUtilization: 0.9,
		TensorParallelSize:   1,
		Breaker:              failover.DefaultBreaker,
		PollInterval:         500 * time.Microsecond,
		HandshakeTimeout:     10 * time.Minute,
		ResumeTimeout:        30 * time.Second,
		ShutdownGrace:        10 * time.Second,
		HeartbeatTimeout:     time.Second,
		StepTimeoutFactor:    8,
		StepTimeoutMin:       time.Second,
		StepTimeoutDefault:   time.Minute,
		MaxFailoverRecords:   32,
		FailbackBaseBackoff:  time.Second,
		FailbackMaxBackoff:   5 * time.Minute,
		HandoffTimeout:       10 * time.Second,
		MPSRecoveryWindow:    time.Minute,
		Spare:                Auto,
		Spares:               1,
	}
}

// setDefaults fills the fields whose zero value means "the default" from
// DefaultConfig, so that a Config built in code names only what it changes.
// An empty Device is the CPU, an empty Memory the device's (DefaultMemory).
// Fields whose zero value is a choice of its own stay as they are: StateDir
// (no launch records), FailbackDelay (at once), NumBlocks and MaxModelLen (the
// engine's), Model and Engine (required).
func (c *Config) setDefaults() {
	d := DefaultConfig()
	orDefault(&c.SyncEvery, d.SyncEvery)
	orDefault(&c.RingCapacity, d.RingCapacity)
	orDefault(&c.GPUMemoryUtilization, d.GPUMemoryUtilization)
	orDefault(&c.TensorParallelSize, d.TensorParallelSize)
	orDefault(&c.Breaker, d.Breaker)
	orDefault(&c.PollInterval, d.PollInterval)
	orDefault(&c.HandshakeTimeout, d.HandshakeTimeout)
	orDefault(&c.ResumeTimeout, d.ResumeTimeout)
	orDefault(&c.ShutdownGrace, d.ShutdownGrace)
	orDefault(&c.HeartbeatTimeout, d.HeartbeatTimeout)
	orDefault(&c.StepTimeoutFactor, d.StepTimeoutFactor)
	orDefault(&c.StepTimeoutMin, d.StepTimeoutMin)
	orDefault(&c.StepTimeoutDefault, d.StepTimeoutDefault)
	orDefault(&c.MaxFailoverRecords, d.MaxFailoverRecords)
	orDefault(&c.FailbackBaseBackoff, d.FailbackBaseBackoff)
	orDefault(&c.FailbackMaxBackoff, d.FailbackMaxBackoff)
	orDefault(&c.HandoffTimeout, d.HandoffTimeout)
	orDefault(&c.MPSRecoveryWindow, d.MPSRecoveryWindow)
	orDefault(&c.Spares, d.Spares)
	orDefault(&c.Device, "cpu")
	orDefault(&c.Memory, DefaultMemory(c.Device))
	if c.BaseEnv == nil {
		c.BaseEnv = os.Environ()
	}
}

// orDefault sets *v to d when *v is its type's zero value.
func orDefault[T comparable](v *T, d T) {
	var zero T
	if *v == zero {
		*v = d
	}
}

// Validate checks a deployment as given, before anything starts: frmps serve
// calls it on its options (Auto and an empty Model are accepted: serve
// resolves them), New on the Config it runs. Zero values are taken as given,
// not as defaults (New fills those first). The error names each setting as
// frmps serve's flags do.
func (c *Config) Validate() error {
	switch {
	case c.Engine == "":
		return errors.New("--engine is empty: give auto, ref, vllm or an adapter factory")
	case c.SyncEvery == 0:
		return errors.New("--sync-every must be at least 1")
	case !(c.GPUMemoryUtilization > 0 && c.GPUMemoryUtilization <= 1): // NaN too
		return fmt.Errorf("--gpu-memory-utilization %v: want a fraction in (0, 1], e.g. 0.9", c.GPUMemoryUtilization)
	case c.Spare != "" && c.Spare != Auto && c.Spare != "on" && c.Spare != "off":
		return fmt.Errorf("--spare %q: want auto, on or off", c.Spare)
	case c.Spares < 1 || c.Spares > MaxSpares:
		return fmt.Errorf("--spares %d: want 1 to %d", c.Spares, MaxSpares)
	case c.TensorParallelSize < 1:
		return fmt.Errorf("--tensor-parallel-size %d: want at least 1", c.TensorParallelSize)
	case c.PrimeFaultPath && (c.NoMPS || c.MPSPipeDir != ""):
		return errors.New("--prime-fault-path needs frmps's own MPS daemon: with the operator's daemon (--mps-pipe-dir) the deliberate fault would kill its other clients, and without MPS (--no-mps) there is nothing to prime")
	case c.FailbackDelay < 0 || c.FailbackBaseBackoff < 0 || c.FailbackMaxBackoff < c.FailbackBaseBackoff:
		return fmt.Errorf("failback timing: want 0 <= --failback-delay (%s), 0 <= base backoff (%s) <= max backoff (%s)", c.FailbackDelay, c.FailbackBaseBackoff, c.FailbackMaxBackoff)
	case c.MPSPipeDir != "" && c.NoMPS:
		return errors.New("--mps-pipe-dir joins an MPS daemon, --no-mps runs without one: choose one")
	case c.MPSPipeDir != "" && !filepath.IsAbs(c.MPSPipeDir):
		return fmt.Errorf("--mps-pipe-dir %q: want an absolute path", c.MPSPipeDir)
	case c.MPSLogDir != "" && c.MPSPipeDir == "":
		return errors.New("--mps-log-dir names the joined daemon's log directory: give --mps-pipe-dir too")
	case c.HeartbeatTimeout == 0:
		return errors.New("--heartbeat-timeout 0: give a duration (negative disables hang detection)")
	case !(c.StepTimeoutFactor >= 1) || c.StepTimeoutMin <= 0 || c.StepTimeoutDefault <= 0: // NaN too
		return fmt.Errorf("--step-timeout-factor %g / --step-timeout-min %s / --step-timeout-default %s: want a factor of at least 1 and positive durations",
			c.StepTimeoutFactor, c.StepTimeoutMin, c.StepTimeoutDefault)
	}
	if err := ringbuf.CheckCapacity(c.RingCapacity); err != nil {
		return fmt.Errorf("--ring-capacity: %w", err)
	}
	if err := c.Breaker.Validate(); err != nil {
		return fmt.Errorf("crash-loop breaker (--max-restarts %d, --restart-window %s): %w", c.Breaker.MaxRestarts, c.Breaker.Window, err)
	}
	return CheckPlacement(c.Device, c.Memory)
}

// CheckPlacement is the rule for a device and a memory backend: each one of
// its values or Auto, and, once both are known, a pairing the engines can
// run: GPU pools on a GPU, host pools on the CPU.
func CheckPlacement(device, memory string) error {
	switch device {
	case Auto, "cpu", "cuda":
	default:
		return fmt.Errorf("--device %q: want auto, cpu or cuda", device)
	}
	switch memory {
	case Auto, "host-shm", "cuda-vmm":
	default:
		return fmt.Errorf("--memory %q: want auto, host-shm or cuda-vmm", memory)
	}
	switch {
	case device == Auto || memory == Auto:
	case memory == "host-shm" && device == "cuda":
		return errors.New("--memory host-shm keeps the pools in host memory, which a GPU engine cannot use: --memory cuda-vmm (or auto) with --device cuda")
	case memory == "cuda-vmm" && device != "cuda":
		return errors.New("--memory cuda-vmm maps the pools in GPU memory: it needs --device cuda (or --memory host-shm on the CPU)")
	}
	return nil
}

// validate is Validate for a Config that is about to run: everything
// resolved, a model named.
func (c *Config) validate() error {
	if err := c.Validate(); err != nil {
		return err
	}
	for _, v := range []struct{ name, value string }{{"--device", c.Device}, {"--memory", c.Memory}, {"--engine", c.Engine}} {
		if v.value == Auto {
			return fmt.Errorf("%s auto is resolved from the host by frmps serve: give a value", v.name)
		}
	}
	if c.Model == "" {
		return errors.New("--model is empty: give a preset name or a model directory")
	}
	return nil
}

// DefaultSyncEvery is the ring publish interval in engine steps: every step.
// The publish overlaps the device's pass, so it costs no measurable
// throughput, and a takeover then replays at most the one token sampled after
// the last sync (bench/results/2026-11-22-h100: sync overhead).
const DefaultSyncEvery = 1
