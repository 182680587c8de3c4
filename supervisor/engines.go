package supervisor

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
	"github.com/frmps/frmps/supervisor/control"
	"github.com/frmps/frmps/supervisor/failover"
)

// One goroutine per engine process (runEngine): the handshake, then the
// control-socket reader until the socket closes. They own no loop state:
// they write their slot's mu-guarded fields, read the pair's broker and
// block count under its mu, and report to the loop through post.

// slot is one engine process and its control connection.
type slot struct {
	id        int
	role      failover.Role
	proc      Process
	listener  ControlListener
	started   time.Time
	inMPS     bool
	genSocket string
	ctlSocket string
	cancel    context.CancelFunc // ends the handshake / reader goroutine
	restartNo uint32
	fromSpare bool // launched from a spare (spare.go)

	mu         sync.Mutex // fields below are set by the engine goroutine
	conn       ControlConn
	hello      *frmpsv1.Hello
	fault      *frmpsv1.Fault
	state      string
	deathCause string // why it died; once reaped, with the classified exit
	refused    string // why the handshake refused this engine
	beats      beats  // what its Heartbeats said (hang.go)
	waiting    uint32 // queued requests, at the latest Heartbeat
	initTook   time.Duration

	// loop-owned
	dead bool
	// groupPending: died() fenced this engine's leader only (one rank); its
	// group is fenced once the step that took the death up has sent the Resume.
	groupPending bool
	deathClass   string // the class died() was given (a drill, a stall): no exit to classify
	gen          frmpsv1.GenerationClient
	genC         io.Closer
}

func (sl *slot) setState(st string) {
	sl.mu.Lock()
	sl.state = st
	sl.mu.Unlock()
}

// roleNow is the slot's role for goroutines other than the loop (the loop
// changes it at promotion).
func (sl *slot) roleNow() failover.Role {
	sl.mu.Lock()
	defer sl.mu.Unlock()
	return sl.role
}

func (sl *slot) getConn() ControlConn {
	sl.mu.Lock()
	defer sl.mu.Unlock()
	return sl.conn
}

// runEngine shakes hands with one engine, then reads its messages until the
// socket closes (= death).
func (p *pair) runEngine(ctx context.Context, sl *slot) {
	hctx, cancel := context.WithTimeout(ctx, p.cfg.HandshakeTimeout)
	conn, err := p.handshake(hctx, sl)
	cancel()
	if err != nil {
		if ctx.Err() == nil {
			p.post(event{kind: evDied, slot: sl, cause: err.Error(), at: time.Now()})
		}
		return
	}
	p.learnModelLimit(ctx, sl)
	p.post(event{kind: evReady, slot: sl, at: time.Now()})
	for {
		env, fds, err := conn.Recv()
		closeFDs(fds) // no message after the handshake carries fds to us
		if err != nil {
			now := time.Now()
			cause := "control socket closed"
			if !errors.Is(err, io.EOF) {
				cause = "control socket: " + err.Error()
			}
			p.post(event{kind: evDied, slot: sl, cause: cause, at: now})
			return
		}
		switch m := env.GetMsg().(type) {
		case *frmpsv1.Envelope_Reply:
			p.post(event{kind: evReply, slot: sl, id: env.GetId(), reply: m.Reply, at: time.Now()})
		case *frmpsv1.Envelope_Fault:
			now := time.Now()
			sl.mu.Lock()
			sl.fault = m.Fault
			sl.mu.Unlock()
			args := []any{"role", sl.roleNow(), "cause", m.Fault.GetCause(), "detail", m.Fault.GetDetail()}
			if t := m.Fault.GetUnixNanos(); t > 0 {
				args = append(args, "reported_after", now.Sub(time.Unix(0, int64(t))))
			}
			p.log.Warn("engine reports a fault", args...)
		case *frmpsv1.Envelope_Heartbeat:
			now, hb := time.Now(), m.Heartbeat
			sl.mu.Lock()
			b := &sl.beats
			// The step count is judged only while requests run: an idle engine (or
			// an asleep standby) may keep it for ever.
			if b.last.IsZero() || hb.GetStep() != b.step || b.running == 0 {
				b.stepSince = now
			}
			b.last, b.step, b.running = now, hb.GetStep(), hb.GetRunning()
			b.interval = time.Duration(hb.GetIntervalMs()) * time.Millisecond
			b.stepAge, b.expected = time.Duration(hb.GetStepAgeNs()), time.Duration(hb.GetStepExpectedNs())
			b.tokens = hb.GetStepTokens()
			sl.waiting = hb.GetWaiting()
			sl.mu.Unlock()
		default:
			p.log.Warn("unexpected control message", "role", sl.roleNow(), "type", fmt.Sprintf("%T", m))
		}
	}
}

