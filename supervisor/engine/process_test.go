package engine

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"go.uber.org/goleak"
)

// TestHelperProcess is not a test: it is the fake engine child (a test
// double), re-executed from the test binary with FRMPS_HELPER set.
func TestHelperProcess(t *testing.T) {
	mode := os.Getenv("FRMPS_HELPER")
	if mode == "" {
		return
	}
	switch mode {
	case "lines":
		fmt.Println("INFO 01-02 12:00:00 engine started")
		fmt.Fprintln(os.Stderr, "WARNING:frmps_engine:pool is small")
		fmt.Fprintln(os.Stderr, "2026-01-01T00:00:00Z [ERROR] boom")
		fmt.Fprintln(os.Stderr, "plain stderr line")
		for i := range 60 {
			fmt.Fprintf(os.Stderr, "tail %d\n", i)
		}
		fmt.Fprint(os.Stderr, "no newline at end")
		os.Exit(3)
	case "grandchild":
		// Start a grandchild in our group that would outlive us, print its
		// pid, then block.
		c := exec.Command(os.Args[0], "-test.run=^TestHelperProcess$")
		c.Env = []string{"FRMPS_HELPER=block"}
		if err := c.Start(); err != nil {
			os.Exit(2)
		}
		fmt.Printf("grandchild %d\n", c.Process.Pid)
		time.Sleep(time.Hour)
	case "supervisor":
		// A stand-in supervisor: launches a blocking engine, reports its pid,
		// then waits to be SIGKILLed by the test.
		spec := Spec{Name: "child", Path: os.Args[0], Args: []string{"-test.run=^TestHelperProcess$"},
			Env: []string{"FRMPS_HELPER=block"}, LogPath: os.Getenv("FRMPS_CHILD_LOG")}
		p, err := Start(spec, hclog.NewNullLogger())
		if err != nil {
			fmt.Println("ERR", err)
			os.Exit(2)
		}
		fmt.Printf("child %d\n", p.PID())
		time.Sleep(time.Hour)
	case "block":
		time.Sleep(time.Hour)
	case "env":
		fmt.Println("ENV", os.Getenv("FRMPS_X"), os.Getenv("HOME") == "")
		os.Exit(0)
	case "spare":
		// A stand-in spare (frmps_engine/sdk/spare.py): ready, then one line
		// from stdin, echoed into FRMPS_SPARE_OUT; end of input: exit 0.
		fmt.Println(SpareReadyMark + " in 0.0 s: test double")
		line, err := bufio.NewReader(os.Stdin).ReadString('\n')
		if err != nil {
			fmt.Println("no activation")
			os.Exit(0)
		}
		if err := os.WriteFile(os.Getenv("FRMPS_SPARE_OUT"), []byte(line), 0o600); err != nil {
			os.Exit(2)
		}
		fmt.Println("activated")
		time.Sleep(time.Hour)
	}
	os.Exit(0)
}

func helperSpec(t *testing.T, mode string) Spec {
	return Spec{
		Name:    "test-" + mode,
		Path:    os.Args[0],
		Args:    []string{"-test.run=^TestHelperProcess$"},
		Env:     []string{"FRMPS_HELPER=" + mode, "FRMPS_X=42"},
		LogPath: filepath.Join(t.TempDir(), mode+".log"),
	}
}

// capture is an hclog sink that records levels and messages.
type capture struct {
	mu    sync.Mutex
	lines []string
}

func (c *capture) Write(p []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.lines = append(c.lines, string(p))
	return len(p), nil
}

func (c *capture) has(sub string) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, l := range c.lines {
		if strings.Contains(l, sub) {
			return true
		}
	}
	return false
}

func wait(t *testing.T, p *Process) {
	t.Helper()
	waitFor(t, p.Done(), "engine did not exit")
}

// waitFor waits for ch to close, failing the test with why after a long while.
func waitFor(t *testing.T, ch <-chan struct{}, why string) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(20 * time.Second): // a safety net, not a timing assertion
		t.Fatal(why)
	}
}

