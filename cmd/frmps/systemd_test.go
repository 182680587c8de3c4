package main

import (
	"bytes"
	"context"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// fakeEnginePython builds the fake engine (a TEST DOUBLE that speaks the
// real control protocol, supervisor/internal/fakeengine) and writes a
// stand-in Python interpreter (also a TEST DOUBLE) that passes the preflight
// and runs the fake engine for `-m frmps_engine.cli serve …`, recording each
// engine's environment in envDir.
func fakeEnginePython(t *testing.T) (python, envDir string) {
	t.Helper()
	dir := t.TempDir()
	bin := filepath.Join(dir, "fakeengine")
	build := exec.Command("go", "build", "-o", bin, "github.com/frmps/frmps/supervisor/internal/fakeengine/cmd/fakeengine")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build the fake engine: %v\n%s", err, out)
	}
	envDir = filepath.Join(dir, "env")
	if err := os.Mkdir(envDir, 0o700); err != nil {
		t.Fatal(err)
	}
	python = filepath.Join(dir, "python")
	script := `#!/bin/sh
case "$1" in
-c) echo /fake/frmps_engine/__init__.py; echo '{"vllm": "", "vllm_why": "not installed"}'; exit 0 ;;
-m) env > "` + envDir + `/$$"; shift 2; exec "` + bin + `" "$@" ;;
esac
echo "unexpected arguments: $*" >&2
exit 2
`
	if err := os.WriteFile(python, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	return python, envDir
}

// notifySocket listens where systemd would and collects what arrives.
type notifySocket struct {
	mu   sync.Mutex
	msgs []string
	at   []time.Time
	got  chan struct{}
}

func listenNotify(t *testing.T) *notifySocket {
	t.Helper()
	path := filepath.Join(t.TempDir(), "notify")
	c, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: path, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	ns := &notifySocket{got: make(chan struct{}, 1)}
	done := make(chan struct{})
	go func() {
		defer close(done)
		buf := make([]byte, 4096)
		for {
			n, err := c.Read(buf)
			if err != nil {
				return
			}
			ns.mu.Lock()
			ns.msgs, ns.at = append(ns.msgs, string(buf[:n])), append(ns.at, time.Now())
			ns.mu.Unlock()
			select {
			case ns.got <- struct{}{}:
			default:
			}
		}
	}()
	t.Cleanup(func() { c.Close(); <-done })
	t.Setenv("NOTIFY_SOCKET", path)
	return ns
}

// waitFor returns the index of the first message with prefix.
func (ns *notifySocket) waitFor(t *testing.T, prefix string, timeout time.Duration) int {
	t.Helper()
	deadline := time.After(timeout)
	for {
		ns.mu.Lock()
		for i, m := range ns.msgs {
			if strings.HasPrefix(m, prefix) {
				ns.mu.Unlock()
				return i
			}
		}
		ns.mu.Unlock()
		select {
		case <-ns.got:
		case <-deadline:
			t.Fatalf("no %q notification within %s; got %q", prefix, timeout, ns.snapshot())
		}
	}
}

func (ns *notifySocket) snapshot() []string {
	ns.mu.Lock()
	defer ns.mu.Unlock()
	return append([]string(nil), ns.msgs...)
}

func get(t *testing.T, url string) int {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	resp.Body.Close()
	return resp.StatusCode
}

// frmps serve under systemd's notify protocol, against a real NOTIFY_SOCKET:
// READY=1 once an engine serves (not before), WATCHDOG=1 from the event loop
// at half of WatchdogSec, STOPPING=1 at shutdown; the engines do not inherit
// the notify variables.
func TestServeSpeaksSystemdNotify(t *testing.T) {
	python, envDir := fakeEnginePython(t)
	ns := listenNotify(t)
	t.Setenv("WATCHDOG_USEC", "1000000") // feeds every 500ms
	t.Setenv("WATCHDOG_PID", strconv.Itoa(os.Getpid()))

	noGPU(t) // the defaults resolve to the CPU path, whatever this host has
	o := defaultServeOptions()
	o.NoMPS, o.Python, o.Model = true, python, "fake"
	o.Port, o.AdminAddr = freePort(t), "127.0.0.1:0"
	o.RingDir, o.ShutdownGrace = t.TempDir(), 5*time.Second
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var logs bytes.Buffer
	done := make(chan error, 1)
	go func() { done <- runServe(ctx, o, &logs) }()

	ready := ns.waitFor(t, "READY=1", 30*time.Second)
	base := "http://127.0.0.1:" + strconv.Itoa(o.Port)
	if code := get(t, base+"/readyz"); code != 200 {
		t.Errorf("READY=1 sent while /readyz says %d", code)
	}
	if code := get(t, base+"/livez"); code != 200 {
		t.Errorf("/livez %d", code)
	}
	if m := ns.snapshot()[ready]; m != "READY=1\nSTATUS=serving fake" {
		t.Errorf("ready message %q", m)
	}
	before := len(ns.snapshot())
	time.Sleep(2 * time.Second)
	pings := 0
	for _, m := range ns.snapshot()[before:] {
		if m == "WATCHDOG=1" {
			pings++
		}
	}
	if pings < 2 || pings > 6 {
		t.Errorf("%d watchdog pings in 2s at a 500ms interval", pings)
	}

	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("serve: %v\n%s", err, logs.String())
		}
	case <-time.After(30 * time.Second):
		t.Fatal("serve did not stop")
	}
	stopping := ns.waitFor(t, "STOPPING=1", time.Second)
	if stopping < ready {
		t.Error("STOPPING=1 before READY=1")
	}

	envs, err := os.ReadDir(envDir)
	if err != nil || len(envs) < 2 {
		t.Fatalf("engine environments: %v %v", envs, err)
	}
	for _, e := range envs {
		b, err := os.ReadFile(filepath.Join(envDir, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		for _, v := range []string{"NOTIFY_SOCKET=", "WATCHDOG_USEC=", "WATCHDOG_PID="} {
			if strings.Contains("\n"+string(b), "\n"+v) {
				t.Errorf("an engine inherited %s", v)
			}
		}
	}
}