func (p *pair) handshake(ctx context.Context, sl *slot) (ControlConn, error) {
	conn, err := sl.listener.Accept(ctx, sl.proc.PID())
	if err != nil {
		return nil, fmt.Errorf("accept control connection: %w", err)
	}
	sl.mu.Lock()
	sl.conn = conn
	sl.mu.Unlock()
	// Recv blocks without a deadline: end it when ctx ends.
	stop := context.AfterFunc(ctx, func() { _ = conn.Close() })
	defer stop()
	sl.setState("handshaking")
	env, fds, err := conn.Recv()
	closeFDs(fds)
	if err != nil {
		return nil, fmt.Errorf("read hello: %w", err)
	}
	hello := env.GetHello()
	if hello == nil {
		return nil, p.refuse(sl, conn, fmt.Sprintf("first message must be hello, got %T", env.GetMsg()))
	}
	sl.mu.Lock()
	sl.hello = hello
	sl.mu.Unlock()
	wantRole := frmpsv1.Role_ROLE_ACTIVE
	var pools []*frmpsv1.Pool
	if sl.role == failover.Standby {
		wantRole = frmpsv1.Role_ROLE_STANDBY
		pools = p.brokerPools()
	}
	// The protocol version, role, pid, model and pool layout (control.ValidateHello).
	if err := p.deps.ValidateHello(hello, HelloExpect{Role: wantRole, PID: sl.proc.PID(), Model: p.cfg.Model, Pools: pools}); err != nil {
		return nil, p.refuse(sl, conn, err.Error())
	}
	if sl.role == failover.Active {
		p.pinBlocks(hello.GetNumBlocks())
		if p.sizeRing != nil && !p.ringNamed.Load() {
			p.sizeRing(hello.GetRingRecordBytes())
		}
	}
	welcome := &frmpsv1.Welcome{Accepted: true, ProtocolVersion: control.ProtocolVersion,
		SyncEvery: p.cfg.SyncEvery, DeploymentId: p.deployID,
		HeartbeatIntervalMs: uint32(p.beat.Milliseconds())}
	if sl.role == failover.Active {
		welcome.RingPath = p.ringPath
		p.ringNamed.Store(true)
	}
	if err := conn.Send(&frmpsv1.Envelope{Msg: &frmpsv1.Envelope_Welcome{Welcome: welcome}}, nil); err != nil {
		return nil, fmt.Errorf("send welcome: %w", err)
	}
	if sl.role == failover.Standby {
		brokered, fds := p.brokerPools(), p.brokerFDs()
		if err := conn.Send(&frmpsv1.Envelope{Msg: &frmpsv1.Envelope_Sleep{Sleep: &frmpsv1.Sleep{Pools: brokered}}}, fds); err != nil {
			return nil, fmt.Errorf("send sleep: %w", err)
		}
	}
	for {
		env, fds, err := conn.Recv()
		if err != nil {
			closeFDs(fds)
			return nil, fmt.Errorf("handshake: %w", err)
		}
		switch m := env.GetMsg().(type) {
		case *frmpsv1.Envelope_PoolExport:
			if sl.role != failover.Active {
				closeFDs(fds)
				return nil, p.refuse(sl, conn, "pool export from a standby")
			}
			if err := p.brokerPut(m.PoolExport.GetPools(), fds); err != nil {
				return nil, p.refuse(sl, conn, "pool export: "+err.Error())
			}
		case *frmpsv1.Envelope_Ready:
			closeFDs(fds)
			if sl.role == failover.Active && len(p.brokerPools()) == 0 {
				return nil, p.refuse(sl, conn, "ready before exporting any pool")
			}
			if r := m.Ready.GetRole(); r != wantRole {
				return nil, p.refuse(sl, conn, fmt.Sprintf("ready as %s, launched as %s", r, wantRole))
			}
			sl.mu.Lock()
			sl.initTook = time.Duration(m.Ready.GetInitNs())
			sl.mu.Unlock()
			return conn, nil
		case *frmpsv1.Envelope_Fault:
			closeFDs(fds)
			return nil, fmt.Errorf("engine fault during start: %s: %s", m.Fault.GetCause(), m.Fault.GetDetail())
		default:
			closeFDs(fds)
		}
	}
}