func TestOutputLoggedWithLevelsAndTail(t *testing.T) {
	defer goleak.VerifyNone(t)
	sink := &capture{}
	log := hclog.New(&hclog.LoggerOptions{Output: sink, Level: hclog.Trace})
	spec := helperSpec(t, "lines")
	spec.StderrLines = 5
	p, err := Start(spec, log)
	if err != nil {
		t.Fatal(err)
	}
	wait(t, p)
	ws := p.WaitStatus()
	if !ws.Exited() || ws.ExitStatus() != 3 {
		t.Fatalf("status %v", ws)
	}
	for _, want := range []string{"[INFO]  test-lines: INFO 01-02 12:00:00 engine started", "[WARN]  test-lines: WARNING:frmps_engine:pool is small",
		"[ERROR] test-lines: 2026-01-01T00:00:00Z [ERROR] boom", "[WARN]  test-lines: plain stderr line"} {
		if !sink.has(want) {
			t.Errorf("log lacks %q; got %q", want, sink.lines)
		}
	}
	tail := p.LastStderr()
	want := []string{"tail 56", "tail 57", "tail 58", "tail 59", "no newline at end"}
	if strings.Join(tail, "|") != strings.Join(want, "|") {
		t.Errorf("tail %q, want %q", tail, want)
	}
	data, err := os.ReadFile(spec.LogPath)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"frmps: ", "launching", "engine started", "pool is small", "tail 0\n", "no newline at end\n", "exited: exit code 3"} {
		if !bytes.Contains(data, []byte(want)) {
			t.Errorf("log file lacks %q", want)
		}
	}
	if fi, _ := os.Stat(spec.LogPath); fi.Mode().Perm() != 0o600 {
		t.Errorf("log mode %v", fi.Mode())
	}
}

func TestEnvIsExactlyTheSpec(t *testing.T) {
	sink := &capture{}
	p, err := Start(helperSpec(t, "env"), hclog.New(&hclog.LoggerOptions{Output: sink}))
	if err != nil {
		t.Fatal(err)
	}
	wait(t, p)
	if !sink.has("ENV 42 true") {
		t.Fatalf("child env not the spec's: %q", sink.lines)
	}
}

func TestExecFailureLeavesLog(t *testing.T) {
	defer goleak.VerifyNone(t)
	spec := helperSpec(t, "x")
	spec.Path = filepath.Join(t.TempDir(), "no-such-engine")
	_, err := Start(spec, hclog.NewNullLogger())
	if err == nil {
		t.Fatal("launch of a missing binary succeeded")
	}
	data, rerr := os.ReadFile(spec.LogPath)
	if rerr != nil {
		t.Fatalf("no log after failed exec: %v", rerr)
	}
	if !bytes.Contains(data, []byte("launch failed")) || !bytes.Contains(data, []byte("no-such-engine")) {
		t.Fatalf("log does not explain the failure: %q", data)
	}
}

func TestBadSpec(t *testing.T) {
	if _, err := Start(Spec{LogPath: "x"}, hclog.NewNullLogger()); err == nil {
		t.Error("empty path accepted")
	}
	if _, err := Start(Spec{Path: "/bin/true"}, hclog.NewNullLogger()); err == nil {
		t.Error("empty log path accepted")
	}
	if _, err := Start(Spec{Path: "/bin/true", LogPath: filepath.Join(t.TempDir(), "no", "dir", "x.log")}, hclog.NewNullLogger()); err == nil {
		t.Error("unwritable log accepted")
	}
}

// Kill takes down the whole group, grandchildren included, and leaves no
// zombie: the grandchild is reparented and reaped by init, the child by us.
// KillLeader kills the leader alone; the group follows it before Done.
func TestKillFencesGroup(t *testing.T) {
	for _, name := range []string{"Kill", "KillLeader"} {
		t.Run(name, func(t *testing.T) {
			testKillFencesGroup(t, func(p *Process) error {
				if name == "Kill" {
					return p.Kill()
				}
				return p.KillLeader()
			})
		})
	}
}

