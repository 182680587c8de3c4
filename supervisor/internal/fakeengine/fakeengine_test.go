package fakeengine

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"
	"golang.org/x/sys/unix"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
	"github.com/frmps/frmps/supervisor/control"
	"github.com/frmps/frmps/supervisor/deathcause"
)

// binary is the fake engine command, built once for the process tests.
var binary string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "fakeengine-bin")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	binary, err = BuildBinary(ctx, dir)
	cancel()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.RemoveAll(dir)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "goroutine leak:", err)
			code = 1
		}
	}
	os.Exit(code)
}

func openFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents) - 1
}

func listen(t *testing.T) *control.Listener {
	t.Helper()
	dir, err := os.MkdirTemp("", "fe")
	if err != nil {
		t.Fatal(err)
	}
	os.Chmod(dir, 0o700)
	l, err := control.Listen(filepath.Join(dir, "c.sock"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close(); os.RemoveAll(dir) })
	return l
}

// recv reads one message with a deadline so a broken fake fails the test
// instead of hanging it.
func recv(t *testing.T, c *control.Conn) (*frmpsv1.Envelope, []int) {
	t.Helper()
	c.SetReadDeadline(time.Now().Add(20 * time.Second))
	env, fds, err := c.Recv()
	if err != nil {
		t.Fatalf("Recv: %v", err)
	}
	return env, fds
}

func send(t *testing.T, c *control.Conn, env *frmpsv1.Envelope, fds []int) {
	t.Helper()
	if err := c.Send(env, fds); err != nil {
		t.Fatalf("Send: %v", err)
	}
}

func welcome(accepted bool, reason string) *frmpsv1.Envelope {
	return &frmpsv1.Envelope{Msg: &frmpsv1.Envelope_Welcome{Welcome: &frmpsv1.Welcome{
		Accepted: accepted, Reason: reason, ProtocolVersion: control.ProtocolVersion, SyncEvery: 16,
	}}}
}

