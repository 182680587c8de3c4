package supervisor

// Test doubles (fakes) of every collaborator of the supervisor: in-memory
// control sockets, fake engine processes that speak the control protocol
// from a goroutine, a fake ring, broker and MPS daemon. They let the
// orchestrator run inside testing/synctest bubbles, where time is virtual.

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
	"syscall"
	"time"

	"github.com/hashicorp/go-hclog"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
	"github.com/frmps/frmps/supervisor/engine"
	"github.com/frmps/frmps/supervisor/failover"
)

type fakeMsg struct {
	env *frmpsv1.Envelope
	fds []int
}

// fakeConn is one end of an in-memory control connection.
type fakeConn struct {
	in, out chan fakeMsg
	closed  chan struct{}
	once    *sync.Once
	peerPID int
}

func fakePipe(pid int) (server, client *fakeConn) {
	a, b := make(chan fakeMsg, 16), make(chan fakeMsg, 16)
	closed, once := make(chan struct{}), &sync.Once{}
	return &fakeConn{in: a, out: b, closed: closed, once: once, peerPID: pid},
		&fakeConn{in: b, out: a, closed: closed, once: once, peerPID: pid}
}

func (c *fakeConn) Send(env *frmpsv1.Envelope, fds []int) error {
	// Clone: the real transport serialises, so the receiver never shares memory.
	m := fakeMsg{env: proto.Clone(env).(*frmpsv1.Envelope), fds: append([]int(nil), fds...)}
	select {
	case <-c.closed:
		return io.ErrClosedPipe
	default:
	}
	select {
	case c.out <- m:
		return nil
	case <-c.closed:
		return io.ErrClosedPipe
	}
}

func (c *fakeConn) Recv() (*frmpsv1.Envelope, []int, error) {
	select {
	case m := <-c.in:
		return m.env, m.fds, nil
	default:
	}
	select {
	case m := <-c.in:
		return m.env, m.fds, nil
	case <-c.closed:
		return nil, nil, io.EOF
	}
}

func (c *fakeConn) Close() error { c.once.Do(func() { close(c.closed) }); return nil }

type dialReq struct {
	pid  int
	conn *fakeConn
}

type fakeListener struct {
	w      *fakeWorld
	path   string
	dials  chan dialReq
	closed chan struct{}
	once   sync.Once
}

func (l *fakeListener) Accept(ctx context.Context, pid int) (ControlConn, error) {
	for {
		select {
		case d := <-l.dials:
			if d.pid != pid {
				l.w.mu.Lock()
				l.w.refusedPeers++
				l.w.mu.Unlock()
				d.conn.Close()
				continue
			}
			return d.conn, nil
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-l.closed:
			return nil, errors.New("listener closed")
		}
	}
}

func (l *fakeListener) Close() error {
	l.once.Do(func() {
		close(l.closed)
		l.w.mu.Lock()
		delete(l.w.listeners, l.path)
		l.w.mu.Unlock()
	})
	return nil
}

// behavior scripts one fake engine.
type behavior struct {
	version       frmpsv1.ProtocolVersion // 0: version 1
	exitOnStart   bool                    // exits before connecting, with startExit (0: code 1)
	startExit     int
	startDelay    time.Duration // exitOnStart: after this long (an engine's imports, say)
	stderr        []string      // its last stderr lines (nil: one placeholder line)
	hang          bool          // connects, never says hello
	noConnect     bool          // never connects (e.g. still loading)
	resumeReply   func(*frmpsv1.Resume) *frmpsv1.Reply
	dieOnResume   bool
	intruderFirst bool // a process with another pid dials the socket first
	// heartbeat, when set, gives the Heartbeat to send every beatEvery
	// (0: a second) after Ready (nil: stop sending).
	heartbeat func(n int) *frmpsv1.Heartbeat
	// handoff answers a Handoff (nil: ok, the engine yields); dieOnHandoff
	// exits instead.
	handoff      func() *frmpsv1.Reply
	dieOnHandoff bool
	beatEvery    time.Duration
	readyAs      frmpsv1.Role // the Ready's role; 0: the launched one
	// sizedBlocks: the KV block count the engine reports in its Hello when
	// launched without --num-blocks (0: 64), as an engine that sizes its own
	// cache (the vLLM adapter) does; with --num-blocks it reports that.
	sizedBlocks uint64
	kvBudget    *frmpsv1.KVBudget // sent in its Hello
	ringRecord  uint64            // Hello.ring_record_bytes
}

