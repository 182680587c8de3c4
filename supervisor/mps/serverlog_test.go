package mps

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
)

// Lines of an H100's MPS server log (driver 580.159.04) around a co-tenant's fault.
const h100ServerLog = `[2026-11-23 22:19:02.423 Server  1623] Status of client {PID: 2140, Context ID: 1} is ACTIVE
[2026-11-23 22:19:03.147 Server  1623] Client {PID: 1978, Context: 1} encountered a fatal GPU error.
[2026-11-23 22:19:03.147 Server  1623] Server is handling a fatal GPU error.
[2026-11-23 22:19:03.147 Server  1623] Client {PID: 1978, Context ID: 1} on device 0 to be torn down
[2026-11-23 22:19:03.147 Server  1623] Client {PID: 2140, Context ID: 1} on device 0 to be torn down
[2026-11-23 22:19:03.147 Server  1623] All clients belonging to error trigging process 1978 will be torn down
[2026-11-23 22:19:03.147 Server  1623] Client {PID: 1978, Context ID: 1} on the error-trigging process 1978 to be torn down
[2026-11-23 22:19:03.154 Server  1623] Client {PID: 1978, Context ID: 1} exiting. Number of active client contexts is 0.
[2026-11-23 22:19:03.237 Server  1623] Client process 1978 disconnected
`

func TestParseTeardown(t *testing.T) {
	var got []int
	for _, l := range strings.Split(h100ServerLog, "\n") {
		if pid := ParseTeardown([]byte(l)); pid != 0 {
			got = append(got, pid)
		}
	}
	want := []int{1978, 1978, 2140, 1978}
	if len(got) != len(want) {
		t.Fatalf("teardowns %v, want %v", got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("teardowns %v, want %v", got, want)
		}
	}
}

type collected struct {
	mu   sync.Mutex
	pids []int
}

func (c *collected) add(td Teardown) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.pids = append(c.pids, td.PID)
}

func (c *collected) wait(t *testing.T, n int) []int {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		c.mu.Lock()
		got := append([]int(nil), c.pids...)
		c.mu.Unlock()
		if len(got) >= n || time.Now().After(deadline) {
			return got
		}
		time.Sleep(time.Millisecond)
	}
}

func appendTo(t *testing.T, path, s string) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteString(s); err != nil {
		t.Fatal(err)
	}
	f.Close()
}

func teardownOf(pid string) string {
	return "[2026-11-23 22:19:03.147 Server  1623] Client {PID: " + pid + ", Context ID: 1} on device 0 to be torn down\n"
}

// The file appears after the watch began (no server before the first
// client), a line arrives in two writes, a restarted daemon truncates the
// file, and another replaces it: every teardown is reported once, and
// the watcher's goroutine ends with its context.
func TestWatchServerLogFollowsTheFile(t *testing.T) {
	defer goleak.VerifyNone(t)
	path := filepath.Join(t.TempDir(), ServerLogName)
	var c collected
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	w := OpenServerLog(path)
	go func() { defer close(done); w.Watch(ctx, time.Millisecond, c.add) }()

	appendTo(t, path, teardownOf("11"))
	if got := c.wait(t, 1); len(got) != 1 || got[0] != 11 {
		t.Fatalf("new file: %v", got)
	}
	appendTo(t, path, "[2026-11-23 22:19:03.147 Server  1623] Client {PID: 22, Con")
	time.Sleep(5 * time.Millisecond)
	appendTo(t, path, "text ID: 1} on device 0 to be torn down\n")
	if got := c.wait(t, 2); len(got) != 2 || got[1] != 22 {
		t.Fatalf("split line: %v", got)
	}
	if err := os.Truncate(path, 0); err != nil {
		t.Fatal(err)
	}
	appendTo(t, path, teardownOf("33"))
	if got := c.wait(t, 3); len(got) != 3 || got[2] != 33 {
		t.Fatalf("truncated: %v", got)
	}
	if err := os.Rename(path, path+".1"); err != nil {
		t.Fatal(err)
	}
	appendTo(t, path, "[x] not a teardown\n"+teardownOf("44"))
	if got := c.wait(t, 4); len(got) != 4 || got[3] != 44 {
		t.Fatalf("replaced: %v", got)
	}
	cancel()
	<-done
	if len(c.pids) != 4 {
		t.Fatalf("extra reports: %v", c.pids)
	}
}

// What the log held before the watch began is history.
func TestWatchServerLogSkipsHistory(t *testing.T) {
	defer goleak.VerifyNone(t)
	path := filepath.Join(t.TempDir(), ServerLogName)
	appendTo(t, path, h100ServerLog)
	var c collected
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	w := OpenServerLog(path)
	go func() { defer close(done); w.Watch(ctx, time.Millisecond, c.add) }()
	appendTo(t, path, teardownOf("55"))
	if got := c.wait(t, 1); len(got) != 1 || got[0] != 55 {
		t.Fatalf("got %v, want [55]", got)
	}
	cancel()
	<-done
}
