package supervisor

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
	"github.com/frmps/frmps/supervisor/failover"
)

// Config and its defaults. Read-only once NewWithDeps has returned.

// Config of one deployment.
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
	LogDir       string
	RingDir      string // where the ring file goes; empty: /dev/shm if present, else RunDir
	RingCapacity uint64 // bytes
	// StateDir holds launch records (package leftover): at start the ring,
	// run dir and MPS daemon of supervisors that died without cleaning up
	// are removed, and this one's record is kept until it has cleaned up.
	// Empty: no launch record. frmps serve defaults it to
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
	NvidiaSMI   string
	Device      string // cpu | cuda
	Memory      string // host-shm | cuda-vmm
	NumBlocks   int
	MaxModelLen int
	// GPUMemoryUtilization (0: the engine's default): the fraction of the GPU
	// the deployment may use, passed to every engine (the vLLM adapter sizes
	// its KV cache from it when NumBlocks is 0).
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

func (c *Config) setDefaults() {
	if c.SyncEvery == 0 {
		c.SyncEvery = DefaultSyncEvery
	}
	if c.FailbackBaseBackoff == 0 {
		c.FailbackBaseBackoff = time.Second
	}
	if c.FailbackMaxBackoff == 0 {
		c.FailbackMaxBackoff = 5 * time.Minute
	}
	if c.HandoffTimeout == 0 {
		c.HandoffTimeout = 10 * time.Second
	}
	if c.MPSRecoveryWindow == 0 {
		c.MPSRecoveryWindow = time.Minute
	}
	if c.RingCapacity == 0 {
		c.RingCapacity = 8 << 20
	}
	if c.PollInterval == 0 {
		c.PollInterval = 500 * time.Microsecond
	}
	if c.HandshakeTimeout == 0 {
		c.HandshakeTimeout = 10 * time.Minute
	}
	if c.ResumeTimeout == 0 {
		c.ResumeTimeout = 30 * time.Second
	}
	if c.ShutdownGrace == 0 {
		c.ShutdownGrace = 10 * time.Second
	}
	if c.HeartbeatTimeout == 0 {
		c.HeartbeatTimeout = time.Second
	}
	if c.StepTimeoutFactor == 0 {
		c.StepTimeoutFactor = 8
	}
	if c.StepTimeoutMin == 0 {
		c.StepTimeoutMin = time.Second
	}
	if c.StepTimeoutDefault == 0 {
		c.StepTimeoutDefault = time.Minute
	}
	if c.MaxFailoverRecords == 0 {
		c.MaxFailoverRecords = 32
	}
	if c.Breaker == (failover.BreakerConfig{}) {
		c.Breaker = failover.DefaultBreaker
	}
	if c.Memory == "" {
		c.Memory = "host-shm"
	}
	if c.TensorParallelSize == 0 {
		c.TensorParallelSize = 1
	}
	if c.BaseEnv == nil {
		c.BaseEnv = os.Environ()
	}
}

func (c *Config) validate() error {
	switch {
	case c.Model == "":
		return errors.New("model is required")
	case c.Engine == "":
		return errors.New("engine is required")
	case c.Memory != "host-shm" && c.Memory != "cuda-vmm":
		return fmt.Errorf("memory %q: want host-shm or cuda-vmm", c.Memory)
	case c.Device != "" && c.Device != "cpu" && c.Device != "cuda":
		return fmt.Errorf("device %q: want cpu or cuda", c.Device)
	case c.Spare != "" && c.Spare != "auto" && c.Spare != "on" && c.Spare != "off":
		return fmt.Errorf("spare %q: want auto, on or off", c.Spare)
	case c.Spares < 0 || c.Spares > MaxSpares:
		return fmt.Errorf("spares %d: want 1 to %d", c.Spares, MaxSpares)
	case c.TensorParallelSize < 1:
		return fmt.Errorf("tensor parallel size %d: want at least 1", c.TensorParallelSize)
	case c.RingCapacity < 4096:
		return fmt.Errorf("ring capacity %d is below 4096 bytes", c.RingCapacity)
	case c.PrimeFaultPath && (c.NoMPS || c.MPSPipeDir != ""):
		return errors.New("priming the fault path needs frmps's own MPS daemon: with the operator's daemon the deliberate fault would kill its other clients, and without MPS there is nothing to prime")
	case c.FailbackDelay < 0 || c.FailbackBaseBackoff < 0 || c.FailbackMaxBackoff < c.FailbackBaseBackoff:
		return fmt.Errorf("failback timing: want 0 <= delay (%s), 0 <= base backoff (%s) <= max backoff (%s)", c.FailbackDelay, c.FailbackBaseBackoff, c.FailbackMaxBackoff)
	case c.MPSPipeDir != "" && c.NoMPS:
		return errors.New("an MPS pipe directory to join and no MPS: choose one")
	case c.MPSPipeDir != "" && !filepath.IsAbs(c.MPSPipeDir):
		return fmt.Errorf("MPS pipe directory %q: want an absolute path", c.MPSPipeDir)
	case c.MPSLogDir != "" && c.MPSPipeDir == "":
		return errors.New("an MPS log directory is for a joined daemon: give its pipe directory too")
	case c.StepTimeoutFactor < 1:
		return fmt.Errorf("step timeout factor %g: want at least 1 (a step may take what the engine expects)", c.StepTimeoutFactor)
	case c.StepTimeoutMin < 0 || c.StepTimeoutDefault < 0:
		return fmt.Errorf("step timeouts %s / %s: want positive durations", c.StepTimeoutMin, c.StepTimeoutDefault)
	}
	if err := c.Breaker.Validate(); err != nil {
		return err
	}
	return nil
}

// DefaultSyncEvery is the ring publish interval in engine steps: every step.
// The publish overlaps the device's pass, so it costs no measurable
// throughput, and a takeover then replays at most the one token sampled after
// the last sync (bench/results/2026-11-22-h100: sync overhead).
const DefaultSyncEvery = 1