type fakeProc struct {
	pid      int
	role     failover.Role
	inv      engine.Invocation
	env      []string
	logPath  string
	done     chan struct{}
	mu       sync.Mutex
	ws       syscall.WaitStatus
	conn     *fakeConn
	exited   bool
	resumes  []*frmpsv1.Resume
	sleep    *frmpsv1.Sleep
	sleepFD  []int
	welcome  *frmpsv1.Welcome
	gotShut  bool
	handoffs int
	kills    []string // "leader" (KillLeader), "group" (Kill), in call order
	stderr   []string
}

// inMPS: launched with the MPS client environment.
func (p *fakeProc) inMPS() bool {
	for _, e := range p.env {
		if e == "CUDA_MPS_PIPE_DIRECTORY=/fake/mps/pipe" {
			return true
		}
	}
	return false
}

func (p *fakeProc) PID() int              { return p.pid }
func (p *fakeProc) Done() <-chan struct{} { return p.done }
func (p *fakeProc) LastStderr() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.stderr != nil {
		return p.stderr
	}
	return []string{"fake engine stderr"}
}
func (p *fakeProc) LogPath() string   { return fmt.Sprintf("/fake/%d.log", p.pid) }
func (p *fakeProc) Kill() error       { return p.kill("group") }
func (p *fakeProc) KillLeader() error { return p.kill("leader") }

// kill records the fence and ends the fake (its leader is all there is of it).
func (p *fakeProc) kill(what string) error {
	p.mu.Lock()
	p.kills = append(p.kills, what)
	p.mu.Unlock()
	p.exit(syscall.WaitStatus(syscall.SIGKILL))
	return nil
}

func (p *fakeProc) killed() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.kills...)
}
func (p *fakeProc) WaitStatus() syscall.WaitStatus { p.mu.Lock(); defer p.mu.Unlock(); return p.ws }

func (p *fakeProc) alive() bool {
	select {
	case <-p.done:
		return false
	default:
		return true
	}
}

// exit ends the fake engine: its socket closes (the kernel would close it),
// then it is reaped.
func (p *fakeProc) exit(ws syscall.WaitStatus) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.exited {
		return
	}
	p.exited = true
	p.ws = ws
	if p.conn != nil {
		p.conn.Close()
	}
	close(p.done)
}

func exitCode(n int) syscall.WaitStatus { return syscall.WaitStatus(n << 8) }

// fakeWorld holds every fake of one test.
type fakeWorld struct {
	mu           sync.Mutex
	listeners    map[string]*fakeListener
	procs        []*fakeProc
	nextPID      int
	behave       func(role failover.Role, nth int) behavior
	launched     [2]int
	refusedPeers int
	launchErr    error
	// CheckComputeMode: what it was asked about, and its answer.
	computeModeChecks []string
	computeModeErr    error
	// runWait answers RunWait (nil: unknown).
	runWait func(pid int) map[int]time.Duration
	// PrimeFault: each call (device, env, engines launched before it) and its answer.
	primes   []primeCall
	primeErr error

	ring   *fakeRing
	rings  []*fakeRing // every ring created, in order
	broker []*fakeBroker
	mps    *fakeMPS
	front  *fakeFrontDoor
	spares *fakeSpares // nil: no SpareLauncher (spare_test.go)
}

type primeCall struct {
	device   int
	env      []string
	launched int
	at       time.Time
}

func newWorld() *fakeWorld {
	return &fakeWorld{
		listeners: map[string]*fakeListener{}, nextPID: 1000,
		behave: func(failover.Role, int) behavior { return behavior{} },
		mps:    &fakeMPS{}, front: &fakeFrontDoor{},
	}
}

