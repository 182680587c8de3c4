package mps

import (
	"context"
	"errors"
	"os"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
)

// TestRealDaemon runs the real nvidia-cuda-mps-control (GPU machines only):
// FRMPS_TEST_REAL_MPS=1 go test -run TestRealDaemon ./supervisor/mps
func TestRealDaemon(t *testing.T) {
	if os.Getenv("FRMPS_TEST_REAL_MPS") != "1" {
		t.Skip("set FRMPS_TEST_REAL_MPS=1 on a machine with NVIDIA MPS")
	}
	runDir := t.TempDir()
	ctx := context.Background()
	log := hclog.New(&hclog.LoggerOptions{Output: os.Stderr, Level: hclog.Debug})
	began := time.Now()
	d, err := Start(ctx, Config{RunDir: runDir, StartTimeout: 20 * time.Second}, log)
	if err != nil {
		t.Fatalf("Start: %v", err)
	}
	t.Logf("started in %s; daemon pid from pid file: %d", time.Since(began), d.daemonPID())
	ents, _ := os.ReadDir(d.pipeDir)
	for _, e := range ents {
		t.Logf("pipe dir entry: %s", e.Name())
	}
	if err := d.Check(ctx); err != nil {
		t.Fatalf("Check: %v", err)
	}
	began = time.Now()
	if err := d.Restart(ctx); err != nil {
		t.Fatalf("Restart: %v", err)
	}
	t.Logf("restarted in %s", time.Since(began))
	began = time.Now()
	if err := d.Stop(ctx); err != nil {
		t.Fatalf("Stop: %v", err)
	}
	t.Logf("stopped in %s", time.Since(began))
	began = time.Now()
	if err := d.Check(ctx); !errors.Is(err, ErrNotAnswering) {
		t.Fatalf("Check after Stop: %v", err)
	}
	t.Logf("check of a stopped daemon failed in %s", time.Since(began))
	checkNoProcessesIn(t, runDir)
}

// TestRealJoin joins a real daemon started apart (here by Start, standing in
// for the operator) and leaves it running (GPU machines only):
// FRMPS_TEST_REAL_MPS=1 go test -run TestRealJoin ./supervisor/mps
func TestRealJoin(t *testing.T) {
	if os.Getenv("FRMPS_TEST_REAL_MPS") != "1" {
		t.Skip("set FRMPS_TEST_REAL_MPS=1 on a machine with NVIDIA MPS")
	}
	runDir := t.TempDir()
	ctx := context.Background()
	op, err := Start(ctx, Config{RunDir: runDir, StartTimeout: 20 * time.Second}, nil)
	if err != nil {
		t.Fatalf("the operator's daemon: %v", err)
	}
	defer op.Stop(ctx)
	pid := op.daemonPID()
	s, err := Join(ctx, SharedConfig{PipeDir: op.PipeDir()}, hclog.New(&hclog.LoggerOptions{Output: os.Stderr}))
	if err != nil {
		t.Fatalf("Join: %v", err)
	}
	if err := s.Check(ctx); err != nil {
		t.Fatalf("Check: %v", err)
	}
	if err := s.Stop(ctx); err != nil || !alive(pid) || op.daemonPID() != pid {
		t.Fatalf("Stop: %v; daemon %d alive %v, pid file %d", err, pid, alive(pid), op.daemonPID())
	}
	gpus, err := QueryComputeModes(ctx, "")
	t.Logf("compute modes: %+v (%v)", gpus, err)
}
