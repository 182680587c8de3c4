// Package vllmfront is frmps serve's `--frontend vllm`: vLLM's own OpenAI API
// server (the code of `vllm serve`, every route and parameter of the pinned
// vLLM) runs as the front door, in a Python process outside MPS that holds no
// CUDA context, and the engines speak vLLM's engine-core protocol to it
// instead of frmps's generation API (vllmpatch/OPENAI.md, design (a)). This
// package supervises that process and is the supervisor's FrontDoor for it.
package vllmfront

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/hashicorp/go-hclog"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
	"github.com/frmps/frmps/supervisor/mps"
)

// Config is what the frontend process is started with.
type Config struct {
	Python string   // interpreter with frmps_engine and vLLM importable
	Env    []string // the engines' base environment (frontendEnv adjusts it)
	// Model is what vLLM's API server loads its tokenizer and config from (a
	// model directory), ServedModelName what clients call it.
	Model, ServedModelName string
	Host                   string // "": every interface
	Port                   int
	MaxModelLen            int // 0: vLLM's default
	// VLLMArgs are vLLM's flags the engines get too (serve's --vllm-arg),
	// FrontendArgs the API server's only (--frontend-arg), as `vllm serve`
	// spells them.
	VLLMArgs, FrontendArgs []string
	// APIKey (may be empty) reaches vLLM as VLLM_API_KEY, not on its command line.
	APIKey string
}

// FrontDoor is the frontend process. Its resume ledger is the source of a
// failover's resume set: OpenRequests asks it (EngineLost: it holds new work,
// consumes what the dead engine had pushed, and returns each open request as
// vLLM's EngineCoreRequest with the tokens it received), and a goroutine then
// waits for the promoted engine to connect (EngineBack), after which the
// frontend sends what it held.
type FrontDoor struct {
	log  hclog.Logger
	dir  string // private (0700): the engine-core sockets and the control socket
	argv []string
	env  []string

	// Addresses the engines connect to (EngineCoreAddrs).
	inputAddr, outputAddr, controlPath string

	conn *grpc.ClientConn
	ctl  frmpsv1.FrontendClient

	lostTimeout time.Duration // EngineLost, drain included
	drainMs     uint32
	backTimeout time.Duration // one EngineBack round (repeated while no engine connects)

	mu       sync.Mutex
	cmd      *exec.Cmd
	exited   chan struct{} // closed when the process is reaped
	exitErr  error
	stopping bool
	backing  bool // an EngineBack call is in flight
	backWG   sync.WaitGroup

	// For Status (FrontendStatus), under mu: counts, the last error, and the
	// latest FrontendHealth answer, refreshed in the background when older
	// than healthTTL (Status never waits on the frontend).
	lost, back uint64
	lastErr    string
	health     *frmpsv1.FrontendHealthResponse
	healthAt   time.Time
	healthBusy bool
	healthTTL  time.Duration
	healthWG   sync.WaitGroup
}

// Args are the `vllm serve` arguments the frontend process gets: the model,
// address and limits, then c.VLLMArgs and c.FrontendArgs.
func Args(c Config) []string {
	args := []string{c.Model, "--host", c.Host, "--port", strconv.Itoa(c.Port), "--served-model-name", c.ServedModelName}
	if c.Host == "" {
		args = append(args[:1], args[3:]...) // vLLM binds every interface without --host
	}
	if c.MaxModelLen > 0 {
		args = append(args, "--max-model-len", strconv.Itoa(c.MaxModelLen))
	}
	args = append(args, c.VLLMArgs...)
	return append(args, c.FrontendArgs...)
}

// New prepares (does not start: Serve does) the frontend process, with a
// private directory for its sockets that Shutdown removes.
func New(c Config, log hclog.Logger) (*FrontDoor, error) {
	dir, err := os.MkdirTemp("", "frmps-frontend-")
	if err != nil {
		return nil, fmt.Errorf("vLLM frontend: %w", err)
	}
	if err := os.Chmod(dir, 0o700); err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("vLLM frontend: %w", err)
	}
	// Outside MPS like the standby: were the frontend ever to make a CUDA
	// context, it must not be an MPS client that a co-tenant's fault kills.
	outside, err := mps.OutsideEnv(dir)
	if err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("vLLM frontend: %w", err)
	}
	d := &FrontDoor{
		log: log, dir: dir,
		inputAddr: "ipc://" + filepath.Join(dir, "core-input.sock"), outputAddr: "ipc://" + filepath.Join(dir, "core-output.sock"),
		controlPath: filepath.Join(dir, "frontend.sock"),
		lostTimeout: 5 * time.Second, drainMs: 2000, backTimeout: time.Minute, healthTTL: time.Second,
		exited: make(chan struct{}),
	}
	d.argv = append([]string{c.Python, "-m", "frmps_engine.cli", "frontend",
		"--engine-input", d.inputAddr, "--engine-output", d.outputAddr, "--control-socket", d.controlPath},
		Args(c)...)
	d.env = frontendEnv(c.Env, outside, c.APIKey)
	// The control socket is local: reconnect within a second at most. Status polls
	// the frontend's health while vLLM still imports (seconds, more on a loaded
	// machine) and the socket does not exist yet; with gRPC's default backoff each
	// failed dial lengthens the wait before the next one towards minutes, and a call
	// meanwhile fails at once with the stale dial error: a failover's EngineLost
	// then found "no such file" for a socket that was there.
	conn, err := grpc.NewClient("unix://"+d.controlPath, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithConnectParams(grpc.ConnectParams{Backoff: backoff.Config{
			BaseDelay: 50 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: time.Second}}))
	if err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("vLLM frontend control client: %w", err)
	}
	d.conn, d.ctl = conn, frmpsv1.NewFrontendClient(conn)
	return d, nil
}

