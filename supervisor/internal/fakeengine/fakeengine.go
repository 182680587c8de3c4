// Package fakeengine is a TEST DOUBLE: a fake engine that speaks the real
// control protocol (package control, proto/frmps/v1/control.proto) and has
// no model. It exists so the supervisor's lifecycle, failover and broker
// code can be tested against a real peer process without Python or a GPU.
// It does not serve the generation API.
//
// What it does, by role:
//   - active: Hello → Welcome → creates small memfd pools (each starts with
//     a marker naming its pool) → PoolExport with the fds → Ready → answers
//     Ping and Shutdown.
//   - standby: Hello → Welcome → waits for Sleep with fds, checks their
//     number, sizes and markers → Ready → on Resume, replies listing every
//     request as resumed, then serves like an active.
//
// Behaviour selects a misbehaving engine for the failure tests.
package fakeengine

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
	"github.com/frmps/frmps/supervisor/control"
)

// Behavior selects how the fake engine behaves.
type Behavior string

const (
	// Normal follows the protocol for its role.
	Normal Behavior = "normal"
	// WrongVersion says PROTOCOL_VERSION 99 in its Hello and expects a
	// refusal.
	WrongVersion Behavior = "wrong-version"
	// DieDuringTakeover (standby) dies abruptly when it receives Resume.
	DieDuringTakeover Behavior = "die-during-takeover"
	// Hang sends Hello, reads the Welcome, then never speaks or reads again.
	Hang Behavior = "hang"
	// Garbage sends bytes that are not a valid frame instead of a Hello.
	Garbage Behavior = "garbage"
	// Fault (active) reports a CUDA fault after Ready and exits with code 1,
	// printing a CUDA error line on stderr like a crashing PyTorch engine.
	Fault Behavior = "fault"
)

// Behaviors lists every behaviour, for flag help and tests.
var Behaviors = []Behavior{Normal, WrongVersion, DieDuringTakeover, Hang, Garbage, Fault}

// FaultLine is what the Fault behaviour prints on stderr before exiting.
const FaultLine = "torch.AcceleratorError: CUDA error: misaligned address"

// Config configures one fake engine.
type Config struct {
	Role     frmpsv1.Role
	Socket   string // control socket path
	Behavior Behavior
	// HelloPID is the pid the Hello claims; 0 = the real pid.
	HelloPID int
	Model    string // "" = "fake"
	// Pools is the layout; nil = DefaultPools().
	Pools              []*frmpsv1.Pool
	GenerationEndpoint string
	// CheckMarkers makes a standby verify the marker an active fake engine
	// wrote at the start of each pool, proving the fds reach the same memory.
	CheckMarkers bool
	// Stderr receives the lines a real engine would print when it fails;
	// nil = discard.
	Stderr io.Writer
	// HeartbeatEvery makes a serving engine send Heartbeat messages at this
	// interval (0 = none).
	HeartbeatEvery time.Duration
}

// ExitError asks the process to end abruptly, as a crashing engine would:
// by Signal when set, else with Code.
type ExitError struct {
	Code   int
	Signal syscall.Signal
	Reason string
}

func (e *ExitError) Error() string {
	if e.Signal != 0 {
		return fmt.Sprintf("fake engine dies by %s: %s", e.Signal, e.Reason)
	}
	return fmt.Sprintf("fake engine exits with code %d: %s", e.Code, e.Reason)
}

// ErrRefused is wrapped when the supervisor refuses the Hello.
var ErrRefused = errors.New("refused by the supervisor")

// DefaultPools is a small layout: weights and one KV pool.
func DefaultPools() []*frmpsv1.Pool {
	return []*frmpsv1.Pool{
		{Tag: "weights", Index: 0, Size: 64 << 10, Backend: control.BackendHostSHM},
		{Tag: "kv_cache", Index: 0, Size: 128 << 10, Backend: control.BackendHostSHM},
	}
}

// Marker is the content an active fake engine writes at offset 0 of a pool.
func Marker(p *frmpsv1.Pool) []byte {
	return fmt.Appendf(nil, "frmps-fake-pool:%s:%d\n", p.GetTag(), p.GetIndex())
}

