package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"strconv"
	"syscall"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/frmps/frmps/supervisor"
	"github.com/frmps/frmps/supervisor/admin"
	"github.com/frmps/frmps/supervisor/engine"
	"github.com/frmps/frmps/supervisor/failover"
	"github.com/frmps/frmps/supervisor/sdnotify"
)

// serveOptions are `frmps serve`'s settings. The JSON names are the keys of
// the --config file; a flag given on the command line wins over the file.
type serveOptions struct {
	Model            string        `json:"model"`
	Engine           string        `json:"engine"`
	Python           string        `json:"python"`
	SyncEvery        uint32        `json:"sync_every"`
	Host             string        `json:"host"`
	Port             int           `json:"port"`
	AdminAddr        string        `json:"admin_addr"`
	AdminAllowRemote bool          `json:"admin_allow_remote"`
	NoMPS            bool          `json:"no_mps"`
	MPSControl       string        `json:"mps_control"`
	RunDir           string        `json:"run_dir"`
	EngineLogDir     string        `json:"engine_log_dir"`
	RingDir          string        `json:"ring_dir"`
	RingCapacity     uint64        `json:"ring_capacity"`
	Device           string        `json:"device"`
	Memory           string        `json:"memory"`
	NumBlocks        int           `json:"num_blocks"`
	MaxModelLen      int           `json:"max_model_len"`
	EngineArgs       []string      `json:"engine_args"`
	MaxConcurrent    int           `json:"max_concurrent"`
	MaxQueue         int           `json:"max_queue"`
	MaxBodyBytes     int64         `json:"max_body_bytes"`
	APIKeyFile       string        `json:"api_key_file"`
	MaxRestarts      int           `json:"max_restarts"`
	RestartWindow    time.Duration `json:"-"`
	RestartWindowStr string        `json:"restart_window"` // file only: a Go duration, e.g. "60s"
	ShutdownGrace    time.Duration `json:"-"`
	StallTimeout     time.Duration `json:"-"`
	StallTimeoutStr  string        `json:"stall_timeout"`
	ShutdownGraceStr string        `json:"shutdown_grace"`
	LogLevel         string        `json:"log_level"`
	LogJSON          bool          `json:"log_json"`
}

func defaultServeOptions() serveOptions {
	return serveOptions{
		Model: "tiny", Engine: "ref", SyncEvery: 16, Port: 8000,
		AdminAddr: "127.0.0.1:8001", MPSControl: "nvidia-cuda-mps-control", RingCapacity: 8 << 20,
		Device: "cpu", Memory: "host-shm", MaxRestarts: failover.DefaultBreaker.MaxRestarts,
		RestartWindow: failover.DefaultBreaker.Window, ShutdownGrace: 10 * time.Second, StallTimeout: 30 * time.Second, LogLevel: "info",
	}
}