// EngineCoreAddrs are the addresses the engines connect to, vLLM's
// engine-core input and output (supervisor.Config.EngineCoreInput/Output).
func (d *FrontDoor) EngineCoreAddrs() (input, output string) { return d.inputAddr, d.outputAddr }

// frontendEnv is the frontend's environment: the engines' base environment
// with the outside-MPS pipe directories, the API key as VLLM_API_KEY, and
// without VLLM_SERVER_DEV_MODE (it would expose /sleep, /wake_up and
// /collective_rpc to clients) or an API key of the caller's own.
func frontendEnv(base, outside []string, apiKey string) []string {
	drop := map[string]bool{"VLLM_SERVER_DEV_MODE": true, "VLLM_API_KEY": true, "CUDA_MPS_PIPE_DIRECTORY": true, "CUDA_MPS_LOG_DIRECTORY": true}
	env := make([]string, 0, len(base)+len(outside)+1)
	for _, kv := range base {
		if k, _, _ := strings.Cut(kv, "="); !drop[k] {
			env = append(env, kv)
		}
	}
	env = append(env, outside...)
	if apiKey != "" {
		env = append(env, "VLLM_API_KEY="+apiKey)
	}
	return env
}

// Serve starts the frontend process and returns when it exits: nil after
// Shutdown, an error otherwise (serve then stops: every client connection
// was in that process). The listener is unused (nil): vLLM binds its port.
func (d *FrontDoor) Serve(net.Listener) error {
	cmd := exec.Command(d.argv[0], d.argv[1:]...)
	cmd.Env = d.env
	cmd.Stdout, cmd.Stderr = d.log.StandardWriter(&hclog.StandardLoggerOptions{InferLevels: true}), d.log.StandardWriter(&hclog.StandardLoggerOptions{InferLevels: true})
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGTERM}
	d.mu.Lock()
	if d.stopping {
		d.mu.Unlock()
		close(d.exited)
		return nil
	}
	if err := cmd.Start(); err != nil {
		d.mu.Unlock()
		close(d.exited)
		return fmt.Errorf("vLLM frontend: start %s: %w", d.argv[0], err)
	}
	d.cmd = cmd
	d.mu.Unlock()
	d.log.Info("vLLM frontend started", "pid", cmd.Process.Pid, "control", d.controlPath)
	err := cmd.Wait()
	// Nothing of the frontend outlives it (vLLM's helper processes included).
	_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
	d.mu.Lock()
	stopping := d.stopping
	d.exitErr = err
	d.mu.Unlock()
	close(d.exited)
	if stopping {
		return nil
	}
	if err == nil {
		err = errors.New("exited")
	}
	return fmt.Errorf("vLLM frontend (pid %d): %w", cmd.Process.Pid, err)
}

// Shutdown stops the frontend: SIGTERM to its process group (uvicorn then
// finishes its responses), SIGKILL when ctx ends; then the control client,
// every EngineBack call and the private directory.
func (d *FrontDoor) Shutdown(ctx context.Context) error {
	d.mu.Lock()
	d.stopping = true
	cmd := d.cmd
	d.mu.Unlock()
	var err error
	if cmd != nil {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGTERM)
		select {
		case <-d.exited:
		case <-ctx.Done():
			_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
			<-d.exited
			err = fmt.Errorf("vLLM frontend did not stop in time: killed")
		}
	}
	d.conn.Close() // fails EngineBack and FrontendHealth calls in flight
	d.backWG.Wait()
	d.healthWG.Wait()
	if rerr := os.RemoveAll(d.dir); rerr != nil && err == nil {
		err = rerr
	}
	return err
}