// Run runs the fake engine until Shutdown (nil), ctx ends (ctx's error),
// or a behaviour ends it (*ExitError).
func Run(ctx context.Context, cfg Config) error {
	if cfg.Pools == nil {
		cfg.Pools = DefaultPools()
	}
	if cfg.Behavior == "" {
		cfg.Behavior = Normal
	}
	if cfg.Model == "" {
		cfg.Model = "fake"
	}
	if cfg.Stderr == nil {
		cfg.Stderr = io.Discard
	}
	if cfg.Role != frmpsv1.Role_ROLE_ACTIVE && cfg.Role != frmpsv1.Role_ROLE_STANDBY {
		return fmt.Errorf("fake engine: role %s", cfg.Role)
	}
	if cfg.Behavior == Garbage {
		return sendGarbage(ctx, cfg.Socket)
	}
	c, err := control.Dial(cfg.Socket)
	if err != nil {
		return fmt.Errorf("fake engine: %w", err)
	}
	defer c.Close()
	// Closing the connection unblocks a Recv when ctx ends.
	stop := context.AfterFunc(ctx, func() { c.Close() })
	defer stop()

	e := &engine{cfg: cfg, c: c}
	defer e.closePools()
	err = e.run(ctx)
	if ctx.Err() != nil {
		return ctx.Err()
	}
	return err
}

type engine struct {
	cfg   Config
	c     *control.Conn
	pools []int // fds this engine holds (created or received)
}

func (e *engine) closePools() {
	_ = control.CloseFDs(e.pools)
	e.pools = nil
}

func (e *engine) run(ctx context.Context) error {
	began := time.Now()
	if err := e.hello(); err != nil {
		return err
	}
	if e.cfg.Behavior == Hang {
		<-ctx.Done()
		return ctx.Err()
	}
	if e.cfg.Role == frmpsv1.Role_ROLE_ACTIVE {
		if err := e.exportPools(); err != nil {
			return err
		}
		if err := e.send(0, &frmpsv1.Envelope_Ready{Ready: &frmpsv1.Ready{Role: e.cfg.Role, InitNs: uint64(time.Since(began))}}); err != nil {
			return err
		}
		if e.cfg.Behavior == Fault {
			return e.fault()
		}
		return e.serve(false)
	}
	if err := e.sleep(began); err != nil {
		return err
	}
	return e.serve(true)
}

func (e *engine) send(id uint64, msg any) error {
	env := &frmpsv1.Envelope{Id: id}
	switch m := msg.(type) {
	case *frmpsv1.Envelope_Hello:
		env.Msg = m
	case *frmpsv1.Envelope_Ready:
		env.Msg = m
	case *frmpsv1.Envelope_Reply:
		env.Msg = m
	case *frmpsv1.Envelope_Fault:
		env.Msg = m
	default:
		return fmt.Errorf("fake engine: cannot send %T", msg)
	}
	if err := e.c.Send(env, nil); err != nil {
		return fmt.Errorf("fake engine: %w", err)
	}
	return nil
}

func (e *engine) reply(id uint64, r *frmpsv1.Reply) error {
	return e.send(id, &frmpsv1.Envelope_Reply{Reply: r})
}

func (e *engine) hello() error {
	pid := e.cfg.HelloPID
	if pid == 0 {
		pid = os.Getpid()
	}
	version := control.ProtocolVersion
	if e.cfg.Behavior == WrongVersion {
		version = 99
	}
	if err := e.send(0, &frmpsv1.Envelope_Hello{Hello: &frmpsv1.Hello{
		ProtocolVersion:    version,
		Role:               e.cfg.Role,
		Pid:                int32(pid),
		Model:              e.cfg.Model,
		Engine:             "fake",
		EngineVersion:      "test-double",
		Pools:              e.cfg.Pools,
		GenerationEndpoint: e.cfg.GenerationEndpoint,
		Device:             "cpu",
		BlockSize:          16,
	}}); err != nil {
		return err
	}
	env, fds, err := e.c.Recv()
	if err != nil {
		return fmt.Errorf("fake engine: waiting for Welcome: %w", err)
	}
	_ = control.CloseFDs(fds)
	w := env.GetWelcome()
	if w == nil {
		return fmt.Errorf("fake engine: expected Welcome, got %s", control.MessageName(env))
	}
	if !w.GetAccepted() {
		return fmt.Errorf("fake engine: %w: %s", ErrRefused, w.GetReason())
	}
	if e.cfg.Behavior == WrongVersion {
		return errors.New("fake engine: supervisor accepted protocol version 99")
	}
	return nil
}