// generationEndpoint is where a handshaken engine serves its generation API.
func (sl *slot) generationEndpoint() string {
	sl.mu.Lock()
	defer sl.mu.Unlock()
	if ep := sl.hello.GetGenerationEndpoint(); ep != "" {
		return ep
	}
	return "unix://" + sl.genSocket
}

// learnModelLimit asks a freshly handshaken active for its context limit
// before it is announced ready, so Model reports the real limit from the
// moment anything is served. Best effort: on failure the limit is asked
// again when the engine is published.
func (p *pair) learnModelLimit(ctx context.Context, sl *slot) {
	// An engine serving vLLM's API server (EngineCoreInput) has no generation API;
	// that server reads the engine's limit from its ready message.
	if p.limit.known() || p.cfg.EngineCoreInput != "" || sl.roleNow() != failover.Active {
		return
	}
	c, closer, err := p.deps.DialGeneration(sl.generationEndpoint())
	if err != nil {
		p.log.Debug("generation API for the context limit", "error", err)
		return
	}
	defer closer.Close()
	p.limit.learn(ctx, c, p.log)
}

// pinBlocks records the block count an active chose itself (no --num-blocks):
// every later engine is launched with it. A count given in the configuration,
// or one already pinned, stays.
func (p *pair) pinBlocks(n uint64) {
	if p.cfg.NumBlocks > 0 || n == 0 || n > math.MaxInt32 {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.numBlocks == 0 {
		p.numBlocks = int(n)
		p.log.Info("KV block count chosen by the active; every later engine gets it", "num_blocks", n)
	}
}

// launchBlocks is the --num-blocks of an engine launched now (0: none given).
func (p *pair) launchBlocks() int {
	if p.cfg.NumBlocks > 0 {
		return p.cfg.NumBlocks
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.numBlocks
}

// refuse answers a refused Welcome (best effort) and returns the reason.
func (p *pair) refuse(sl *slot, conn ControlConn, reason string) error {
	// Recorded before the Welcome goes out: the engine may exit, and its exit
	// be seen, before this goroutine reports the refusal.
	sl.mu.Lock()
	sl.refused = "hello refused: " + reason
	sl.mu.Unlock()
	_ = conn.Send(&frmpsv1.Envelope{Msg: &frmpsv1.Envelope_Welcome{Welcome: &frmpsv1.Welcome{
		Accepted: false, Reason: reason, ProtocolVersion: control.ProtocolVersion}}}, nil)
	return fmt.Errorf("hello refused: %s", reason)
}

// The broker is swapped only by the loop while no engine is handshaking
// (cold start; setup and cleanup, outside the loop); these readers run on
// engine goroutines.

// openBroker gives the pair its fd broker (setup).
func (p *pair) openBroker(b Broker) {
	p.mu.Lock()
	p.broker = b
	p.mu.Unlock()
}

// resetBroker replaces a broker that holds pools with a fresh one: a new
// active allocates fresh pools, so the old layout and fds go.
func (p *pair) resetBroker() {
	old := p.broker
	if old == nil || len(old.Pools()) == 0 {
		return
	}
	p.mu.Lock()
	p.broker = p.deps.NewBroker()
	p.mu.Unlock()
	if err := old.Close(); err != nil {
		p.log.Warn("close fd broker", "error", err)
	}
}

// closeBroker closes the broker (cleanup); idempotent.
func (p *pair) closeBroker() {
	p.mu.Lock()
	b := p.broker
	p.broker = nil
	p.mu.Unlock()
	if b != nil {
		if err := b.Close(); err != nil {
			p.log.Warn("close fd broker", "error", err)
		}
	}
}
func (p *pair) brokerPools() []*frmpsv1.Pool {
	p.mu.Lock()
	b := p.broker
	p.mu.Unlock()
	if b == nil {
		return nil
	}
	return b.Pools()
}

func (p *pair) brokerFDs() []int {
	p.mu.Lock()
	b := p.broker
	p.mu.Unlock()
	if b == nil {
		return nil
	}
	return b.FDs()
}

func (p *pair) brokerPut(pools []*frmpsv1.Pool, fds []int) error {
	p.mu.Lock()
	b := p.broker
	p.mu.Unlock()
	if b == nil {
		closeFDs(fds)
		return errors.New("broker closed")
	}
	return b.Put(pools, fds)
}

func closeFDs(fds []int) {
	for _, fd := range fds {
		_ = unix.Close(fd)
	}
}