// OpenRequests is the resume set of a failover or a handover: what the
// frontend has sent to the engine that is gone and not seen finish, each as
// vLLM's EngineCoreRequest (opaque here) with the tokens the frontend
// received. The supervisor adds the ring snapshots by key. On an error the
// set is empty: the promoted engine then has nothing to adopt, and the
// frontend's open requests get no more tokens (logged as an error).
func (d *FrontDoor) OpenRequests() []*frmpsv1.ResumeRequest {
	ctx, cancel := context.WithTimeout(context.Background(), d.lostTimeout)
	defer cancel()
	// WaitForReady: a connection between two dials (backoff) is waited for, within ctx.
	set, err := d.ctl.EngineLost(ctx, &frmpsv1.EngineLostRequest{DrainTimeoutMs: d.drainMs}, grpc.WaitForReady(true))
	d.mu.Lock()
	if err != nil {
		d.lastErr = "EngineLost: " + err.Error()
	} else {
		d.lost++
	}
	d.mu.Unlock()
	if err != nil {
		d.log.Error("vLLM frontend: no resume set; its open requests cannot be resumed", "error", err)
		d.awaitEngine()
		return nil
	}
	reqs := make([]*frmpsv1.ResumeRequest, 0, len(set.GetEntries()))
	for _, e := range set.GetEntries() {
		reqs = append(reqs, &frmpsv1.ResumeRequest{
			Key: e.GetKey(), EngineRequest: e.GetEngineRequest(), DeliveredTokenIds: e.GetDeliveredTokenIds(),
		})
	}
	d.log.Debug("vLLM frontend resume set", "requests", len(reqs), "held", set.GetHeldRequests())
	d.awaitEngine()
	return reqs
}

// awaitEngine waits, off the caller's goroutine, for the next engine to
// connect to the frontend (one wait at a time: a later failover during the
// wait is covered by the same one, which ends when any engine connects). The
// frontend holds new requests until then, so the wait goes on, in rounds of
// backTimeout, until an engine connects or frmps stops.
func (d *FrontDoor) awaitEngine() {
	d.mu.Lock()
	if d.backing || d.stopping {
		d.mu.Unlock()
		return
	}
	d.backing = true
	d.backWG.Add(1)
	d.mu.Unlock()
	go func() {
		defer d.backWG.Done()
		start := time.Now()
		for {
			ctx, cancel := context.WithTimeout(context.Background(), d.backTimeout+5*time.Second)
			resp, err := d.ctl.EngineBack(ctx, &frmpsv1.EngineBackRequest{TimeoutMs: uint32(d.backTimeout / time.Millisecond)},
				grpc.WaitForReady(true))
			cancel()
			d.mu.Lock()
			stopping := d.stopping
			if err == nil || stopping || status.Code(err) != codes.DeadlineExceeded {
				d.backing = false
			}
			switch {
			case err == nil:
				d.back++
			case !stopping && status.Code(err) != codes.DeadlineExceeded && status.Code(err) != codes.FailedPrecondition:
				d.lastErr = "EngineBack: " + err.Error()
			}
			d.mu.Unlock()
			switch {
			case err == nil:
				d.log.Info("vLLM frontend: engine back", "after", time.Since(start), "held_sent", resp.GetSentHeld())
				return
			case stopping:
				return
			case status.Code(err) == codes.DeadlineExceeded:
				d.log.Warn("vLLM frontend: still no engine connected; its requests wait", "after", time.Since(start))
			case status.Code(err) == codes.FailedPrecondition:
				return // an engine is connected already
			default:
				d.log.Error("vLLM frontend: waiting for the engine failed", "error", err, "after", time.Since(start))
				return
			}
		}
	}()
}

// FrontendStatus is the frontend's state for Status (supervisor.FrontendStatuser):
// what frmps knows itself (process, losses, waits) and the frontend's latest
// FrontendHealth answer, at most healthTTL old plus one call. It never blocks:
// a stale answer starts a refresh in the background.
func (d *FrontDoor) FrontendStatus() *frmpsv1.FrontendStatus {
	d.mu.Lock()
	defer d.mu.Unlock()
	fs := &frmpsv1.FrontendStatus{Kind: "vllm", EngineLost: d.lost, EngineBack: d.back, LastError: d.lastErr}
	if d.cmd != nil {
		fs.Pid = int32(d.cmd.Process.Pid)
	}
	exited := false
	select {
	case <-d.exited:
		exited = true
	default:
	}
	if h := d.health; h != nil {
		fs.EngineConnected, fs.OpenRequests, fs.VllmVersion = h.GetEngineConnected(), h.GetOpenRequests(), h.GetVllmVersion()
	}
	switch {
	case exited:
		fs.State, fs.EngineConnected = "exited", false
	case d.backing:
		fs.State = "waiting_engine"
	case fs.EngineConnected:
		fs.State = "serving"
	default:
		fs.State = "starting"
	}
	if !exited && !d.stopping && !d.healthBusy && time.Since(d.healthAt) >= d.healthTTL {
		d.healthBusy = true
		d.healthWG.Add(1)
		go d.refreshHealth()
	}
	return fs
}

func (d *FrontDoor) refreshHealth() {
	defer d.healthWG.Done()
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	h, err := d.ctl.FrontendHealth(ctx, &frmpsv1.FrontendHealthRequest{})
	cancel()
	d.mu.Lock()
	defer d.mu.Unlock()
	d.healthBusy, d.healthAt = false, time.Now()
	d.health = h // nil on an error (not yet listening, or gone): nothing known
	if err != nil && !d.stopping && status.Code(err) != codes.Unavailable {
		d.lastErr = "FrontendHealth: " + err.Error()
	}
}