func testKillFencesGroup(t *testing.T, kill func(*Process) error) {
	defer goleak.VerifyNone(t)
	sink := &capture{}
	log := hclog.New(&hclog.LoggerOptions{Output: sink})
	fdsBefore := countFDs(t)
	p, err := Start(helperSpec(t, "grandchild"), log)
	if err != nil {
		t.Fatal(err)
	}
	var gc int
	for deadline := time.Now().Add(20 * time.Second); gc == 0 && time.Now().Before(deadline); {
		sink.mu.Lock()
		for _, l := range sink.lines {
			if i := strings.Index(l, "grandchild "); i >= 0 {
				fmt.Sscanf(l[i:], "grandchild %d", &gc)
			}
		}
		sink.mu.Unlock()
		time.Sleep(5 * time.Millisecond) // polling for the child's output, not a timing assumption
	}
	if gc == 0 {
		t.Fatal("grandchild pid never printed")
	}
	if pgid, _ := syscall.Getpgid(gc); pgid != p.PID() {
		t.Fatalf("grandchild pgid %d, want %d", pgid, p.PID())
	}
	if err := kill(p); err != nil {
		t.Fatal(err)
	}
	wait(t, p)
	if ws := p.WaitStatus(); !ws.Signaled() || ws.Signal() != syscall.SIGKILL {
		t.Fatalf("status %v", ws)
	}
	// The grandchild got SIGKILL; it is gone once init reaps it.
	for deadline := time.Now().Add(20 * time.Second); ; {
		if err := syscall.Kill(gc, 0); err == syscall.ESRCH {
			break
		}
		if state := procState(gc); state == "Z" && time.Now().After(deadline) {
			t.Fatalf("grandchild %d still a zombie", gc)
		} else if time.Now().After(deadline) {
			t.Fatalf("grandchild %d survived the fence (state %q)", gc, state)
		}
		time.Sleep(5 * time.Millisecond)
	}
	if state := procState(p.PID()); state != "" {
		t.Fatalf("engine %d still in the process table (state %q): not reaped", p.PID(), state)
	}
	if err := p.Kill(); err != nil { // idempotent after exit
		t.Fatal(err)
	}
	if err := p.KillLeader(); err != nil {
		t.Fatal(err)
	}
	if after := countFDs(t); after != fdsBefore {
		t.Fatalf("fd leak: %d before, %d after", fdsBefore, after)
	}
}

// SIGKILL of the supervisor takes its engines down (parent-death signal).
func TestSupervisorDeathKillsEngine(t *testing.T) {
	cmd := exec.Command(os.Args[0], "-test.run=^TestHelperProcess$")
	cmd.Env = []string{"FRMPS_HELPER=supervisor", "FRMPS_CHILD_LOG=" + filepath.Join(t.TempDir(), "child.log")}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var child int
	if _, err := fmt.Fscanf(out, "child %d\n", &child); err != nil {
		cmd.Process.Kill()
		cmd.Wait()
		t.Fatalf("read child pid: %v", err)
	}
	if procState(child) == "" {
		t.Fatal("child not running")
	}
	if err := cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	cmd.Wait()
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		if st := procState(child); st == "" || st == "Z" {
			break // gone, or dead and waiting for init to reap it
		}
		if time.Now().After(deadline) {
			syscall.Kill(child, syscall.SIGKILL)
			t.Fatalf("engine %d outlived its supervisor", child)
		}
	}
}

func procState(pid int) string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return ""
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 || i+2 >= len(s) {
		return "?"
	}
	return s[i+2 : i+3]
}

func countFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

