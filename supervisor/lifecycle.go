package supervisor

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/frmps/frmps/supervisor/leftover"
)

// Run's setup and cleanup: what a deployment acquires before the event loop
// starts (run dir, launch record, ring, broker, MPS) and releases after it
// ends. Runs on Run's goroutine, outside the loop.

func (s *Supervisor) setup(ctx context.Context) error {
	if s.cfg.Device == "cuda" && s.deps.CheckComputeMode != nil {
		if err := s.deps.CheckComputeMode(ctx, envValue(s.cfg.BaseEnv, "CUDA_VISIBLE_DEVICES")); err != nil {
			return fmt.Errorf("check the GPU: %w", err)
		}
	}
	if s.cfg.StateDir != "" {
		d, err := leftover.OpenDir(s.cfg.StateDir)
		if err != nil {
			return err
		}
		s.cleanLeftovers(ctx, d)
		s.stateDir = d
	}
	runDir := s.cfg.RunDir
	if runDir == "" {
		d, err := os.MkdirTemp("", "frmps-")
		if err != nil {
			return fmt.Errorf("create run dir: %w", err)
		}
		runDir = d
	} else if err := os.Mkdir(runDir, 0o700); err != nil {
		return fmt.Errorf("create run dir (is another frmps using it?): %w", err)
	}
	s.runDir = runDir
	if err := os.Chmod(runDir, 0o700); err != nil { // MkdirTemp is 0700, Mkdir obeys umask
		return fmt.Errorf("chmod run dir: %w", err)
	}
	s.logDir = s.cfg.LogDir
	if s.logDir == "" {
		s.logDir = filepath.Join(runDir, "logs")
	}
	if err := os.MkdirAll(s.logDir, 0o700); err != nil {
		return fmt.Errorf("create engine log dir: %w", err)
	}
	ringDir := s.cfg.RingDir
	if ringDir == "" {
		ringDir = runDir
		if fi, err := os.Stat("/dev/shm"); err == nil && fi.IsDir() {
			ringDir = "/dev/shm"
		}
	}
	s.ring.path = filepath.Join(ringDir, "frmps-"+s.deployID+".ring")
	if err := s.writeLaunchRecord(); err != nil {
		s.ring.path = "" // not created
		return err
	}
	ring, err := s.deps.OpenRing(s.ring.path, s.cfg.RingCapacity)
	if err != nil {
		s.ring.path = "" // not ours to remove
		return fmt.Errorf("open ring: %w", err)
	}
	s.ring.open(ring, s.cfg.RingCapacity)
	s.pair.runDir, s.pair.logDir, s.pair.ringPath = s.runDir, s.logDir, s.ring.path
	if !s.cfg.RingFixed {
		s.pair.sizeRing = func(recordBytes uint64) { s.ring.fit(s.deps.OpenRing, recordBytes, RingGrowMax) }
	}
	s.pair.openBroker(s.deps.NewBroker())
	if !s.cfg.NoMPS {
		mps, err := s.deps.StartMPS(ctx, runDir, s.log.Named("mps"))
		if err != nil {
			return fmt.Errorf("start MPS (use --no-mps to run without): %w", err)
		}
		s.mps.d = mps
		if mps.Owned() {
			s.mps.setState("running")
			if s.cfg.PrimeFaultPath {
				s.primeFaultPath(ctx)
			}
		} else {
			s.mps.setState("joined the operator's daemon at " + s.cfg.MPSPipeDir)
		}
	}
	return nil
}

