package vllmfront

import (
	"context"
	"errors"
	"net"
	"os"
	"slices"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
)

// fakeFrontend is a TEST DOUBLE of the vLLM frontend's control service
// (frontend.proto): it returns a fixed resume set and counts the calls.
type fakeFrontend struct {
	frmpsv1.UnimplementedFrontendServer
	entries  []*frmpsv1.ResumeEntry
	lostErr  error
	lost     atomic.Int32
	back     atomic.Int32
	release  chan struct{} // EngineBack returns when closed
	gotDrain atomic.Uint32
	timeouts int32 // the first this many EngineBack calls answer DEADLINE_EXCEEDED
}

func (f *fakeFrontend) EngineLost(_ context.Context, r *frmpsv1.EngineLostRequest) (*frmpsv1.ResumeSet, error) {
	f.lost.Add(1)
	f.gotDrain.Store(r.GetDrainTimeoutMs())
	if f.lostErr != nil {
		return nil, f.lostErr
	}
	return &frmpsv1.ResumeSet{Entries: f.entries, HeldRequests: 1}, nil
}

func (f *fakeFrontend) EngineBack(ctx context.Context, _ *frmpsv1.EngineBackRequest) (*frmpsv1.EngineBackResponse, error) {
	if f.back.Add(1) <= f.timeouts {
		return nil, status.Error(codes.DeadlineExceeded, "no engine connected yet")
	}
	select {
	case <-f.release:
		return &frmpsv1.EngineBackResponse{SentHeld: 1}, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

func (f *fakeFrontend) FrontendHealth(context.Context, *frmpsv1.FrontendHealthRequest) (*frmpsv1.FrontendHealthResponse, error) {
	return &frmpsv1.FrontendHealthResponse{EngineConnected: true, OpenRequests: 2, VllmVersion: "0.26.0"}, nil
}

func newTestVllmFrontDoor(t *testing.T, argv []string) *FrontDoor {
	t.Helper()
	c := Config{Python: "python3", Env: []string{"PATH=" + os.Getenv("PATH"), "VLLM_SERVER_DEV_MODE=1"},
		Model: "/models/q", ServedModelName: "q", Port: 8000, APIKey: "k3y"}
	d, err := New(c, hclog.NewNullLogger())
	if err != nil {
		t.Fatal(err)
	}
	if argv != nil {
		d.argv = argv
	}
	return d
}

func serveFake(t *testing.T, d *FrontDoor, f *fakeFrontend) {
	t.Helper()
	l, err := net.Listen("unix", d.controlPath)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	frmpsv1.RegisterFrontendServer(srv, f)
	go func() { _ = srv.Serve(l) }()
	t.Cleanup(srv.Stop)
}

func TestVllmFrontDoorResumeSet(t *testing.T) {
	d := newTestVllmFrontDoor(t, nil)
	f := &fakeFrontend{release: make(chan struct{}), entries: []*frmpsv1.ResumeEntry{
		{Key: 7, EngineRequest: []byte{0x93, 1, 2}, DeliveredTokenIds: []uint32{5, 6}, Seed: 11},
		{Key: 9, EngineRequest: []byte{0x90}},
	}}
	serveFake(t, d, f)
	fi, err := os.Stat(d.dir)
	if err != nil || fi.Mode().Perm() != 0o700 {
		t.Fatalf("frontend dir %v mode %v, want 0700", err, fi.Mode())
	}

	// Status: the frontend's health is fetched in the background, never waited for.
	d.healthTTL = 0
	if fs := d.FrontendStatus(); fs.GetKind() != "vllm" || fs.GetEngineLost() != 0 {
		t.Fatalf("frontend status before anything %v", fs)
	}
	waitFor(t, func() bool { return d.FrontendStatus().GetState() == "serving" })
	if fs := d.FrontendStatus(); !fs.GetEngineConnected() || fs.GetOpenRequests() != 2 || fs.GetVllmVersion() != "0.26.0" {
		t.Fatalf("frontend status %v", fs)
	}

	reqs := d.OpenRequests()
	if fs := d.FrontendStatus(); fs.GetState() != "waiting_engine" || fs.GetEngineLost() != 1 {
		t.Fatalf("frontend status after a loss %v, want waiting_engine, 1 loss", fs)
	}
	if len(reqs) != 2 || reqs[0].GetKey() != 7 || string(reqs[0].GetEngineRequest()) != "\x93\x01\x02" ||
		!slices.Equal(reqs[0].GetDeliveredTokenIds(), []uint32{5, 6}) || reqs[1].GetKey() != 9 {
		t.Fatalf("resume set %v", reqs)
	}
	if reqs[0].GetPrompt() != "" || reqs[0].GetParams() != nil {
		t.Fatalf("a frontend entry carries only the engine request: %v", reqs[0])
	}
	if f.gotDrain.Load() == 0 {
		t.Fatal("EngineLost sent no drain bound")
	}
	// A second loss before the engine is back (the promoted engine died too):
	// the set is asked again, one EngineBack call covers both.
	if got := d.OpenRequests(); len(got) != 2 {
		t.Fatalf("second resume set %v", got)
	}
	waitFor(t, func() bool { return f.back.Load() == 1 })
	time.Sleep(50 * time.Millisecond)
	if n := f.back.Load(); n != 1 {
		t.Fatalf("EngineBack called %d times, want 1 in flight", n)
	}
	close(f.release)
	waitFor(t, func() bool { d.mu.Lock(); defer d.mu.Unlock(); return !d.backing })
	if fs := d.FrontendStatus(); fs.GetState() != "serving" || fs.GetEngineLost() != 2 || fs.GetEngineBack() != 1 || fs.GetLastError() != "" {
		t.Fatalf("frontend status after the engine came back %v", fs)
	}
	// After the engine came back, the next loss waits for the next engine.
	d.OpenRequests()
	waitFor(t, func() bool { return f.back.Load() == 2 })
	if err := d.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(d.dir); !os.IsNotExist(err) {
		t.Fatalf("frontend dir left behind: %v", err)
	}
}

func TestVllmFrontDoorWaitsUntilEngineBack(t *testing.T) {
	d := newTestVllmFrontDoor(t, nil)
	f := &fakeFrontend{release: make(chan struct{}), timeouts: 2}
	close(f.release)
	serveFake(t, d, f)
	d.OpenRequests()
	// Two rounds time out (no engine yet), the third sees it connect.
	waitFor(t, func() bool { d.mu.Lock(); defer d.mu.Unlock(); return !d.backing })
	if n := f.back.Load(); n != 3 {
		t.Fatalf("EngineBack called %d times, want 3 (two rounds timed out)", n)
	}
	if err := d.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
}

// The supervisor polls the frontend's health from the start, while vLLM still
// imports (seconds; more on a loaded machine) and the control socket does not
// exist yet: each failed dial lengthens the client's reconnect backoff. A
// failover once the frontend listens must still get its resume set, not the
// stale dial error of a connection in backoff.
func TestVllmFrontDoorReachesAFrontendThatStartedLate(t *testing.T) {
	d := newTestVllmFrontDoor(t, nil)
	d.healthTTL = 0
	for deadline := time.Now().Add(3 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		d.FrontendStatus()
	}
	f := &fakeFrontend{release: make(chan struct{}), entries: []*frmpsv1.ResumeEntry{{Key: 3, EngineRequest: []byte{0x90}}}}
	close(f.release)
	serveFake(t, d, f)
	if reqs := d.OpenRequests(); len(reqs) != 1 || reqs[0].GetKey() != 3 {
		t.Fatalf("resume set %v from a frontend that listens now, want key 3; last error %q", reqs, d.FrontendStatus().GetLastError())
	}
	if err := d.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
}

func TestVllmFrontDoorLostFails(t *testing.T) {
	d := newTestVllmFrontDoor(t, nil)
	f := &fakeFrontend{release: make(chan struct{}), lostErr: errors.New("drain failed")}
	serveFake(t, d, f)
	if reqs := d.OpenRequests(); reqs != nil {
		t.Fatalf("resume set %v on error, want none", reqs)
	}
	if fs := d.FrontendStatus(); fs.GetEngineLost() != 0 || !strings.Contains(fs.GetLastError(), "drain failed") {
		t.Fatalf("frontend status after a failed EngineLost %v", fs)
	}
	// Still waits for the next engine (the frontend holds new requests until one connects).
	waitFor(t, func() bool { return f.back.Load() == 1 })
	// Shutdown ends the EngineBack call in flight and returns.
	done := make(chan error, 1)
	go func() { done <- d.Shutdown(context.Background()) }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Shutdown hung on an EngineBack call")
	}
}

func TestVllmFrontDoorProcess(t *testing.T) {
	// The frontend process is a stand-in (sh), so the test checks the
	// lifecycle only: started, stopped by Shutdown with its group, reaped.
	d := newTestVllmFrontDoor(t, []string{"/bin/sh", "-c", "sleep 60 & wait"})
	served := make(chan error, 1)
	go func() { served <- d.Serve(nil) }()
	waitFor(t, func() bool { d.mu.Lock(); defer d.mu.Unlock(); return d.cmd != nil })
	d.mu.Lock()
	pid := d.cmd.Process.Pid
	d.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := d.Shutdown(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-served; err != nil {
		t.Fatalf("Serve after Shutdown: %v, want nil", err)
	}
	// (Its orphaned child is reaped by init, asynchronously.)
	waitFor(t, func() bool { return groupGone(pid) == nil })

	// An unexpected exit is an error that names it.
	d2 := newTestVllmFrontDoor(t, []string{"/bin/sh", "-c", "exit 3"})
	err := d2.Serve(nil)
	if err == nil || !strings.Contains(err.Error(), "exit status 3") {
		t.Fatalf("Serve of a frontend that exits: %v", err)
	}
	if fs := d2.FrontendStatus(); fs.GetState() != "exited" || fs.GetPid() <= 0 || fs.GetEngineConnected() {
		t.Fatalf("status of a frontend that exited: %v", fs)
	}
	if err := d2.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
}

func TestVllmFrontDoorCommandAndEnv(t *testing.T) {
	d := newTestVllmFrontDoor(t, nil)
	defer d.Shutdown(context.Background())
	argv := strings.Join(d.argv, " ")
	for _, want := range []string{"-m frmps_engine.cli frontend", "--engine-input " + d.inputAddr, "--control-socket " + d.controlPath,
		"--control-socket " + d.controlPath + " /models/q --port 8000 --served-model-name q"} {
		if !strings.Contains(argv, want) {
			t.Errorf("frontend argv %q lacks %q", argv, want)
		}
	}
	if strings.Contains(argv, "k3y") {
		t.Error("the API key is on the frontend's command line")
	}
	env := strings.Join(d.env, "\n")
	if strings.Contains(env, "VLLM_SERVER_DEV_MODE") || !strings.Contains(env, "VLLM_API_KEY=k3y") || !strings.Contains(env, "CUDA_MPS_PIPE_DIRECTORY="+d.dir) {
		t.Errorf("frontend env:\n%s", env)
	}
	if in, out := d.EngineCoreAddrs(); !strings.HasPrefix(in, "ipc://"+d.dir+"/") || !strings.HasPrefix(out, "ipc://"+d.dir+"/") {
		t.Errorf("engine-core addresses %s %s outside %s", in, out, d.dir)
	}
}

// groupGone is nil once no process of the group pgid exists.
func groupGone(pgid int) error {
	if err := syscall.Kill(-pgid, 0); errors.Is(err, syscall.ESRCH) {
		return nil
	}
	return errors.New("group still has processes")
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition not reached in 5 s")
		}
		time.Sleep(5 * time.Millisecond)
	}
}