func TestParseLevel(t *testing.T) {
	for _, tc := range []struct {
		line string
		want hclog.Level
	}{
		{"2026-01-01T00:00:00.000Z [DEBUG] x: y", hclog.Debug},
		{"2026-01-01T00:00:00.000Z [WARN]  x", hclog.Warn},
		{"WARNING:root:x", hclog.Warn},
		{"ERROR 01-02 10:00:00 engine.py:1] bad", hclog.Error},
		{"2026-01-01 10:00:00,123 - frmps - CRITICAL - bad", hclog.Error},
		{"INFO: started", hclog.Info},
		{"TRACE x", hclog.Trace},
		{"INFORMATION is not a level", hclog.Warn},
		{"Traceback (most recent call last):", hclog.Warn},
		{strings.Repeat("x", 60) + " ERROR late", hclog.Warn},
		{"", hclog.Warn},
	} {
		if got, _ := ParseLevel(tc.line, hclog.Warn); got != tc.want {
			t.Errorf("ParseLevel(%q) = %s, want %s", tc.line, got, tc.want)
		}
	}
}

func TestPythonCLI(t *testing.T) {
	a, err := NewAdapter("ref", "/usr/bin/python3.11")
	if err != nil {
		t.Fatal(err)
	}
	path, args, err := a.Command(Invocation{Role: RoleStandby, Model: "tiny", ControlSocket: "/r/c.sock", GenerationSocket: "/r/g.sock",
		Memory: "host-shm", Device: "cpu", NumBlocks: 64})
	if err != nil {
		t.Fatal(err)
	}
	want := "/usr/bin/python3.11 -m frmps_engine.cli serve --engine ref --role standby --model tiny --control-socket /r/c.sock --generation-socket /r/g.sock --memory host-shm --device cpu --num-blocks 64"
	if got := path + " " + strings.Join(args, " "); got != want {
		t.Fatalf("got  %s\nwant %s", got, want)
	}
	v, _ := NewAdapter("vllm", "")
	path, args, _ = v.Command(Invocation{Role: RoleActive, Model: "m", ControlSocket: "c", GenerationSocket: "g"})
	if path != "python3" || args[4] != "vllm" {
		t.Fatalf("vllm: %s %v", path, args)
	}
	// Engine names belong to the engine CLI (frmps serve asks it before it
	// starts): any name is passed through as one argument.
	c, err := NewAdapter("mypkg.engines:Factory", "")
	if err != nil {
		t.Fatal(err)
	}
	if _, args, _ = c.Command(Invocation{Role: RoleActive, Model: "m", ControlSocket: "c", GenerationSocket: "g"}); args[3] != "--engine" || args[4] != "mypkg.engines:Factory" {
		t.Fatalf("custom engine: %v", args)
	}
	// vLLM's API server as the frontend: the engine-core addresses replace the generation socket.
	_, args, err = v.Command(Invocation{Role: RoleStandby, Model: "m", ControlSocket: "c", GenerationSocket: "g",
		CoreInput: "ipc:///d/in.sock", CoreOutput: "ipc:///d/out.sock"})
	if got := strings.Join(args, " "); err != nil || !strings.Contains(got, "--core-input ipc:///d/in.sock --core-output ipc:///d/out.sock") ||
		strings.Contains(got, "--generation-socket") {
		t.Fatalf("core mode: %v %s", err, got)
	}
	if _, _, err := v.Command(Invocation{Role: RoleActive, Model: "m", ControlSocket: "c", GenerationSocket: "g", CoreInput: "ipc:///d/in.sock"}); err == nil {
		t.Error("one engine-core address of two accepted")
	}
	if _, err := NewAdapter("", ""); err == nil {
		t.Error("empty engine name accepted")
	}
	if _, _, err := a.Command(Invocation{Role: "leader", Model: "m", ControlSocket: "c", GenerationSocket: "g"}); err == nil {
		t.Error("bad role accepted")
	}
	if _, _, err := a.Command(Invocation{Role: RoleActive}); err == nil {
		t.Error("missing fields accepted")
	}
}
