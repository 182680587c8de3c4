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
// control-socket reader until the socket closes. They own no Supervisor
// state: they write their slot's mu-guarded fields and report to the loop
// through post.

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
func (s *Supervisor) runEngine(ctx context.Context, sl *slot) {
	hctx, cancel := context.WithTimeout(ctx, s.cfg.HandshakeTimeout)
	conn, err := s.handshake(hctx, sl)
	cancel()
	if err != nil {
		if ctx.Err() == nil {
			s.post(event{kind: evDied, slot: sl, cause: err.Error(), at: time.Now()})
		}
		return
	}
	s.learnModelLimit(ctx, sl)
	s.post(event{kind: evReady, slot: sl, at: time.Now()})
	for {
		env, fds, err := conn.Recv()
		closeFDs(fds) // no message after the handshake carries fds to us
		if err != nil {
			now := time.Now()
			cause := "control socket closed"
			if !errors.Is(err, io.EOF) {
				cause = "control socket: " + err.Error()
			}
			s.post(event{kind: evDied, slot: sl, cause: cause, at: now})
			return
		}
		switch m := env.GetMsg().(type) {
		case *frmpsv1.Envelope_Reply:
			s.post(event{kind: evReply, slot: sl, id: env.GetId(), reply: m.Reply, at: time.Now()})
		case *frmpsv1.Envelope_Fault:
			now := time.Now()
			sl.mu.Lock()
			sl.fault = m.Fault
			sl.mu.Unlock()
			args := []any{"role", sl.roleNow(), "cause", m.Fault.GetCause(), "detail", m.Fault.GetDetail()}
			if t := m.Fault.GetUnixNanos(); t > 0 {
				args = append(args, "reported_after", now.Sub(time.Unix(0, int64(t))))
			}
			s.log.Warn("engine reports a fault", args...)
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
			s.log.Warn("unexpected control message", "role", sl.roleNow(), "type", fmt.Sprintf("%T", m))
		}
	}
}

func (s *Supervisor) handshake(ctx context.Context, sl *slot) (ControlConn, error) {
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
		return nil, s.refuse(sl, conn, fmt.Sprintf("first message must be hello, got %T", env.GetMsg()))
	}
	sl.mu.Lock()
	sl.hello = hello
	sl.mu.Unlock()
	wantRole := frmpsv1.Role_ROLE_ACTIVE
	var pools []*frmpsv1.Pool
	if sl.role == failover.Standby {
		wantRole = frmpsv1.Role_ROLE_STANDBY
		pools = s.brokerPools()
	}
	// The protocol version, role, pid, model and pool layout (control.ValidateHello).
	if err := s.deps.ValidateHello(hello, HelloExpect{Role: wantRole, PID: sl.proc.PID(), Model: s.cfg.Model, Pools: pools}); err != nil {
		return nil, s.refuse(sl, conn, err.Error())
	}
	if sl.role == failover.Active {
		s.pinBlocks(hello.GetNumBlocks())
	}
	welcome := &frmpsv1.Welcome{Accepted: true, ProtocolVersion: control.ProtocolVersion,
		SyncEvery: s.cfg.SyncEvery, DeploymentId: s.deployID,
		HeartbeatIntervalMs: uint32(s.hang.policy.beatInterval().Milliseconds())}
	if sl.role == failover.Active {
		welcome.RingPath = s.ring.path
	}
	if err := conn.Send(&frmpsv1.Envelope{Msg: &frmpsv1.Envelope_Welcome{Welcome: welcome}}, nil); err != nil {
		return nil, fmt.Errorf("send welcome: %w", err)
	}
	if sl.role == failover.Standby {
		brokered, fds := s.brokerPools(), s.brokerFDs()
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
				return nil, s.refuse(sl, conn, "pool export from a standby")
			}
			if err := s.brokerPut(m.PoolExport.GetPools(), fds); err != nil {
				return nil, s.refuse(sl, conn, "pool export: "+err.Error())
			}
		case *frmpsv1.Envelope_Ready:
			closeFDs(fds)
			if sl.role == failover.Active && len(s.brokerPools()) == 0 {
				return nil, s.refuse(sl, conn, "ready before exporting any pool")
			}
			if r := m.Ready.GetRole(); r != wantRole {
				return nil, s.refuse(sl, conn, fmt.Sprintf("ready as %s, launched as %s", r, wantRole))
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

// pinBlocks records the block count an active chose itself (no --num-blocks):
// every later engine is launched with it. A count given in the configuration,
// or one already pinned, stays.
func (s *Supervisor) pinBlocks(n uint64) {
	if s.cfg.NumBlocks > 0 || n == 0 || n > math.MaxInt32 {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.numBlocks == 0 {
		s.numBlocks = int(n)
		s.log.Info("KV block count chosen by the active; every later engine gets it", "num_blocks", n)
	}
}

// launchBlocks is the --num-blocks of an engine launched now (0: none given).
func (s *Supervisor) launchBlocks() int {
	if s.cfg.NumBlocks > 0 {
		return s.cfg.NumBlocks
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.numBlocks
}

// refuse answers a refused Welcome (best effort) and returns the reason.
func (s *Supervisor) refuse(sl *slot, conn ControlConn, reason string) error {
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
// (cold start); these readers run on engine goroutines.
func (s *Supervisor) brokerPools() []*frmpsv1.Pool {
	s.mu.Lock()
	b := s.broker
	s.mu.Unlock()
	if b == nil {
		return nil
	}
	return b.Pools()
}

func (s *Supervisor) brokerFDs() []int {
	s.mu.Lock()
	b := s.broker
	s.mu.Unlock()
	if b == nil {
		return nil
	}
	return b.FDs()
}

func (s *Supervisor) brokerPut(pools []*frmpsv1.Pool, fds []int) error {
	s.mu.Lock()
	b := s.broker
	s.mu.Unlock()
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
