package control

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/frmps/frmps/internal/testenv"
	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
)

// TestPythonPeerInterop runs a Python peer built from the generated
// messages (testdata/py_peer.py) against the Go side: frames and pool fds
// travel Python→Go (PoolExport) and Go→Python (Sleep).
// FRMPS_PYTHON names an interpreter with protobuf installed; without it the
// test is skipped, or fails in CI.
func TestPythonPeerInterop(t *testing.T) {
	python := os.Getenv("FRMPS_PYTHON")
	if python == "" {
		testenv.Missing(t, "no Python peer: set FRMPS_PYTHON to a Python with protobuf to run the interop test")
	}
	src, err := filepath.Abs("../../vllmpatch/src")
	if err != nil {
		t.Fatal(err)
	}
	l, err := Listen(filepath.Join(privateDir(t), "py.sock"))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	cmd := exec.Command(python, "testdata/py_peer.py", l.Path())
	cmd.Env = append(os.Environ(), "PYTHONPATH="+src)
	var stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stderr, &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	exited := make(chan error, 1)
	go func() {
		exited <- cmd.Wait()
		cancel() // a peer that died early must not leave Accept waiting
	}()
	defer func() {
		select {
		case err := <-exited:
			if err != nil {
				t.Errorf("python peer: %v\n%s", err, stderr.String())
			}
		case <-time.After(30 * time.Second):
			cmd.Process.Kill()
			<-exited
			t.Errorf("python peer did not exit\n%s", stderr.String())
		}
	}()
	c, err := l.Accept(ctx, cmd.Process.Pid)
	if err != nil {
		t.Fatalf("Accept: %v", err)
	}
	defer c.Close()
	c.SetReadDeadline(time.Now().Add(60 * time.Second))

	env, _, err := c.Recv()
	if err != nil {
		t.Fatalf("Recv Hello: %v", err)
	}
	if err := ValidateHello(env.GetHello(), HelloExpect{Role: frmpsv1.Role_ROLE_ACTIVE, PID: cmd.Process.Pid, Model: "py-peer"}); err != nil {
		t.Fatalf("Hello: %v", err)
	}
	if err := c.Send(&frmpsv1.Envelope{Msg: &frmpsv1.Envelope_Welcome{Welcome: &frmpsv1.Welcome{Accepted: true, ProtocolVersion: ProtocolVersion}}}, nil); err != nil {
		t.Fatal(err)
	}
	env, fds, err := c.Recv()
	if err != nil || env.GetPoolExport() == nil || len(fds) != 1 {
		t.Fatalf("PoolExport: %v %v %v", env, fds, err)
	}
	b := NewBroker()
	defer b.Close()
	if err := b.Put(env.GetPoolExport().GetPools(), fds); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 11)
	unix.Pread(b.FDs()[0], got, 0)
	if string(got) != "from python" {
		t.Fatalf("pool from python reads %q", got)
	}
	unix.Pwrite(b.FDs()[0], []byte("go wrote this"), 100)
	sleep, sfds, _ := b.SleepMessage(42)
	if err := c.Send(sleep, sfds); err != nil {
		t.Fatal(err)
	}
	env, _, err = c.Recv()
	if err != nil || env.GetId() != 42 || !env.GetReply().GetOk() {
		t.Fatalf("python's reply to Sleep: %v %v", env, err)
	}
}
