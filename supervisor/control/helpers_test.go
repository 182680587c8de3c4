package control

import (
	"net"
	"os"
	"testing"

	"go.uber.org/goleak"
	"golang.org/x/sys/unix"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// openFDs counts this process's open file descriptors.
func openFDs(t testing.TB) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatalf("read /proc/self/fd: %v", err)
	}
	return len(ents) - 1 // ReadDir's own fd
}

// checkNoFDLeak records the fd count now and fails the test if it differs
// at cleanup. The Go runtime opens its poller fds lazily, so call it after
// the first socket of the test exists.
func checkNoFDLeak(t *testing.T) {
	t.Helper()
	before := openFDs(t)
	t.Cleanup(func() {
		if after := openFDs(t); after != before {
			t.Errorf("fd leak: %d open fds before, %d after", before, after)
		}
	})
}

// unixConnFromFD turns one end of a socketpair into a *net.UnixConn.
func unixConnFromFD(t testing.TB, fd int) *net.UnixConn {
	t.Helper()
	f := os.NewFile(uintptr(fd), "socketpair")
	defer f.Close()
	c, err := net.FileConn(f)
	if err != nil {
		t.Fatalf("FileConn: %v", err)
	}
	return c.(*net.UnixConn)
}

// connPair returns two connected Conns.
func connPair(t testing.TB) (*Conn, *Conn) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatalf("socketpair: %v", err)
	}
	a, err := NewConn(unixConnFromFD(t, fds[0]))
	if err != nil {
		t.Fatalf("NewConn: %v", err)
	}
	b, err := NewConn(unixConnFromFD(t, fds[1]))
	if err != nil {
		t.Fatalf("NewConn: %v", err)
	}
	t.Cleanup(func() { a.Close(); b.Close() })
	return a, b
}

// rawPair returns a Conn and the raw fd of its peer, for writing hostile
// bytes and fds that Send would refuse to produce.
func rawPair(t testing.TB) (*Conn, int) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatalf("socketpair: %v", err)
	}
	c, err := NewConn(unixConnFromFD(t, fds[0]))
	if err != nil {
		t.Fatalf("NewConn: %v", err)
	}
	t.Cleanup(func() { c.Close(); unix.Close(fds[1]) })
	return c, fds[1]
}

// memfd creates an anonymous file of size bytes, closed at cleanup.
func memfd(t testing.TB, size int64) int {
	t.Helper()
	fd, err := unix.MemfdCreate("frmps-test-pool", unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatalf("memfd_create: %v", err)
	}
	if err := unix.Ftruncate(fd, size); err != nil {
		t.Fatalf("ftruncate: %v", err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	return fd
}

// privateDir makes a short 0700 directory (socket paths must stay short).
func privateDir(t testing.TB) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "ctl")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}