var testPools = []*frmpsv1.Pool{{Tag: "weights", Index: 0, Size: 1 << 20, Backend: "host-shm"}, {Tag: "kv_cache", Index: 0, Size: 4 << 20, Backend: "host-shm"}}

// Fake fds: negative, so a stray close in the code under test hits nothing real.
var testFDs = []int{-101, -102}

func (w *fakeWorld) deps() Deps {
	d := w.baseDeps()
	if w.spares != nil {
		d.Spares = w.spares
	}
	return d
}

func (w *fakeWorld) baseDeps() Deps {
	return Deps{
		Launcher: w,
		Listen: func(path string) (ControlListener, error) {
			w.mu.Lock()
			defer w.mu.Unlock()
			if _, ok := w.listeners[path]; ok {
				return nil, fmt.Errorf("listen %s: address in use", path)
			}
			l := &fakeListener{w: w, path: path, dials: make(chan dialReq, 4), closed: make(chan struct{})}
			w.listeners[path] = l
			return l, nil
		},
		ValidateHello: func(h *frmpsv1.Hello, want HelloExpect) error {
			if v := h.GetProtocolVersion(); v != frmpsv1.ProtocolVersion_PROTOCOL_VERSION_1 {
				return fmt.Errorf("hello: protocol version mismatch: engine speaks %d, supervisor speaks 1", v)
			}
			if h.GetRole() != want.Role || int(h.GetPid()) != want.PID || h.GetModel() != want.Model {
				return fmt.Errorf("hello %v does not match %+v", h, want)
			}
			if want.Pools != nil && len(h.GetPools()) != len(want.Pools) {
				return errors.New("pool layout differs from the brokered one")
			}
			return nil
		},
		NewBroker: func() Broker {
			w.mu.Lock()
			defer w.mu.Unlock()
			b := &fakeBroker{}
			w.broker = append(w.broker, b)
			return b
		},
		OpenRing: func(path string, capacity uint64) (Ring, error) {
			f, err := os.OpenFile(path, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
			if err != nil {
				return nil, err
			}
			f.Close()
			w.ring = &fakeRing{path: path, capacity: capacity, snaps: map[uint64]*frmpsv1.RequestSnapshot{}}
			w.rings = append(w.rings, w.ring)
			return w.ring, nil
		},
		StartMPS: func(ctx context.Context, runDir string, _ hclog.Logger) (MPS, error) {
			if w.mps.startErr != nil {
				return nil, w.mps.startErr
			}
			return w.mps, nil
		},
		RunWait: func(pid int) (map[int]time.Duration, bool) {
			w.mu.Lock()
			f := w.runWait
			w.mu.Unlock()
			if f == nil {
				return nil, false
			}
			return f(pid), true
		},
		CheckComputeMode: func(ctx context.Context, visible string) error {
			w.mu.Lock()
			defer w.mu.Unlock()
			w.computeModeChecks = append(w.computeModeChecks, visible)
			return w.computeModeErr
		},
		PrimeFault: func(ctx context.Context, env []string, device int) (string, error) {
			w.mu.Lock()
			defer w.mu.Unlock()
			w.primes = append(w.primes, primeCall{device: device, env: env, launched: len(w.procs), at: time.Now()})
			if w.primeErr != nil {
				return "prime-fault: no CUDA driver library", w.primeErr
			}
			return "prime-fault: device 0: CUDA_ERROR_MISALIGNED_ADDRESS (716): the fault path is primed", nil
		},
		OutsideEnv: func(runDir string) ([]string, error) {
			return []string{"CUDA_MPS_PIPE_DIRECTORY=" + runDir + "/no-mps"}, nil
		},
		Classify: func(ws syscall.WaitStatus, lastStderr []string, f *frmpsv1.Fault) (string, string) {
			switch {
			case f != nil:
				return "fault_reported", f.GetCause()
			case ws.Signaled():
				return "signal", fmt.Sprintf("signal %d", int(ws.Signal()))
			}
			return "exit_code", fmt.Sprintf("exit code %d", ws.ExitStatus())
		},
		DialGeneration: func(endpoint string) (frmpsv1.GenerationClient, io.Closer, error) {
			return &fakeGen{endpoint: endpoint}, nopCloser{}, nil
		},
	}
}

type fakeGen struct {
	frmpsv1.GenerationClient // nil: calling anything but Health is a test bug
	endpoint                 string
}

func (g *fakeGen) Health(context.Context, *frmpsv1.HealthRequest, ...grpc.CallOption) (*frmpsv1.HealthResponse, error) {
	return &frmpsv1.HealthResponse{Serving: true, Model: "tiny", MaxModelLen: 2048}, nil
}

func (w *fakeWorld) Launch(role failover.Role, inv engine.Invocation, env []string, logPath string) (Process, error) {
	w.mu.Lock()
	if w.launchErr != nil {
		err := w.launchErr
		w.mu.Unlock()
		return nil, err
	}
	w.nextPID++
	pid := w.nextPID
	w.mu.Unlock()
	return w.spawn(&fakeProc{pid: pid, role: role, inv: inv, env: env, logPath: logPath, done: make(chan struct{})}), nil
}

// spawn runs p as the next engine of its role, with that launch's behaviour.
func (w *fakeWorld) spawn(p *fakeProc) *fakeProc {
	w.mu.Lock()
	w.procs = append(w.procs, p)
	b := w.behave(p.role, w.launched[p.role])
	w.launched[p.role]++
	w.mu.Unlock()
	p.mu.Lock()
	p.stderr = b.stderr
	p.mu.Unlock()
	go w.runEngine(p, b)
	return p
}

func (w *fakeWorld) dial(path string, pid int) (*fakeConn, error) {
	w.mu.Lock()
	l, ok := w.listeners[path]
	w.mu.Unlock()
	if !ok {
		return nil, fmt.Errorf("dial %s: no such socket", path)
	}
	server, client := fakePipe(pid)
	select {
	case l.dials <- dialReq{pid: pid, conn: server}:
		return client, nil
	case <-l.closed:
		return nil, errors.New("connection refused")
	}
}

// runEngine is the fake engine's main: the control protocol as the engine CLI
// speaks it.
func (w *fakeWorld) runEngine(p *fakeProc, b behavior) {
	if b.exitOnStart {
		if b.startDelay > 0 {
			select {
			case <-time.After(b.startDelay):
			case <-p.done:
				return
			}
		}
		p.exit(exitCode(cmp.Or(b.startExit, 1)))
		return
	}
	if b.noConnect {
		<-p.done
		return
	}
	if b.intruderFirst {
		if c, err := w.dial(p.inv.ControlSocket, 4242); err == nil {
			if _, _, err := c.Recv(); err == nil { // refused: closed without a word
				panic("intruder was spoken to")
			}
		}
	}
	conn, err := w.dial(p.inv.ControlSocket, p.pid)
	if err != nil {
		p.exit(exitCode(2))
		return
	}
	p.mu.Lock()
	if p.exited { // killed while dialling
		p.mu.Unlock()
		conn.Close()
		return
	}
	p.conn = conn
	p.mu.Unlock()
	if b.hang {
		<-p.done
		return
	}
	ver := b.version
	if ver == 0 {
		ver = frmpsv1.ProtocolVersion_PROTOCOL_VERSION_1
	}
	role := frmpsv1.Role_ROLE_ACTIVE
	if p.role == failover.Standby {
		role = frmpsv1.Role_ROLE_STANDBY
	}
	send := func(m proto.Message, fds []int) bool {
		env := &frmpsv1.Envelope{}
		switch m := m.(type) {
		case *frmpsv1.Hello:
			env.Msg = &frmpsv1.Envelope_Hello{Hello: m}
		case *frmpsv1.PoolExport:
			env.Msg = &frmpsv1.Envelope_PoolExport{PoolExport: m}
		case *frmpsv1.Ready:
			env.Msg = &frmpsv1.Envelope_Ready{Ready: m}
		}
		return conn.Send(env, fds) == nil
	}
	blocks := uint64(64)
	if p.inv.NumBlocks > 0 {
		blocks = uint64(p.inv.NumBlocks)
	} else if b.sizedBlocks > 0 {
		blocks = b.sizedBlocks
	}
	if !send(&frmpsv1.Hello{ProtocolVersion: ver, Role: role, Pid: int32(p.pid), Model: p.inv.Model, Engine: "fake",
		EngineVersion: "0.1", Device: "cpu", BlockSize: 16, NumBlocks: blocks, KvBudget: b.kvBudget, Weights: "loaded:/models/fake", RingRecordBytes: b.ringRecord,
		Pools: testPools, GenerationEndpoint: "unix://" + p.inv.GenerationSocket}, nil) {
		p.exit(exitCode(3))
		return
	}
	env, _, err := conn.Recv()
	if err != nil || !env.GetWelcome().GetAccepted() {
		p.mu.Lock()
		p.welcome = env.GetWelcome()
		p.mu.Unlock()
		p.exit(exitCode(1))
		return
	}
	p.mu.Lock()
	p.welcome = env.GetWelcome()
	p.mu.Unlock()
	if p.role == failover.Active {
		if !send(&frmpsv1.PoolExport{Pools: testPools}, testFDs) || !send(&frmpsv1.Ready{Role: cmp.Or(b.readyAs, role), InitNs: uint64(2 * time.Second)}, nil) {
			p.exit(exitCode(3))
			return
		}
	} else {
		env, fds, err := conn.Recv()
		if err != nil || env.GetSleep() == nil {
			p.exit(exitCode(4))
			return
		}
		p.mu.Lock()
		p.sleep, p.sleepFD = env.GetSleep(), fds
		p.mu.Unlock()
		if !send(&frmpsv1.Ready{Role: cmp.Or(b.readyAs, role), InitNs: uint64(2 * time.Second)}, nil) {
			p.exit(exitCode(3))
			return
		}
	}
	if b.heartbeat != nil {
		go func() {
			t := time.NewTicker(cmp.Or(b.beatEvery, time.Second))
			defer t.Stop()
			for n := 0; ; n++ {
				select {
				case <-p.done:
					return
				case <-t.C:
				}
				hb := b.heartbeat(n)
				if hb == nil {
					<-p.done
					return
				}
				if conn.Send(&frmpsv1.Envelope{Msg: &frmpsv1.Envelope_Heartbeat{Heartbeat: hb}}, nil) != nil {
					return
				}
			}
		}()
	}
	for {
		env, _, err := conn.Recv()
		if err != nil {
			p.exit(exitCode(0)) // supervisor went away
			return
		}
		switch m := env.GetMsg().(type) {
		case *frmpsv1.Envelope_Resume:
			p.mu.Lock()
			p.resumes = append(p.resumes, m.Resume)
			p.mu.Unlock()
			if b.dieOnResume {
				p.exit(syscall.WaitStatus(syscall.SIGSEGV))
				return
			}
			reply := &frmpsv1.Reply{Ok: true}
			for _, r := range m.Resume.GetRequests() {
				reply.Resumed = append(reply.Resumed, &frmpsv1.ResumeOutcome{Key: r.GetKey(), Ok: true})
			}
			if b.resumeReply != nil {
				reply = b.resumeReply(m.Resume)
			}
			if conn.Send(&frmpsv1.Envelope{Id: env.GetId(), Msg: &frmpsv1.Envelope_Reply{Reply: reply}}, nil) != nil {
				p.exit(exitCode(3))
				return
			}
		case *frmpsv1.Envelope_Handoff:
			p.mu.Lock()
			p.handoffs++
			p.mu.Unlock()
			if b.dieOnHandoff {
				p.exit(syscall.WaitStatus(syscall.SIGSEGV))
				return
			}
			reply := &frmpsv1.Reply{Ok: true}
			if b.handoff != nil {
				reply = b.handoff()
			}
			if conn.Send(&frmpsv1.Envelope{Id: env.GetId(), Msg: &frmpsv1.Envelope_Reply{Reply: reply}}, nil) != nil {
				p.exit(exitCode(3))
				return
			}
		case *frmpsv1.Envelope_Shutdown:
			p.mu.Lock()
			p.gotShut = true
			p.mu.Unlock()
			p.exit(exitCode(0))
			return
		}
	}
}

func (w *fakeWorld) live() []*fakeProc {
	w.mu.Lock()
	defer w.mu.Unlock()
	var out []*fakeProc
	for _, p := range w.procs {
		if p.alive() {
			out = append(out, p)
		}
	}
	return out
}

func (w *fakeWorld) liveRole(r failover.Role) *fakeProc {
	var found *fakeProc
	for _, p := range w.live() {
		if p.role == r {
			found = p
		}
	}
	return found
}

type fakeRing struct {
	mu       sync.Mutex
	path     string // where it was created
	capacity uint64
	snaps    map[uint64]*frmpsv1.RequestSnapshot
	polls    int
	pending  int // records committed, not yet consumed
	closed   bool
}

// Poll consumes up to 10 of the pending records per call.
func (r *fakeRing) Poll() (int, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.polls++
	n := min(r.pending, 10)
	r.pending -= n
	return n, nil
}
func (r *fakeRing) Lag() uint64     { r.mu.Lock(); defer r.mu.Unlock(); return uint64(r.pending) }
func (r *fakeRing) Resyncs() uint64 { return 0 }
func (r *fakeRing) Len() int        { r.mu.Lock(); defer r.mu.Unlock(); return len(r.snaps) }
func (r *fakeRing) Close() error    { r.mu.Lock(); defer r.mu.Unlock(); r.closed = true; return nil }
func (r *fakeRing) Snapshot(key uint64) (*frmpsv1.RequestSnapshot, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	s, ok := r.snaps[key]
	if !ok {
		return nil, false
	}
	return proto.Clone(s).(*frmpsv1.RequestSnapshot), true
}

type fakeBroker struct {
	mu     sync.Mutex
	pools  []*frmpsv1.Pool
	fds    []int
	closed bool
}

func (b *fakeBroker) Put(pools []*frmpsv1.Pool, fds []int) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.pools != nil {
		return errors.New("pools already brokered")
	}
	if len(pools) != len(fds) {
		return errors.New("pools and fds differ in number")
	}
	b.pools, b.fds = pools, fds
	return nil
}
func (b *fakeBroker) Pools() []*frmpsv1.Pool { b.mu.Lock(); defer b.mu.Unlock(); return b.pools }
func (b *fakeBroker) FDs() []int             { b.mu.Lock(); defer b.mu.Unlock(); return b.fds }
func (b *fakeBroker) Close() error           { b.mu.Lock(); defer b.mu.Unlock(); b.closed = true; return nil }

