package sdnotify

import (
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// listen opens the socket systemd would, and points NOTIFY_SOCKET at it.
func listen(t *testing.T) *net.UnixConn {
	t.Helper()
	path := filepath.Join(t.TempDir(), "notify")
	c, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: path, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	t.Setenv("NOTIFY_SOCKET", path)
	return c
}

func recv(t *testing.T, c *net.UnixConn) string {
	t.Helper()
	buf := make([]byte, 4096)
	if err := c.SetReadDeadline(time.Now().Add(5 * time.Second)); err != nil {
		t.Fatal(err)
	}
	n, err := c.Read(buf)
	if err != nil {
		t.Fatalf("no notification: %v", err)
	}
	return string(buf[:n])
}

func TestMessagesReachTheSocket(t *testing.T) {
	c := listen(t)
	t.Setenv("WATCHDOG_USEC", "3000000")
	t.Setenv("WATCHDOG_PID", strconv.Itoa(os.Getpid()))
	n, err := New(nil)
	if err != nil {
		t.Fatal(err)
	}
	if !n.Enabled() || n.WatchdogInterval() != 1500*time.Millisecond {
		t.Fatalf("enabled %v, watchdog interval %s", n.Enabled(), n.WatchdogInterval())
	}
	n.Ready("serving\ntiny")
	if got := recv(t, c); got != "READY=1\nSTATUS=serving tiny" {
		t.Fatalf("got %q", got)
	}
	n.Feed()
	if got := recv(t, c); got != "WATCHDOG=1" {
		t.Fatalf("got %q", got)
	}
	n.Status("degraded")
	if got := recv(t, c); got != "STATUS=degraded" {
		t.Fatalf("got %q", got)
	}
	n.Stopping("draining")
	n.Close() // STOPPING=1 is sent before Close returns
	if got := recv(t, c); got != "STOPPING=1\nSTATUS=draining" {
		t.Fatalf("got %q", got)
	}
	n.Close()
}

// Feed never blocks, even when systemd reads nothing (queued pings merge),
// and Close gives up waiting on it after closeTimeout.
func TestFeedNeverBlocks(t *testing.T) {
	c := listen(t)
	n, err := New(nil)
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	for range 100000 {
		n.Feed()
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Fatalf("100000 feeds took %s", d)
	}
	start = time.Now()
	n.Close()
	if d := time.Since(start); d > closeTimeout+time.Second {
		t.Fatalf("Close took %s", d)
	}
	got := 0
	for {
		_ = c.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
		if _, err := c.Read(make([]byte, 64)); err != nil {
			break
		}
		got++
	}
	if got == 0 || got > 100000 {
		t.Fatalf("%d pings arrived", got)
	}
}

func TestWithoutSystemd(t *testing.T) {
	t.Setenv("NOTIFY_SOCKET", "")
	n, err := New(nil)
	if err != nil {
		t.Fatal(err)
	}
	n.Ready("x")
	n.Feed()
	n.Stopping("y")
	n.Close()
	if n.Enabled() || n.WatchdogInterval() != 0 {
		t.Fatal("enabled without NOTIFY_SOCKET")
	}
}

// A watchdog meant for another process (WATCHDOG_PID) is not ours to feed.
func TestWatchdogOfAnotherProcess(t *testing.T) {
	listen(t)
	t.Setenv("WATCHDOG_USEC", "3000000")
	t.Setenv("WATCHDOG_PID", strconv.Itoa(os.Getpid()+1))
	n, err := New(nil)
	if err != nil {
		t.Fatal(err)
	}
	defer n.Close()
	if n.WatchdogInterval() != 0 {
		t.Fatalf("interval %s", n.WatchdogInterval())
	}
}

func TestBadWatchdogSetting(t *testing.T) {
	listen(t)
	t.Setenv("WATCHDOG_USEC", "soon")
	if _, err := New(nil); err == nil {
		t.Fatal("accepted WATCHDOG_USEC=soon")
	}
}

func TestStripEnv(t *testing.T) {
	env := []string{"PATH=/bin", "NOTIFY_SOCKET=/run/x", "WATCHDOG_USEC=1", "WATCHDOG_PID=2", "NOTIFY_SOCKETX=keep"}
	got := StripEnv(env)
	if !slices.Equal(got, []string{"PATH=/bin", "NOTIFY_SOCKETX=keep"}) || len(env) != 5 {
		t.Fatalf("%q (input now %q)", got, env)
	}
}
