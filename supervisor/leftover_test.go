package supervisor

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"go.uber.org/goleak"

	"github.com/frmps/frmps/supervisor/failover"
	"github.com/frmps/frmps/supervisor/leftover"
)

// helperEnv makes the test binary the supervisor process of
// TestKilledSupervisorLeavesNothingAfterRestart instead of running tests.
const helperEnv = "FRMPS_TEST_SUPERVISOR_HELPER"

func TestMain(m *testing.M) {
	if os.Getenv(helperEnv) != "" {
		os.Exit(supervisorHelper())
	}
	os.Exit(m.Run())
}

// supervisorHelper runs a supervisor over the fake engine with the default
// run dir (a fresh temp dir), prints "ready" once it serves with a standby,
// and runs until it is killed.
func supervisorHelper() int {
	cfg := Config{Model: "fake", Engine: "ref", NoMPS: true, StateDir: os.Getenv("FRMPS_TEST_STATE_DIR"),
		RingDir: os.Getenv("FRMPS_TEST_RING_DIR"), HandshakeTimeout: 20 * time.Second, BaseEnv: []string{"FAKEENGINE_BEHAVIOR=normal"}}
	s, err := newFakeEngineSupervisor(cfg, os.Getenv("FRMPS_TEST_FAKEENGINE"), hclog.New(&hclog.LoggerOptions{Level: hclog.Warn, Output: os.Stderr}))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	go func() {
		for s.Status().GetState() != "serving_ready" {
			time.Sleep(5 * time.Millisecond)
		}
		fmt.Println("ready")
	}()
	if err := s.Run(context.Background()); err != nil {
		fmt.Fprintln(os.Stderr, err)
	}
	return 1
}

// childrenOf lists the pids whose parent is pid.
func childrenOf(pid int) []int {
	var out []int
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "status"))
		if err != nil {
			continue
		}
		for _, line := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(line, "PPid:"); ok && strings.TrimSpace(v) == strconv.Itoa(pid) {
				n, _ := strconv.Atoi(e.Name())
				out = append(out, n)
			}
		}
	}
	return out
}

func readRecords(t *testing.T, dir string) map[string]leftover.Record {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]leftover.Record{}
	for _, e := range ents {
		b, err := os.ReadFile(filepath.Join(dir, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		var r leftover.Record
		if err := json.Unmarshal(b, &r); err != nil {
			t.Fatalf("%s: %v", e.Name(), err)
		}
		out[e.Name()] = r
	}
	return out
}

func exists(p string) bool {
	_, err := os.Lstat(p)
	return err == nil
}

// TestKilledSupervisorLeavesNothingAfterRestart SIGKILLs a real supervisor
// process (the test binary re-executed) serving with an active and a
// standby, checks what it leaves (ring, run dir with the engines' sockets,
// its launch record; its engines die with it), then starts a supervisor
// with the same state dir: nothing of the first remains.
func TestKilledSupervisorLeavesNothingAfterRestart(t *testing.T) {
	bin := buildFakeEngine(t)
	stateDir := filepath.Join(t.TempDir(), "state")
	ringDir := t.TempDir()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), helperEnv+"=1", "FRMPS_TEST_STATE_DIR="+stateDir, "FRMPS_TEST_RING_DIR="+ringDir, "FRMPS_TEST_FAKEENGINE="+bin)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	killed := false
	defer func() {
		if !killed {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
	}()
	ready := make(chan bool, 1)
	go func() {
		sc := bufio.NewScanner(out)
		ready <- sc.Scan() && sc.Text() == "ready"
		for sc.Scan() {
		}
	}()
	select {
	case ok := <-ready:
		if !ok {
			t.Fatalf("helper supervisor failed: %s", stderr.String())
		}
	case <-time.After(60 * time.Second):
		t.Fatalf("helper supervisor not ready after 60s: %s", stderr.String())
	}

	recs := readRecords(t, stateDir)
	if len(recs) != 1 {
		t.Fatalf("launch records %v, want one", recs)
	}
	var first leftover.Record
	for _, r := range recs {
		first = r
	}
	if first.Owner.PID != cmd.Process.Pid || !strings.HasPrefix(first.Ring, ringDir+"/frmps-") || first.RunDir == "" || first.PrivateMPS {
		t.Fatalf("launch record %+v (helper pid %d)", first, cmd.Process.Pid)
	}
	socks := socketFiles(t, first.RunDir)
	engines := childrenOf(cmd.Process.Pid)
	if !exists(first.Ring) || len(socks) != 4 || len(engines) != 2 {
		t.Fatalf("before the kill: ring %v, sockets %v, engines %v", exists(first.Ring), socks, engines)
	}

	if err := cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	_ = cmd.Wait()
	killed = true
	for _, pid := range engines { // parent-death signal
		for deadline := time.Now().Add(10 * time.Second); syscall.Kill(pid, 0) == nil; time.Sleep(10 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("engine %d outlived its supervisor by 10s", pid)
			}
		}
	}
	if !exists(first.Ring) || !exists(first.RunDir) || len(readRecords(t, stateDir)) != 1 {
		t.Fatal("the killed supervisor left nothing: the test does not test the cleanup")
	}

	t.Cleanup(func() { goleak.VerifyNone(t) })
	s, stop := realSupervisor(t, bin, []string{"FAKEENGINE_BEHAVIOR=normal"},
		failover.BreakerConfig{MaxRestarts: 3, Window: time.Minute, BaseBackoff: 10 * time.Millisecond, MaxBackoff: 100 * time.Millisecond},
		func(c *Config) { c.StateDir, c.RingDir = stateDir, ringDir })
	waitFor(t, s, "serving_ready", func() bool { return s.Status().GetState() == "serving_ready" })
	for _, p := range []string{first.Ring, first.RunDir} {
		if exists(p) {
			t.Errorf("%s of the killed supervisor is still there", p)
		}
	}
	recs = readRecords(t, stateDir)
	if len(recs) != 1 {
		t.Fatalf("launch records %v, want only the new supervisor's", recs)
	}
	var second leftover.Record
	for _, r := range recs {
		second = r
	}
	if second.Owner.PID != os.Getpid() || second.Ring == first.Ring {
		t.Fatalf("launch record %+v", second)
	}
	stop()
	if ents, _ := os.ReadDir(ringDir); len(ents) != 0 || len(readRecords(t, stateDir)) != 0 {
		t.Fatalf("after a clean stop: ring dir %v, records %v", ents, readRecords(t, stateDir))
	}
}