// primeFaultPath faults once on each GPU of the deployment inside frmps's own
// MPS daemon, before any engine joins it (Config.PrimeFaultPath). A fault ends
// the MPS server, which serves every GPU of the daemon; the daemon starts a new
// one for the next client, which a client joining at once may find not ready,
// so each run waits primeSettle after the one before it and a failed run is
// tried once more. A GPU that could not be primed is logged and serves as
// usual: its first fault is slow.
func (s *Supervisor) primeFaultPath(ctx context.Context) {
	if s.deps.PrimeFault == nil {
		s.log.Warn("fault-path priming is not available here; the first fault on each GPU will be slow")
		return
	}
	settle := func() bool {
		select {
		case <-time.After(primeSettle):
			return true
		case <-ctx.Done():
			return false
		}
	}
	env := append(s.engineEnv(), s.mps.clientEnv()...)
	primed := 0
	for dev := 0; dev < max(1, s.cfg.TensorParallelSize); dev++ {
		for try := 1; try <= 2; try++ {
			if (dev > 0 || try > 1) && !settle() {
				return
			}
			t0 := time.Now()
			out, err := s.deps.PrimeFault(ctx, env, dev)
			if err == nil {
				primed++
				s.log.Info("fault path primed", "device", dev, "took", time.Since(t0).Round(time.Millisecond), "output", out)
				break
			}
			if try == 2 {
				s.log.Warn("fault path not primed: the first fault on this GPU will be slow", "device", dev, "error", err, "output", out)
			}
		}
	}
	s.metrics.primed(primed)
	if primed > 0 {
		s.mps.setState(fmt.Sprintf("running (fault path primed on %d GPU(s))", primed))
	}
	settle() // the first engine joins a daemon whose faulted server has gone
}

// primeSettle: the pause after a prime-fault run before the next client joins
// the daemon (a client joining 2 s after a fault was admitted on the H200s).
const primeSettle = 2 * time.Second

// envValue is key's value in env (the last one wins, as for exec); "" if unset.
func envValue(env []string, key string) string {
	v := ""
	for _, kv := range env {
		if k, val, ok := strings.Cut(kv, "="); ok && k == key {
			v = val
		}
	}
	return v
}

// cleanup releases what setup acquired; idempotent.
func (s *Supervisor) cleanup() {
	s.mps.stop()
	cleaned := s.ring.close() // the launch record goes only once what it names is gone
	s.pair.closeBroker()
	if s.runDir != "" {
		if err := os.RemoveAll(s.runDir); err != nil {
			s.log.Warn("remove run dir", "error", err)
			cleaned = false
		}
		s.runDir = ""
	}
	if s.stateDir != nil && cleaned {
		if err := s.stateDir.Remove(s.deployID); err != nil {
			s.log.Warn("remove launch record", "error", err)
		}
		s.stateDir = nil
	}
}

// cleanLeftovers removes what supervisors that died without their cleanup
// left (their ring, run dir and private MPS daemon). Failures are logged:
// they do not stop this deployment, and the record stays for a later try.
func (s *Supervisor) cleanLeftovers(ctx context.Context, d *leftover.Dir) {
	stale, err := d.Stale()
	if err != nil {
		s.log.Warn("launch records", "dir", d.Path(), "error", err)
	}
	for _, st := range stale {
		r := st.Record
		if err := leftover.Clean(ctx, r, s.deps.StopLeftoverMPS); err != nil {
			s.log.Warn("clean up after a dead supervisor", "pid", r.Owner.PID, "why", st.Why, "record", st.Name, "error", err)
			continue
		}
		if err := d.Remove(st.Name); err != nil {
			s.log.Warn("clean up after a dead supervisor", "pid", r.Owner.PID, "error", err)
			continue
		}
		s.log.Warn("cleaned up after a supervisor that died without doing so", "pid", r.Owner.PID, "why", st.Why, "ring", r.Ring, "run_dir", r.RunDir)
	}
}

// writeLaunchRecord records this supervisor and what it creates outside
// its process, before the ring and the MPS daemon exist (the run dir is
// already ours: created exclusively).
func (s *Supervisor) writeLaunchRecord() error {
	if s.stateDir == nil {
		return nil
	}
	self, err := leftover.Self()
	if err != nil {
		return fmt.Errorf("launch record: %w", err)
	}
	r := leftover.Record{Owner: self, Written: time.Now(), Ring: s.ring.path, RunDir: s.runDir}
	if !s.cfg.NoMPS && s.cfg.MPSPipeDir == "" { // an operator's daemon is never ours to stop
		r.PrivateMPS, r.MPSControl = true, s.cfg.MPSControlBinary
	}
	return s.stateDir.Write(s.deployID, r)
}