type fakeMPS struct {
	mu                   sync.Mutex
	startErr             error
	checkErr, restartErr error
	checks, restarts     int // restarts counts Recover calls
	stopped              bool
	shared               bool // the operator's daemon (Owned false)
	logDir               string
}

func (m *fakeMPS) LogDir() string { return m.logDir }

// recovers counts Recover calls (restarts of frmps's own daemon).
func (m *fakeMPS) recovers() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.restarts
}

func (m *fakeMPS) Check(context.Context) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.checks++
	return m.checkErr
}
func (m *fakeMPS) Owned() bool { return !m.shared }
func (m *fakeMPS) Recover(context.Context) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.restarts++
	return m.restartErr
}
func (m *fakeMPS) Stop(context.Context) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.stopped = true
	return nil
}
func (m *fakeMPS) ClientEnv() []string { return []string{"CUDA_MPS_PIPE_DIRECTORY=/fake/mps/pipe"} }

type fakeFrontDoor struct {
	mu   sync.Mutex
	open []*frmpsv1.ResumeRequest
}

func (f *fakeFrontDoor) OpenRequests() []*frmpsv1.ResumeRequest {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := make([]*frmpsv1.ResumeRequest, len(f.open))
	for i, r := range f.open {
		out[i] = proto.Clone(r).(*frmpsv1.ResumeRequest)
	}
	return out
}

// nopCloser: a generation connection with nothing to close.
type nopCloser struct{}

func (nopCloser) Close() error { return nil }