// exportPools creates one memfd per pool, writes its marker and sends them.
func (e *engine) exportPools() error {
	for _, p := range e.cfg.Pools {
		fd, err := unix.MemfdCreate("frmps-fake-"+p.GetTag(), unix.MFD_CLOEXEC)
		if err != nil {
			return fmt.Errorf("fake engine: memfd_create: %w", err)
		}
		e.pools = append(e.pools, fd)
		if err := unix.Ftruncate(fd, int64(p.GetSize())); err != nil {
			return fmt.Errorf("fake engine: size pool %s: %w", p.GetTag(), err)
		}
		if _, err := unix.Pwrite(fd, Marker(p), 0); err != nil {
			return fmt.Errorf("fake engine: write pool marker: %w", err)
		}
	}
	env := &frmpsv1.Envelope{Msg: &frmpsv1.Envelope_PoolExport{PoolExport: &frmpsv1.PoolExport{Pools: e.cfg.Pools}}}
	if err := e.c.Send(env, e.pools); err != nil {
		return fmt.Errorf("fake engine: export pools: %w", err)
	}
	return nil
}

func (e *engine) fault() error {
	_ = e.send(0, &frmpsv1.Envelope_Fault{Fault: &frmpsv1.Fault{
		Cause: "misaligned address", Detail: "fake engine fault injection", UnixNanos: uint64(time.Now().UnixNano()),
	}})
	fmt.Fprintln(e.cfg.Stderr, FaultLine)
	return &ExitError{Code: 1, Reason: "injected fault"}
}

// sleep waits for Sleep, checks the fds and answers Ready. Pings are
// answered meanwhile; Shutdown ends the engine.
func (e *engine) sleep(began time.Time) error {
	for {
		env, fds, err := e.c.Recv()
		if err != nil {
			return fmt.Errorf("fake engine: waiting for Sleep: %w", err)
		}
		switch m := env.GetMsg().(type) {
		case *frmpsv1.Envelope_Ping:
			if err := e.reply(env.GetId(), &frmpsv1.Reply{Ok: true}); err != nil {
				return err
			}
			continue
		case *frmpsv1.Envelope_Shutdown:
			return e.shutdown(env.GetId())
		case *frmpsv1.Envelope_Sleep:
			e.pools = fds
			if err := e.checkPools(m.Sleep.GetPools(), fds); err != nil {
				_ = e.reply(env.GetId(), &frmpsv1.Reply{Ok: false, Error: err.Error()})
				return fmt.Errorf("fake engine: sleep: %w", err)
			}
			return e.send(env.GetId(), &frmpsv1.Envelope_Ready{Ready: &frmpsv1.Ready{
				Role: frmpsv1.Role_ROLE_STANDBY, InitNs: uint64(time.Since(began)),
			}})
		default:
			_ = control.CloseFDs(fds)
			if err := e.reply(env.GetId(), &frmpsv1.Reply{Ok: false, Error: "standby is not asleep yet: " + control.MessageName(env)}); err != nil {
				return err
			}
		}
	}
}

// checkPools verifies what a real standby would before mapping: the
// brokered layout is ours, one fd per pool, each file as large as its pool.
func (e *engine) checkPools(pools []*frmpsv1.Pool, fds []int) error {
	if err := control.SameLayout(e.cfg.Pools, pools); err != nil {
		return err
	}
	if len(fds) != len(pools) {
		return fmt.Errorf("%d fds for %d pools", len(fds), len(pools))
	}
	for i, fd := range fds {
		var st unix.Stat_t
		if err := unix.Fstat(fd, &st); err != nil {
			return fmt.Errorf("pool %d: fstat: %w", i, err)
		}
		if uint64(st.Size) != pools[i].GetSize() {
			return fmt.Errorf("pool %d (%s): fd is %d bytes, pool is %d", i, pools[i].GetTag(), st.Size, pools[i].GetSize())
		}
		if !e.cfg.CheckMarkers {
			continue
		}
		want := Marker(pools[i])
		got := make([]byte, len(want))
		if _, err := unix.Pread(fd, got, 0); err != nil {
			return fmt.Errorf("pool %d: read marker: %w", i, err)
		}
		if !bytes.Equal(got, want) {
			return fmt.Errorf("pool %d (%s): marker %q, want %q: not the active's memory", i, pools[i].GetTag(), got, want)
		}
	}
	return nil
}

