package supervisor

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"syscall"
	"time"

	"github.com/frmps/frmps/supervisor/engine"
	"github.com/frmps/frmps/supervisor/failover"
)

// Launching engines: the pair's side (a slot, its listener, its process, a
// delayed start). Runs on the loop goroutine; the engine's own goroutine
// (engines.go) takes over once the process is started.

// cancelStart drops a pending delayed start of role.
func (p *pair) cancelStart(role failover.Role) {
	if t := p.startAfter[role]; t != nil {
		t.Stop()
		p.startAfter[role] = nil
	}
	p.wantStart[role] = false
}

// stopStarts stops every delayed start's timer (shutdown).
func (p *pair) stopStarts() {
	for r := range p.startAfter {
		if t := p.startAfter[r]; t != nil {
			t.Stop()
		}
	}
}

// startLater arms a start of role after delay (evStartDue, startDue).
func (p *pair) startLater(role failover.Role, delay time.Duration) {
	p.startSeq[role]++
	seq := p.startSeq[role]
	p.startAfter[role] = time.AfterFunc(delay, func() { p.post(event{kind: evStartDue, role: role, id: seq, at: time.Now()}) })
}

// startDue takes a delayed start's event: true when it is the start armed
// now (not one cancelled after it fired), which it then disarms.
func (p *pair) startDue(ev event) bool {
	if t := p.startAfter[ev.role]; t == nil || ev.id != p.startSeq[ev.role] {
		return false
	}
	p.startAfter[ev.role] = nil
	return true
}

// waitForMPS defers a start of role until the MPS check in progress ends.
func (p *pair) waitForMPS(role failover.Role) { p.wantStart[role] = true }

// waiting returns the roles whose start waited for the MPS check, and
// forgets them.
func (p *pair) waiting() []failover.Role {
	var out []failover.Role
	for _, r := range []failover.Role{failover.Active, failover.Standby} {
		if p.wantStart[r] {
			p.wantStart[r] = false
			out = append(out, r)
		}
	}
	return out
}

// start launches a new engine for role, inside MPS or not, with the
// environment env gives. A failure to launch is a death.
func (p *pair) start(role failover.Role, inMPS bool, env func() ([]string, error)) {
	if role == failover.Active {
		p.resetBroker() // a cold start: the new active allocates fresh pools
	}
	p.nextID++
	id := p.nextID
	inv := p.invocation(role, id)
	sl := &slot{id: id, role: role, started: time.Now(), state: "starting", inMPS: inMPS, genSocket: inv.GenerationSocket, ctlSocket: inv.ControlSocket}
	sl.restartNo = p.metrics.started(role)
	fail := func(err error) {
		sl.proc = deadProcess{}
		sl.listener = nopListener{}
		sl.cancel = func() {}
		p.set(role, sl)
		p.enqueue(event{kind: evDied, slot: sl, cause: "launch failed: " + err.Error(), at: time.Now()})
	}
	envv, err := env()
	if err != nil {
		fail(err)
		return
	}
	l, err := p.deps.Listen(inv.ControlSocket)
	if err != nil {
		fail(fmt.Errorf("listen on control socket: %w", err))
		return
	}
	logPath := filepath.Join(p.logDir, fmt.Sprintf("%s-%d.log", role, id))
	proc, fromSpare := p.spares.launch(role, inv, envv, logPath)
	if !fromSpare {
		if proc, err = p.deps.Launcher.Launch(role, inv, envv, logPath); err != nil {
			_ = l.Close()
			fail(err)
			return
		}
	}
	p.metrics.launched(fromSpare)
	sl.fromSpare = fromSpare
	ctx, cancel := context.WithCancel(context.Background())
	sl.proc, sl.listener, sl.cancel = proc, l, cancel
	p.set(role, sl)
	p.slots[sl] = struct{}{}
	p.log.Info("engine launched", "role", role, "pid", proc.PID(), "log", proc.LogPath(), "in_mps", sl.inMPS, "from_spare", fromSpare)
	p.wg.Add(2)
	go func() {
		defer p.wg.Done()
		select {
		case <-proc.Done():
			p.post(event{kind: evDied, slot: sl, cause: "process exited: " + describeExit(proc.WaitStatus()), at: time.Now()})
		case <-p.stopped:
		}
	}()
	go func() {
		defer p.wg.Done()
		p.runEngine(ctx, sl)
	}()
}

// spareLogPath names the next spare's log (spares and engines share the ids).
func (p *pair) spareLogPath() string {
	p.nextID++
	return filepath.Join(p.logDir, fmt.Sprintf("spare-%d.log", p.nextID))
}

// dialGeneration prepares the client of a ready engine's generation API
// (lazily connected), so promoting it later costs nothing.
func (p *pair) dialGeneration(sl *slot) error {
	sl.mu.Lock()
	endpoint := sl.hello.GetGenerationEndpoint()
	sl.mu.Unlock()
	if endpoint == "" {
		endpoint = "unix://" + sl.genSocket
	}
	c, closer, err := p.deps.DialGeneration(endpoint)
	if err != nil {
		return fmt.Errorf("generation API %s: %w", endpoint, err)
	}
	sl.gen, sl.genC = c, closer
	return nil
}

// describeExit names how a process ended (an engine, a spare).
func describeExit(ws syscall.WaitStatus) string {
	switch {
	case ws.Signaled():
		return fmt.Sprintf("killed by signal %d", int(ws.Signal()))
	case ws.Exited():
		return fmt.Sprintf("exit code %d", ws.ExitStatus())
	}
	return "unknown status"
}

// deadProcess stands in for an engine that never started.
type deadProcess struct{}

func (deadProcess) PID() int                       { return 0 }
func (deadProcess) Done() <-chan struct{}          { return closedCh }
func (deadProcess) WaitStatus() syscall.WaitStatus { return 0 }
func (deadProcess) LastStderr() []string           { return nil }
func (deadProcess) Kill() error                    { return nil }
func (deadProcess) KillLeader() error              { return nil }
func (deadProcess) LogPath() string                { return "" }

type nopListener struct{}

func (nopListener) Accept(context.Context, int) (ControlConn, error) {
	return nil, errors.New("no listener")
}

func (nopListener) Close() error { return nil }

func (p *pair) invocation(role failover.Role, id int) engine.Invocation {
	r := engine.RoleActive
	if role == failover.Standby {
		r = engine.RoleStandby
	}
	c := p.cfg
	return engine.Invocation{
		Role:                 r,
		Model:                c.Model,
		ControlSocket:        filepath.Join(p.runDir, fmt.Sprintf("ctl-%d.sock", id)),
		GenerationSocket:     filepath.Join(p.runDir, fmt.Sprintf("gen-%d.sock", id)),
		Memory:               c.Memory,
		Device:               c.Device,
		NumBlocks:            p.launchBlocks(),
		MaxModelLen:          c.MaxModelLen,
		GPUMemoryUtilization: c.GPUMemoryUtilization,
		TensorParallelSize:   c.TensorParallelSize,
		ExtraArgs:            c.EngineArgs,
		CoreInput:            c.EngineCoreInput,
		CoreOutput:           c.EngineCoreOutput,
	}
}

var closedCh = func() chan struct{} { c := make(chan struct{}); close(c); return c }()