func newServeCmd() *cobra.Command {
	opts := defaultServeOptions()
	var configFile string
	cmd := &cobra.Command{
		Use:   "serve",
		Short: "Run an active/standby engine pair behind an OpenAI-compatible endpoint",
		Long: `Run an active/standby engine pair behind an OpenAI-compatible endpoint.

The active engine runs inside a private MPS session (unless --no-mps), the
standby outside it, asleep with the shared weights and KV cache mapped. When
the active dies the standby takes over its requests; a fresh standby is then
started. SIGTERM or SIGINT shuts everything down gracefully.

Settings may also come from a JSON file (--config) whose keys are the flag
names with underscores (e.g. {"model": "qwen2.5-0.5b", "sync_every": 8,
"restart_window": "2m"}); flags given on the command line override the file.

The default model "tiny" is the reference engine's small preset: it runs on a
CPU in seconds, for trying frmps out. Use e.g. --model qwen2.5-7b --device cuda
--memory cuda-vmm on a GPU.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if configFile != "" {
				if err := applyConfigFile(cmd.Flags(), &opts, configFile); err != nil {
					return err
				}
			}
			return runServe(cmd.Context(), opts, cmd.ErrOrStderr())
		},
	}
	bindServeFlags(cmd.Flags(), &opts, &configFile)
	return cmd
}

func bindServeFlags(f *pflag.FlagSet, opts *serveOptions, configFile *string) {
	f.StringVar(configFile, "config", "", "JSON config file (flags override it)")
	f.StringVar(&opts.Model, "model", opts.Model, "model: a preset name (tiny, qwen2.5-0.5b, …, qwen2.5-14b) or a model directory")
	f.StringVar(&opts.Engine, "engine", opts.Engine, "engine: ref (the reference engine) or vllm")
	f.StringVar(&opts.Python, "python", opts.Python, "Python interpreter that runs the engines, with frmps_engine importable (default: $FRMPS_PYTHON, else the .venv of the source checkout holding this binary, else python3)")
	f.Uint32Var(&opts.SyncEvery, "sync-every", opts.SyncEvery, "engine steps between forward-state syncs to the ring")
	f.StringVar(&opts.Host, "host", opts.Host, "address the OpenAI endpoint binds (empty: all interfaces)")
	f.IntVar(&opts.Port, "port", opts.Port, "port of the OpenAI endpoint")
	f.StringVar(&opts.AdminAddr, "admin-addr", opts.AdminAddr, "admin API address (gRPC and REST); loopback only unless --admin-allow-remote")
	f.BoolVar(&opts.AdminAllowRemote, "admin-allow-remote", opts.AdminAllowRemote, "allow a non-loopback --admin-addr (the admin API can kill engines)")
	f.BoolVar(&opts.NoMPS, "no-mps", opts.NoMPS, "do not start an MPS daemon; the active runs outside MPS")
	f.StringVar(&opts.MPSControl, "mps-control", opts.MPSControl, "the nvidia-cuda-mps-control binary")
	f.StringVar(&opts.RunDir, "run-dir", opts.RunDir, "private run directory for sockets and logs, created 0700 and removed at exit (empty: a fresh temp dir)")
	f.StringVar(&opts.EngineLogDir, "engine-log-dir", opts.EngineLogDir, "directory for the engines' log files, kept after exit (empty: inside the run dir, removed at exit)")
	f.StringVar(&opts.RingDir, "ring-dir", opts.RingDir, "directory of the forward-state ring (empty: /dev/shm)")
	f.Uint64Var(&opts.RingCapacity, "ring-capacity", opts.RingCapacity, "ring size in bytes")
	f.StringVar(&opts.Device, "device", opts.Device, "engine device: cpu or cuda")
	f.StringVar(&opts.Memory, "memory", opts.Memory, "shared memory backend: host-shm (CPU) or cuda-vmm (GPU)")
	f.IntVar(&opts.NumBlocks, "num-blocks", opts.NumBlocks, "KV cache blocks (0: the engine's default)")
	f.IntVar(&opts.MaxModelLen, "max-model-len", opts.MaxModelLen, "maximum sequence length (0: the engine's default)")
	f.StringArrayVar(&opts.EngineArgs, "engine-arg", opts.EngineArgs, "extra argument for the engine's command line, repeatable (e.g. --engine-arg=--max-num-seqs=64)")
	f.IntVar(&opts.MaxConcurrent, "max-concurrent", opts.MaxConcurrent, "most requests running against the engine at once (0: 512)")
	f.IntVar(&opts.MaxQueue, "max-queue", opts.MaxQueue, "most requests waiting for a slot before 429 (0: 1024; negative: no queue)")
	f.Int64Var(&opts.MaxBodyBytes, "max-body-bytes", opts.MaxBodyBytes, "largest request body accepted before 413 (0: 4 MiB)")
	f.StringVar(&opts.APIKeyFile, "api-key-file", opts.APIKeyFile, "file holding the API key clients must send as a Bearer token (else FRMPS_API_KEY, else none)")
	f.IntVar(&opts.MaxRestarts, "max-restarts", opts.MaxRestarts, "crash-loop breaker: an engine role dying more than this many times within --restart-window is not restarted")
	f.DurationVar(&opts.RestartWindow, "restart-window", opts.RestartWindow, "crash-loop breaker window")
	f.DurationVar(&opts.StallTimeout, "stall-timeout", opts.StallTimeout, "fail over from an active that is connected but makes no progress (no heartbeat, or no step with requests running) for this long; negative disables")
	f.DurationVar(&opts.ShutdownGrace, "shutdown-grace", opts.ShutdownGrace, "how long engines get to exit on shutdown before being killed")
	f.StringVar(&opts.LogLevel, "log-level", opts.LogLevel, "log level: trace, debug, info, warn, error")
	f.BoolVar(&opts.LogJSON, "log-json", opts.LogJSON, "log as JSON lines")
}

// applyConfigFile loads path into opts, then re-applies the flags the user
// set so they win.
func applyConfigFile(flags *pflag.FlagSet, opts *serveOptions, path string) error {
	data, err := os.ReadFile(path)
	if err != nil {
		return fmt.Errorf("read config: %w", err)
	}
	changed := map[string]string{}
	flags.Visit(func(f *pflag.Flag) { changed[f.Name] = f.Value.String() })
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(opts); err != nil {
		return fmt.Errorf("config %s: %w", path, err)
	}
	for name, s := range map[string]struct {
		raw string
		dst *time.Duration
	}{"restart_window": {opts.RestartWindowStr, &opts.RestartWindow}, "shutdown_grace": {opts.ShutdownGraceStr, &opts.ShutdownGrace},
		"stall_timeout": {opts.StallTimeoutStr, &opts.StallTimeout}} {
		if s.raw == "" {
			continue
		}
		d, err := time.ParseDuration(s.raw)
		if err != nil {
			return fmt.Errorf("config %s: %s: %w", path, name, err)
		}
		*s.dst = d
	}
	for name, v := range changed {
		if err := flags.Set(name, v); err != nil {
			return fmt.Errorf("re-apply --%s: %w", name, err)
		}
	}
	return nil
}

func (o serveOptions) supervisorConfig(py pythonEnv) supervisor.Config {
	b := failover.DefaultBreaker
	b.MaxRestarts, b.Window = o.MaxRestarts, o.RestartWindow
	return supervisor.Config{
		Model: o.Model, Engine: o.Engine, Python: py.Python, BaseEnv: sdnotify.StripEnv(py.Env), SyncEvery: o.SyncEvery,
		RunDir: o.RunDir, LogDir: o.EngineLogDir, RingDir: o.RingDir, RingCapacity: o.RingCapacity,
		NoMPS: o.NoMPS, MPSControlBinary: o.MPSControl, Device: o.Device, Memory: o.Memory,
		NumBlocks: o.NumBlocks, MaxModelLen: o.MaxModelLen, EngineArgs: o.EngineArgs, Breaker: b, ShutdownGrace: o.ShutdownGrace, StallTimeout: o.StallTimeout,
	}
}

// validate checks what can be checked before anything starts.
func (o serveOptions) validate() error {
	if o.Port < 0 || o.Port > 65535 {
		return fmt.Errorf("--port %d out of range", o.Port)
	}
	if hclog.LevelFromString(o.LogLevel) == hclog.NoLevel {
		return fmt.Errorf("--log-level %q: want trace, debug, info, warn or error", o.LogLevel)
	}
	if o.Engine != "ref" && o.Engine != "vllm" {
		return fmt.Errorf("--engine %q: want ref or vllm", o.Engine)
	}
	if o.SyncEvery == 0 {
		return errors.New("--sync-every must be at least 1")
	}
	if o.MaxRestarts < 1 || o.RestartWindow <= 0 {
		return fmt.Errorf("--max-restarts %d / --restart-window %s: both must be positive", o.MaxRestarts, o.RestartWindow)
	}
	return admin.CheckAddr(o.AdminAddr, o.AdminAllowRemote)
}

func runServe(ctx context.Context, o serveOptions, stderr io.Writer) error {
	if ctx == nil {
		ctx = context.Background()
	}
	if err := o.validate(); err != nil {
		return err
	}
	lvl := hclog.LevelFromString(o.LogLevel)
	log := hclog.New(&hclog.LoggerOptions{Name: "frmps", Level: lvl, JSONFormat: o.LogJSON, Output: stderr})

	py := findPython(o.Python, selfPath(), os.Environ())
	pkg, err := engine.PythonCLI{Engine: o.Engine, Python: py.Python}.Preflight(ctx, py.Env)
	if err != nil {
		return fmt.Errorf("%w (interpreter from %s); pass --python with an interpreter that has frmps_engine installed "+
			"(`make venv` creates .venv in a source checkout), or set FRMPS_PYTHON", err, py.Source)
	}
	log.Info("engine interpreter", "python", py.Python, "from", py.Source, "frmps_engine", pkg)

	notify, err := sdnotify.New(log.Named("systemd"))
	if err != nil {
		return err
	}
	defer notify.Close()

	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	sup, err := supervisor.New(o.supervisorConfig(py), log.Named("supervisor"), reg)
	if err != nil {
		return err
	}
	if every := notify.WatchdogInterval(); every > 0 {
		sup.SetWatchdog(notify, every)
	}
	fd, err := newFrontDoor(o, sup, log.Named("openai"), reg)
	if err != nil {
		return err
	}
	adm, err := admin.New(admin.Config{Addr: o.AdminAddr, AllowNonLoopback: o.AdminAllowRemote, Gatherer: reg}, sup, log.Named("admin"))
	if err != nil {
		return err
	}
	admL, err := adm.Listen()
	if err != nil {
		return err
	}
	var apiL net.Listener
	if fd != nil {
		if apiL, err = net.Listen("tcp", net.JoinHostPort(o.Host, strconv.Itoa(o.Port))); err != nil {
			admL.Close()
			return fmt.Errorf("OpenAI endpoint listen: %w", err)
		}
		sup.SetFrontDoor(fd)
	} else {
		log.Warn("this build has no OpenAI front door; serving the admin API only")
	}

	sigCtx, stopSignals := signal.NotifyContext(ctx, syscall.SIGTERM, syscall.SIGINT)
	defer stopSignals()
	supCtx, stopSup := context.WithCancel(context.Background())
	defer stopSup()
	supDone := make(chan error, 1)
	go func() { supDone <- sup.Run(supCtx) }()
	admCtx, stopAdm := context.WithCancel(context.Background())
	defer stopAdm()
	admDone := make(chan error, 1)
	go func() { admDone <- adm.Serve(admCtx, admL) }()
	apiDone := make(chan error, 1)
	if fd != nil {
		go func() { apiDone <- fd.Serve(apiL) }()
	}
	log.Info("serving", "model", o.Model, "engine", o.Engine, "port", o.Port, "admin", admL.Addr().String())
	readyCtx, stopReady := context.WithCancel(context.Background())
	defer stopReady()
	readyDone := make(chan struct{})
	go func() {
		defer close(readyDone)
		notifyReady(readyCtx, sup, notify, o.Model)
	}()

	var runErr error
	select {
	case <-sigCtx.Done():
		log.Info("shutting down")
	case runErr = <-supDone:
		supDone <- runErr // consumed again below
		if runErr == nil {
			runErr = errors.New("supervisor stopped unexpectedly")
		}
	case runErr = <-admDone:
		admDone <- runErr
	case runErr = <-apiDone:
		apiDone <- runErr
	}
	notify.Stopping("draining requests, then stopping the engines")
	stopReady()
	<-readyDone
	// Order matters: stop taking requests and drain them, then the engines,
	// then the admin API (status stays readable during the drain).
	if fd != nil {
		dctx, cancel := context.WithTimeout(context.Background(), o.ShutdownGrace+5*time.Second)
		if err := fd.Shutdown(dctx); err != nil {
			log.Warn("front door shutdown", "error", err)
		}
		cancel()
		<-apiDone
	}
	stopSup()
	if err := <-supDone; err != nil && runErr == nil {
		runErr = err
	}
	stopAdm()
	if err := <-admDone; err != nil && runErr == nil {
		runErr = err
	}
	return runErr
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