// serve answers commands until Shutdown. A standby (resumable) takes one
// Resume and then serves as the active.
func (e *engine) serve(resumable bool) error {
	if e.cfg.HeartbeatEvery > 0 {
		stop := make(chan struct{})
		done := make(chan struct{})
		go e.heartbeat(stop, done)
		defer func() { close(stop); <-done }()
	}
	for {
		env, fds, err := e.c.Recv()
		if err != nil {
			if errors.Is(err, io.EOF) {
				return errors.New("fake engine: control socket closed by the supervisor")
			}
			return fmt.Errorf("fake engine: %w", err)
		}
		_ = control.CloseFDs(fds) // no command a serving engine gets carries fds
		switch m := env.GetMsg().(type) {
		case *frmpsv1.Envelope_Ping:
			err = e.reply(env.GetId(), &frmpsv1.Reply{Ok: true})
		case *frmpsv1.Envelope_Shutdown:
			return e.shutdown(env.GetId())
		case *frmpsv1.Envelope_Resume:
			if !resumable {
				err = e.reply(env.GetId(), &frmpsv1.Reply{Ok: false, Error: "not a sleeping standby"})
				break
			}
			if e.cfg.Behavior == DieDuringTakeover {
				return &ExitError{Signal: syscall.SIGKILL, Reason: "died during takeover"}
			}
			resumable = false
			err = e.reply(env.GetId(), resumeReply(m.Resume))
		default:
			err = e.reply(env.GetId(), &frmpsv1.Reply{Ok: false, Error: "unexpected " + control.MessageName(env)})
		}
		if err != nil {
			return err
		}
	}
}

func (e *engine) heartbeat(stop <-chan struct{}, done chan<- struct{}) {
	defer close(done)
	tick := time.NewTicker(e.cfg.HeartbeatEvery)
	defer tick.Stop()
	for step := uint64(1); ; step++ {
		select {
		case <-stop:
			return
		case <-tick.C:
		}
		env := &frmpsv1.Envelope{Msg: &frmpsv1.Envelope_Heartbeat{Heartbeat: &frmpsv1.Heartbeat{
			Step: step, IntervalMs: uint32(max(1, e.cfg.HeartbeatEvery.Milliseconds()))}}}
		if e.c.Send(env, nil) != nil {
			return // the connection is gone; serve sees it too
		}
	}
}

func (e *engine) shutdown(id uint64) error {
	if err := e.reply(id, &frmpsv1.Reply{Ok: true}); err != nil {
		return err
	}
	return nil
}

// resumeReply lists every request as resumed: the tokens the snapshot
// covers are reused, the rest (up to what the client holds) prefilled.
func resumeReply(r *frmpsv1.Resume) *frmpsv1.Reply {
	began := time.Now()
	reply := &frmpsv1.Reply{Ok: true}
	for _, req := range r.GetRequests() {
		total := len(req.GetPromptTokenIds()) + len(req.GetDeliveredTokenIds())
		var reused uint32
		if s := req.GetSnapshot(); s != nil {
			reused = s.GetNumComputedTokens()
			seq := len(s.GetTokenIds())
			if seq == 0 { // the prompt left out: it is the request's prompt_token_ids
				seq = len(req.GetPromptTokenIds()) + len(s.GetOutputTokenIds())
			}
			total = max(total, seq)
		}
		reply.Resumed = append(reply.Resumed, &frmpsv1.ResumeOutcome{
			Key: req.GetKey(), Ok: true, ReusedTokens: reused, PrefilledTokens: uint32(max(total-int(reused), 0)),
		})
	}
	reply.TookNs = uint64(time.Since(began))
	return reply
}

// sendGarbage connects and sends a frame whose body is not an Envelope,
// then an impossible length prefix, then waits for the supervisor to hang up.
func sendGarbage(ctx context.Context, path string) error {
	conn, err := net.Dial("unix", path)
	if err != nil {
		return fmt.Errorf("fake engine: %w", err)
	}
	defer conn.Close()
	stop := context.AfterFunc(ctx, func() { conn.Close() })
	defer stop()
	body := []byte{0x0f, 0xde, 0xad, 0xbe, 0xef, 0xff, 0xff, 0xff}
	frame := append([]byte{byte(len(body)), 0, 0, 0}, body...)
	frame = append(frame, 0xff, 0xff, 0xff, 0xff)
	if _, err := conn.Write(frame); err != nil {
		return fmt.Errorf("fake engine: send garbage: %w", err)
	}
	_, _ = io.Copy(io.Discard, conn)
	if ctx.Err() != nil {
		return ctx.Err()
	}
	return nil
}