func accept(t *testing.T, l *control.Listener, pid int) *control.Conn {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, err := l.Accept(ctx, pid)
	if err != nil {
		t.Fatalf("Accept: %v", err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// handshake plays the supervisor's part up to Ready for an active, and
// returns the exported pool fds (owned by the broker).
func handshakeActive(t *testing.T, c *control.Conn, b *control.Broker, pid int) {
	t.Helper()
	env, _ := recv(t, c)
	if err := control.ValidateHello(env.GetHello(), control.HelloExpect{Role: frmpsv1.Role_ROLE_ACTIVE, PID: pid, Model: "fake"}); err != nil {
		t.Fatalf("active Hello: %v", err)
	}
	send(t, c, welcome(true, ""), nil)
	env, fds := recv(t, c)
	if env.GetPoolExport() == nil {
		t.Fatalf("expected PoolExport, got %s", control.MessageName(env))
	}
	if err := b.Put(env.GetPoolExport().GetPools(), fds); err != nil {
		t.Fatalf("broker Put: %v", err)
	}
	env, _ = recv(t, c)
	if env.GetReady().GetRole() != frmpsv1.Role_ROLE_ACTIVE {
		t.Fatalf("expected Ready, got %v", env)
	}
}

func handshakeStandby(t *testing.T, c *control.Conn, b *control.Broker, pid int) {
	t.Helper()
	env, _ := recv(t, c)
	if err := control.ValidateHello(env.GetHello(), control.HelloExpect{Role: frmpsv1.Role_ROLE_STANDBY, PID: pid, Pools: b.Pools()}); err != nil {
		t.Fatalf("standby Hello: %v", err)
	}
	send(t, c, welcome(true, ""), nil)
	sleep, fds, ok := b.SleepMessage(5)
	if !ok {
		t.Fatal("broker has no pools")
	}
	send(t, c, sleep, fds)
	env, _ = recv(t, c)
	if env.GetReady().GetRole() != frmpsv1.Role_ROLE_STANDBY || env.GetId() != 5 {
		t.Fatalf("expected Ready to Sleep 5, got %v", env)
	}
}

func resume() *frmpsv1.Envelope {
	return &frmpsv1.Envelope{Id: 9, Msg: &frmpsv1.Envelope_Resume{Resume: &frmpsv1.Resume{Requests: []*frmpsv1.ResumeRequest{
		{Key: 1, PromptTokenIds: []uint32{1, 2, 3}, DeliveredTokenIds: []uint32{4, 5},
			Snapshot: &frmpsv1.RequestSnapshot{TokenIds: []uint32{1, 2, 3, 4}, NumComputedTokens: 4}},
		{Key: 2, PromptTokenIds: []uint32{7, 8}},
	}}}}
}

// In-process: an active and a standby fake engine go through the whole
// protocol against a minimal supervisor side written with package control.
func TestInProcessActiveThenStandbyTakeover(t *testing.T) {
	l := listen(t)
	before := openFDs(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	b := control.NewBroker()
	defer b.Close()

	activeDone := make(chan error, 1)
	go func() {
		activeDone <- Run(ctx, Config{Role: frmpsv1.Role_ROLE_ACTIVE, Socket: l.Path(), Model: "fake"})
	}()
	active := accept(t, l, os.Getpid())
	handshakeActive(t, active, b, os.Getpid())
	// The fds the broker holds reach the active's memory.
	for i, fd := range b.FDs() {
		want := Marker(b.Pools()[i])
		got := make([]byte, len(want))
		unix.Pread(fd, got, 0)
		if !bytes.Equal(got, want) {
			t.Fatalf("pool %d reads %q, want %q", i, got, want)
		}
	}
	send(t, active, &frmpsv1.Envelope{Id: 3, Msg: &frmpsv1.Envelope_Ping{Ping: &frmpsv1.Ping{}}}, nil)
	if env, _ := recv(t, active); !env.GetReply().GetOk() || env.GetId() != 3 {
		t.Fatalf("Ping reply %v", env)
	}

	standbyDone := make(chan error, 1)
	go func() {
		standbyDone <- Run(ctx, Config{Role: frmpsv1.Role_ROLE_STANDBY, Socket: l.Path(), Model: "fake", CheckMarkers: true})
	}()
	standby := accept(t, l, os.Getpid())
	handshakeStandby(t, standby, b, os.Getpid())

	// The active goes away; the standby takes over.
	send(t, active, &frmpsv1.Envelope{Id: 4, Msg: &frmpsv1.Envelope_Shutdown{Shutdown: &frmpsv1.Shutdown{}}}, nil)
	if env, _ := recv(t, active); !env.GetReply().GetOk() {
		t.Fatalf("Shutdown reply %v", env)
	}
	if err := <-activeDone; err != nil {
		t.Fatalf("active after Shutdown: %v", err)
	}
	if _, _, err := active.Recv(); err != io.EOF {
		t.Fatalf("active's socket after exit: %v, want EOF", err)
	}

	send(t, standby, resume(), nil)
	env, _ := recv(t, standby)
	r := env.GetReply()
	if !r.GetOk() || env.GetId() != 9 || len(r.GetResumed()) != 2 {
		t.Fatalf("Resume reply %v", env)
	}
	if o := r.GetResumed()[0]; o.GetKey() != 1 || !o.GetOk() || o.GetReusedTokens() != 4 || o.GetPrefilledTokens() != 1 {
		t.Fatalf("request 1 outcome %v", o)
	}
	if o := r.GetResumed()[1]; o.GetKey() != 2 || o.GetReusedTokens() != 0 || o.GetPrefilledTokens() != 2 {
		t.Fatalf("request 2 outcome %v", o)
	}
	// A second Resume is refused: it is the active now.
	send(t, standby, resume(), nil)
	if env, _ := recv(t, standby); env.GetReply().GetOk() {
		t.Fatal("second Resume accepted")
	}
	send(t, standby, &frmpsv1.Envelope{Id: 10, Msg: &frmpsv1.Envelope_Shutdown{Shutdown: &frmpsv1.Shutdown{}}}, nil)
	recv(t, standby)
	if err := <-standbyDone; err != nil {
		t.Fatalf("standby after Shutdown: %v", err)
	}
	active.Close()
	standby.Close()
	b.Close()
	if after := openFDs(t); after != before {
		t.Fatalf("fd leak: %d before, %d after", before, after)
	}
}

func TestInProcessStandbyRefusesWrongPools(t *testing.T) {
	l := listen(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	done := make(chan error, 1)
	go func() {
		done <- Run(ctx, Config{Role: frmpsv1.Role_ROLE_STANDBY, Socket: l.Path(), CheckMarkers: true})
	}()
	c := accept(t, l, os.Getpid())
	recv(t, c)
	send(t, c, welcome(true, ""), nil)
	// Right layout, but memory that no active wrote: the markers are missing.
	b := control.NewBroker()
	defer b.Close()
	var fds []int
	for _, p := range DefaultPools() {
		fd, _ := unix.MemfdCreate("p", unix.MFD_CLOEXEC)
		unix.Ftruncate(fd, int64(p.GetSize()))
		fds = append(fds, fd)
	}
	if err := b.Put(DefaultPools(), fds); err != nil {
		t.Fatal(err)
	}
	sleep, sfds, _ := b.SleepMessage(1)
	send(t, c, sleep, sfds)
	env, _ := recv(t, c)
	if env.GetReply().GetOk() || !strings.Contains(env.GetReply().GetError(), "not the active's memory") {
		t.Fatalf("reply %v, want a marker refusal", env)
	}
	if err := <-done; err == nil || !strings.Contains(err.Error(), "marker") {
		t.Fatalf("Run: %v", err)
	}
}

func TestInProcessBehaviours(t *testing.T) {
	t.Run("wrong version is refused", func(t *testing.T) {
		l := listen(t)
		done := make(chan error, 1)
		go func() {
			done <- Run(context.Background(), Config{Role: frmpsv1.Role_ROLE_ACTIVE, Socket: l.Path(), Behavior: WrongVersion})
		}()
		c := accept(t, l, os.Getpid())
		env, _ := recv(t, c)
		err := control.ValidateHello(env.GetHello(), control.HelloExpect{Role: frmpsv1.Role_ROLE_ACTIVE})
		if !errors.Is(err, control.ErrVersionMismatch) || !strings.Contains(err.Error(), "engine speaks 99") {
			t.Fatalf("ValidateHello: %v", err)
		}
		send(t, c, welcome(false, err.Error()), nil)
		if err := <-done; !errors.Is(err, ErrRefused) {
			t.Fatalf("Run: %v", err)
		}
	})
	t.Run("garbage", func(t *testing.T) {
		l := listen(t)
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- Run(ctx, Config{Role: frmpsv1.Role_ROLE_ACTIVE, Socket: l.Path(), Behavior: Garbage}) }()
		c := accept(t, l, os.Getpid())
		c.SetReadDeadline(time.Now().Add(20 * time.Second))
		if _, _, err := c.Recv(); !errors.Is(err, control.ErrProtocol) {
			t.Fatalf("Recv of garbage: %v", err)
		}
		c.Close()
		if err := <-done; err != nil {
			t.Fatalf("garbage engine after hang-up: %v", err)
		}
		cancel()
	})
	t.Run("hang until cancelled", func(t *testing.T) {
		l := listen(t)
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- Run(ctx, Config{Role: frmpsv1.Role_ROLE_ACTIVE, Socket: l.Path(), Behavior: Hang}) }()
		c := accept(t, l, os.Getpid())
		recv(t, c)
		send(t, c, welcome(true, ""), nil)
		c.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
		if _, _, err := c.Recv(); err == nil || !strings.Contains(err.Error(), "timeout") {
			t.Fatalf("a hung engine said something: %v", err)
		}
		cancel()
		if err := <-done; !errors.Is(err, context.Canceled) {
			t.Fatalf("Run: %v", err)
		}
	})
	t.Run("heartbeats while serving", func(t *testing.T) {
		l := listen(t)
		done := make(chan error, 1)
		go func() {
			done <- Run(context.Background(), Config{Role: frmpsv1.Role_ROLE_ACTIVE, Socket: l.Path(), HeartbeatEvery: time.Millisecond})
		}()
		c := accept(t, l, os.Getpid())
		b := control.NewBroker()
		defer b.Close()
		handshakeActive(t, c, b, 0)
		for want := uint64(1); want <= 3; want++ {
			env, _ := recv(t, c)
			if env.GetHeartbeat().GetStep() != want {
				t.Fatalf("got %v, want heartbeat %d", env, want)
			}
		}
		send(t, c, &frmpsv1.Envelope{Id: 2, Msg: &frmpsv1.Envelope_Shutdown{Shutdown: &frmpsv1.Shutdown{}}}, nil)
		if err := <-done; err != nil {
			t.Fatalf("Run: %v", err)
		}
	})
	t.Run("fault", func(t *testing.T) {
		l := listen(t)
		var stderr bytes.Buffer
		done := make(chan error, 1)
		go func() {
			done <- Run(context.Background(), Config{Role: frmpsv1.Role_ROLE_ACTIVE, Socket: l.Path(), Behavior: Fault, Stderr: &stderr})
		}()
		c := accept(t, l, os.Getpid())
		b := control.NewBroker()
		defer b.Close()
		handshakeActive(t, c, b, 0)
		env, _ := recv(t, c)
		if env.GetFault().GetCause() != "misaligned address" {
			t.Fatalf("expected a Fault, got %v", env)
		}
		var exit *ExitError
		if err := <-done; !errors.As(err, &exit) || exit.Code != 1 {
			t.Fatalf("Run: %v", err)
		}
		if !strings.Contains(stderr.String(), FaultLine) {
			t.Fatalf("stderr %q", stderr.String())
		}
	})
}

// startProcess launches the fake engine binary as a real child.
func startProcess(t *testing.T, args ...string) (*exec.Cmd, *bytes.Buffer) {
	t.Helper()
	cmd := exec.Command(binary, args...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		cmd.Wait()
	})
	return cmd, &stderr
}

// waitExit waits for the child with a bound and returns its wait status.
func waitExit(t *testing.T, cmd *exec.Cmd) syscall.WaitStatus {
	t.Helper()
	done := make(chan struct{})
	go func() { cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		<-done
		t.Fatal("fake engine did not exit")
	}
	return cmd.ProcessState.Sys().(syscall.WaitStatus)
}

// As a real child process: the active exports pools and dies by SIGKILL
// (socket EOF); a standby process maps the brokered fds and takes over.
func TestProcessKillActiveStandbyResumes(t *testing.T) {
	l := listen(t)
	b := control.NewBroker()
	defer b.Close()

	active, _ := startProcess(t, "serve", "-role", "active", "-control-socket", l.Path(), "-model", "fake", "--engine", "ref")
	ac := accept(t, l, active.Process.Pid)
	if ac.PeerPID() != active.Process.Pid {
		t.Fatalf("peer pid %d", ac.PeerPID())
	}
	handshakeActive(t, ac, b, active.Process.Pid)

	standby, _ := startProcess(t, "-role", "standby", "-control-socket", l.Path())
	sc := accept(t, l, standby.Process.Pid)
	handshakeStandby(t, sc, b, standby.Process.Pid)

	syscall.Kill(active.Process.Pid, syscall.SIGKILL)
	ac.SetReadDeadline(time.Now().Add(20 * time.Second))
	if _, _, err := ac.Recv(); err != io.EOF {
		t.Fatalf("dead active's socket: %v, want EOF", err)
	}
	ws := waitExit(t, active)
	if c := deathcause.Classify(ws, nil, nil); c.Class != deathcause.Signal || !strings.Contains(c.Detail, "signal 9") {
		t.Fatalf("death cause %s", c)
	}
	// The memory outlived its writer: the broker's fds still read the markers.
	for i, fd := range b.FDs() {
		want := Marker(b.Pools()[i])
		got := make([]byte, len(want))
		unix.Pread(fd, got, 0)
		if !bytes.Equal(got, want) {
			t.Fatalf("pool %d after the active died: %q", i, got)
		}
	}
	send(t, sc, resume(), nil)
	env, _ := recv(t, sc)
	if !env.GetReply().GetOk() || len(env.GetReply().GetResumed()) != 2 {
		t.Fatalf("Resume reply %v", env)
	}
	send(t, sc, &frmpsv1.Envelope{Id: 11, Msg: &frmpsv1.Envelope_Shutdown{Shutdown: &frmpsv1.Shutdown{}}}, nil)
	recv(t, sc)
	if ws := waitExit(t, standby); ws.ExitStatus() != 0 || ws.Signaled() {
		t.Fatalf("standby exit %v", ws)
	}
}

func TestProcessStandbyDiesDuringTakeover(t *testing.T) {
	l := listen(t)
	b := control.NewBroker()
	defer b.Close()
	active, _ := startProcess(t, "-role", "active", "-control-socket", l.Path())
	ac := accept(t, l, active.Process.Pid)
	handshakeActive(t, ac, b, active.Process.Pid)

	t.Setenv("FAKEENGINE_BEHAVIOR", string(DieDuringTakeover))
	standby, _ := startProcess(t, "-role", "standby", "-control-socket", l.Path())
	sc := accept(t, l, standby.Process.Pid)
	handshakeStandby(t, sc, b, standby.Process.Pid)
	send(t, sc, resume(), nil)
	sc.SetReadDeadline(time.Now().Add(20 * time.Second))
	if _, _, err := sc.Recv(); err != io.EOF {
		t.Fatalf("standby's socket during takeover: %v, want EOF", err)
	}
	if ws := waitExit(t, standby); !ws.Signaled() || ws.Signal() != syscall.SIGKILL {
		t.Fatalf("standby wait status %v, want SIGKILL", ws)
	}
}

func TestProcessWrongPeerRefused(t *testing.T) {
	l := listen(t)
	// The launched process hands the connection to its own child: not the
	// pid the supervisor launched, so SO_PEERCRED refuses it.
	parent, _ := startProcess(t, "-role", "active", "-control-socket", l.Path(), "-connect-from", "child")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var refused []control.Peer
	l.OnRefuse(func(p control.Peer, _ error) { refused = append(refused, p); cancel() })
	c, err := l.Accept(ctx, parent.Process.Pid)
	if err == nil {
		c.Close()
		t.Fatal("accepted the child of the launched process")
	}
	if len(refused) != 1 || refused[0].PID == parent.Process.Pid || refused[0].PID <= 0 {
		t.Fatalf("refused %v (launched pid %d)", refused, parent.Process.Pid)
	}
	// The refused engine sees its connection closed and fails; its parent
	// reports the failure.
	if ws := waitExit(t, parent); ws.ExitStatus() == 0 {
		t.Fatalf("launched process exit %v", ws)
	}
}

func TestProcessMisbehaviours(t *testing.T) {
	t.Run("wrong version exits 2 after refusal", func(t *testing.T) {
		l := listen(t)
		p, stderr := startProcess(t, "-role", "standby", "-control-socket", l.Path(), "-behavior", "wrong-version")
		c := accept(t, l, p.Process.Pid)
		env, _ := recv(t, c)
		err := control.ValidateHello(env.GetHello(), control.HelloExpect{Role: frmpsv1.Role_ROLE_STANDBY, PID: p.Process.Pid})
		if !errors.Is(err, control.ErrVersionMismatch) {
			t.Fatalf("ValidateHello: %v", err)
		}
		send(t, c, welcome(false, err.Error()), nil)
		if ws := waitExit(t, p); ws.ExitStatus() != 2 {
			t.Fatalf("exit %v", ws)
		}
		if !strings.Contains(stderr.String(), "supervisor speaks PROTOCOL_VERSION_1") {
			t.Fatalf("stderr %q", stderr)
		}
	})
	t.Run("wrong hello pid", func(t *testing.T) {
		l := listen(t)
		p, _ := startProcess(t, "-role", "active", "-control-socket", l.Path(), "-hello-pid", "wrong")
		c := accept(t, l, p.Process.Pid)
		env, _ := recv(t, c)
		err := control.ValidateHello(env.GetHello(), control.HelloExpect{Role: frmpsv1.Role_ROLE_ACTIVE, PID: p.Process.Pid})
		if err == nil || !strings.Contains(err.Error(), fmt.Sprintf("pid %d", p.Process.Pid+1)) {
			t.Fatalf("ValidateHello: %v", err)
		}
	})
	t.Run("hang ignores SIGTERM", func(t *testing.T) {
		l := listen(t)
		p, _ := startProcess(t, "-role", "active", "-control-socket", l.Path(), "-behavior", "hang")
		c := accept(t, l, p.Process.Pid)
		recv(t, c)
		send(t, c, welcome(true, ""), nil)
		syscall.Kill(p.Process.Pid, syscall.SIGTERM)
		c.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
		if _, _, err := c.Recv(); err == nil || !strings.Contains(err.Error(), "timeout") {
			t.Fatalf("hung engine: %v, want silence", err)
		}
		syscall.Kill(p.Process.Pid, syscall.SIGKILL)
		if ws := waitExit(t, p); ws.Signal() != syscall.SIGKILL {
			t.Fatalf("hung engine ended by %v, not our SIGKILL", ws)
		}
	})
	t.Run("fault is classified", func(t *testing.T) {
		l := listen(t)
		p, stderr := startProcess(t, "-role", "active", "-control-socket", l.Path(), "-behavior", "fault")
		c := accept(t, l, p.Process.Pid)
		b := control.NewBroker()
		defer b.Close()
		handshakeActive(t, c, b, p.Process.Pid)
		env, _ := recv(t, c)
		ws := waitExit(t, p)
		cause := deathcause.Classify(ws, strings.Split(stderr.String(), "\n"), env.GetFault())
		if cause.Class != deathcause.MisalignedAddress {
			t.Fatalf("cause %s", cause)
		}
	})
	t.Run("garbage", func(t *testing.T) {
		l := listen(t)
		p, _ := startProcess(t, "-role", "active", "-control-socket", l.Path(), "-behavior", "garbage")
		c := accept(t, l, p.Process.Pid)
		c.SetReadDeadline(time.Now().Add(20 * time.Second))
		if _, _, err := c.Recv(); !errors.Is(err, control.ErrProtocol) {
			t.Fatalf("Recv: %v", err)
		}
		c.Close()
		if ws := waitExit(t, p); ws.ExitStatus() != 0 {
			t.Fatalf("exit %v", ws)
		}
	})
	t.Run("bad flags", func(t *testing.T) {
		for _, args := range [][]string{{"-role", "leader"}, {"-behavior", "explode"}, {"-pools", "weights:x:1"}, {"-hello-pid", "abc"}} {
			p, _ := startProcess(t, args...)
			if ws := waitExit(t, p); ws.ExitStatus() != 2 {
				t.Fatalf("%v: exit %v, want 2", args, ws)
			}
		}
	})
}
