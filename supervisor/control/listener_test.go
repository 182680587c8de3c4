package control

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/frmps/frmps/internal/testenv"
)

// TestHelperDialer is not a test: it is the child process of the peer
// tests (re-executed test binary). It dials the socket, sends a Ping and
// waits for the connection to close.
func TestHelperDialer(t *testing.T) {
	path := os.Getenv("FRMPS_CONTROL_HELPER_SOCKET")
	if path == "" {
		t.Skip("helper process only")
	}
	c, err := Dial(path)
	if err != nil {
		fmt.Fprintln(os.Stderr, "helper dial:", err)
		os.Exit(2)
	}
	if err := c.Send(ping(7), nil); err != nil {
		os.Exit(3)
	}
	_, _, err = c.Recv() // blocks until the supervisor side closes
	c.Close()
	if err != io.EOF {
		os.Exit(4)
	}
	os.Exit(0)
}

func startDialer(t *testing.T, path string) *exec.Cmd {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestHelperDialer$")
	cmd.Env = append(os.Environ(), "FRMPS_CONTROL_HELPER_SOCKET="+path)
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	return cmd
}

func TestAcceptChildProcessPeer(t *testing.T) {
	dir := privateDir(t)
	l, err := Listen(filepath.Join(dir, "a.sock"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	checkNoFDLeak(t)

	// The child is not us: Accept expecting our own pid refuses it, and
	// keeps waiting until the refusal hook ends its context.
	child := startDialer(t, l.Path())
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	var reasons []error
	l.OnRefuse(func(p Peer, reason error) {
		if p.PID != child.Process.Pid {
			t.Errorf("refused peer pid %d, want the child %d", p.PID, child.Process.Pid)
		}
		reasons = append(reasons, reason)
		cancel()
	})
	c, err := l.Accept(ctx, os.Getpid())
	cancel()
	if err == nil {
		c.Close()
		t.Fatal("Accept returned a connection from the wrong process")
	}
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("Accept: %v, want it to keep waiting after the refusal", err)
	}
	if l.Refused() != 1 || len(reasons) != 1 || !errors.Is(reasons[0], ErrWrongPeer) {
		t.Fatalf("refused %d, reasons %v", l.Refused(), reasons)
	}
	child.Wait() // its connection was closed under it: it exits either way

	// The expected child is accepted and its message arrives.
	l.OnRefuse(nil)
	child = startDialer(t, l.Path())
	ctx, cancel = context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err = l.Accept(ctx, child.Process.Pid)
	if err != nil {
		t.Fatalf("Accept of the expected child: %v", err)
	}
	if c.PeerPID() != child.Process.Pid {
		t.Fatalf("PeerPID %d, want %d", c.PeerPID(), child.Process.Pid)
	}
	env, _, err := c.Recv()
	if err != nil || env.GetId() != 7 {
		t.Fatalf("Recv from child: %v %v", env, err)
	}
	c.Close()
	if err := child.Wait(); err != nil {
		t.Fatalf("child: %v", err)
	}
}

func TestAcceptRefusesWrongPIDAndKeepsWaiting(t *testing.T) {
	dir := privateDir(t)
	l, err := Listen(filepath.Join(dir, "b.sock"))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()

	// Two impostors (this process, not the expected pid) then the right one.
	// Accept runs once, expecting our pid only on the second listener call.
	for range 2 {
		c, err := Dial(l.Path())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
	}
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	if c, err := l.Accept(ctx, os.Getpid()+100000); err == nil {
		c.Close()
		t.Fatal("accepted a peer with the wrong pid")
	}
	if got := l.Refused(); got != 2 {
		t.Fatalf("Refused() = %d, want 2", got)
	}

	good, err := Dial(l.Path())
	if err != nil {
		t.Fatal(err)
	}
	defer good.Close()
	c, err := l.Accept(context.Background(), os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if c.PeerPID() != os.Getpid() || good.PeerPID() != os.Getpid() {
		t.Fatalf("peer pids %d / %d", c.PeerPID(), good.PeerPID())
	}
}

func TestAcceptHonoursCancel(t *testing.T) {
	l, err := Listen(filepath.Join(privateDir(t), "c.sock"))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		_, err := l.Accept(ctx, os.Getpid())
		done <- err
	}()
	cancel()
	select {
	case err := <-done:
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("Accept: %v, want context.Canceled", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Accept ignored its context")
	}
	// The listener still works after a cancelled Accept.
	c, err := Dial(l.Path())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	s, err := l.Accept(context.Background(), os.Getpid())
	if err != nil {
		t.Fatalf("Accept after a cancelled one: %v", err)
	}
	s.Close()
	if _, err := l.Accept(context.Background(), 0); err == nil {
		t.Fatal("Accept with pid 0 succeeded")
	}
}

func TestListenChecks(t *testing.T) {
	t.Run("socket mode and removal", func(t *testing.T) {
		path := filepath.Join(privateDir(t), "d.sock")
		l, err := Listen(path)
		if err != nil {
			t.Fatal(err)
		}
		fi, err := os.Stat(path)
		if err != nil || fi.Mode().Perm() != 0o600 || fi.Mode()&os.ModeSocket == 0 {
			t.Fatalf("socket %v mode %v", err, fi.Mode())
		}
		// A second listener on a live socket is refused.
		if l2, err := Listen(path); err == nil || !strings.Contains(err.Error(), "in use") {
			if l2 != nil {
				l2.Close()
			}
			t.Fatalf("second Listen on a live socket: %v", err)
		}
		if err := l.Close(); err != nil {
			t.Fatal(err)
		}
		if err := l.Close(); err != nil {
			t.Fatalf("second Close: %v", err)
		}
		if _, err := os.Stat(path); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("socket file still there after Close: %v", err)
		}
	})
	t.Run("stale socket replaced", func(t *testing.T) {
		path := filepath.Join(privateDir(t), "e.sock")
		l, err := Listen(path)
		if err != nil {
			t.Fatal(err)
		}
		l.ln.SetUnlinkOnClose(false) // simulate a supervisor that died
		l.Close()
		if _, err := os.Stat(path); err != nil {
			t.Fatalf("stale socket missing: %v", err)
		}
		l, err = Listen(path)
		if err != nil {
			t.Fatalf("Listen over a stale socket: %v", err)
		}
		l.Close()
	})
	t.Run("refusals", func(t *testing.T) {
		open := t.TempDir()
		if err := os.Chmod(open, 0o755); err != nil {
			t.Fatal(err)
		}
		notOurs := filepath.Join(privateDir(t), "other")
		if err := os.Mkdir(notOurs, 0o700); err != nil {
			t.Fatal(err)
		}
		chownErr := os.Chown(notOurs, os.Getuid()+1, -1)
		regular := filepath.Join(privateDir(t), "file")
		os.WriteFile(regular, nil, 0o600)
		cases := []struct {
			name, path, want string
			skip             bool
		}{
			{"dir mode 0755", filepath.Join(open, "x.sock"), "want drwx------", false},
			{"missing dir", filepath.Join(privateDir(t), "nope", "x.sock"), "no such file", false},
			{"too long", filepath.Join(privateDir(t), strings.Repeat("l", 120)+".sock"), "limit for a unix socket path is 107", false},
			{"dir not ours", filepath.Join(notOurs, "x.sock"), "owned by uid", chownErr != nil},
			{"path is a file", regular, "not a socket", false},
		}
		for _, tc := range cases {
			t.Run(tc.name, func(t *testing.T) {
				if tc.skip {
					testenv.Missing(t, "cannot chown a folder to another user here: run as root for the not-ours case")
				}
				l, err := Listen(tc.path)
				if err == nil {
					l.Close()
					t.Fatal("Listen succeeded")
				}
				if !strings.Contains(err.Error(), tc.want) {
					t.Fatalf("error %q does not say %q", err, tc.want)
				}
			})
		}
		if _, err := Dial(filepath.Join("/", strings.Repeat("d", 200))); err == nil || !strings.Contains(err.Error(), "limit") {
			t.Fatalf("Dial with a long path: %v", err)
		}
	})
}
