package control

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// Listener is a per-engine control socket. Only the process the supervisor
// launched (checked by pid and uid) gets a connection out of Accept.
type Listener struct {
	path string
	ln   *net.UnixListener

	acceptMu sync.Mutex // one Accept at a time: it drives the listener deadline
	refused  atomic.Uint64
	onRefuse atomic.Pointer[func(Peer, error)]

	closeOnce sync.Once
	closeErr  error
}

// Listen creates the control socket at path. The parent directory must
// exist, be owned by us and have mode 0700: the socket's own mode is set
// after bind, and the directory is what keeps other users out in between. A
// stale socket left by a dead supervisor is replaced; a live one is not.
func Listen(path string) (*Listener, error) {
	if err := checkSocketPath(path); err != nil {
		return nil, fmt.Errorf("listen: %w", err)
	}
	if err := CheckPrivateDir(filepath.Dir(path)); err != nil {
		return nil, fmt.Errorf("listen %s: %w", path, err)
	}
	if err := removeStaleSocket(path); err != nil {
		return nil, fmt.Errorf("listen %s: %w", path, err)
	}
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("listen %s: %w", path, err)
	}
	ln.SetUnlinkOnClose(true)
	if err := os.Chmod(path, 0o600); err != nil {
		_ = ln.Close()
		return nil, fmt.Errorf("listen %s: chmod socket: %w", path, err)
	}
	return &Listener{path: path, ln: ln}, nil
}

// CheckPrivateDir verifies that dir is a directory (not a symlink), owned by
// the current user, with mode exactly 0700.
func CheckPrivateDir(dir string) error {
	fi, err := os.Lstat(dir)
	if err != nil {
		return fmt.Errorf("check run directory: %w", err)
	}
	if !fi.IsDir() {
		return fmt.Errorf("check run directory: %s is not a directory (mode %s)", dir, fi.Mode())
	}
	if perm := fi.Mode().Perm(); perm != 0o700 || fi.Mode()&(os.ModeSetuid|os.ModeSetgid|os.ModeSticky) != 0 {
		return fmt.Errorf("check run directory: %s has mode %s, want drwx------ (0700)", dir, fi.Mode())
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return fmt.Errorf("check run directory: cannot read the owner of %s", dir)
	}
	if int(st.Uid) != os.Getuid() {
		return fmt.Errorf("check run directory: %s is owned by uid %d, we are uid %d", dir, st.Uid, os.Getuid())
	}
	return nil
}

func removeStaleSocket(path string) error {
	fi, err := os.Lstat(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("check existing socket: %w", err)
	}
	if fi.Mode()&os.ModeSocket == 0 {
		return fmt.Errorf("%s exists and is not a socket (mode %s)", path, fi.Mode())
	}
	d := net.Dialer{Timeout: 100 * time.Millisecond}
	conn, err := d.Dial("unix", path)
	if err == nil {
		_ = conn.Close()
		return fmt.Errorf("%s is in use by a live listener", path)
	}
	if !errors.Is(err, syscall.ECONNREFUSED) {
		return fmt.Errorf("probe existing socket: %w", err)
	}
	if err := os.Remove(path); err != nil {
		return fmt.Errorf("remove stale socket: %w", err)
	}
	return nil
}

// Path is the socket's path.
func (l *Listener) Path() string { return l.path }

// Refused counts connections refused so far because the peer was not the
// expected process.
func (l *Listener) Refused() uint64 { return l.refused.Load() }

// OnRefuse installs a callback run (on the Accept goroutine) for every
// refused peer, with the reason; nil removes it.
func (l *Listener) OnRefuse(fn func(Peer, error)) {
	if fn == nil {
		l.onRefuse.Store(nil)
		return
	}
	l.onRefuse.Store(&fn)
}

// ErrWrongPeer is wrapped by the reason given to OnRefuse for a peer that is
// not the expected process.
var ErrWrongPeer = errors.New("wrong peer")

// Accept waits for the process expectPID (of our uid) to connect. Other
// peers are refused (closed) and counted, and Accept keeps waiting. It
// returns ctx's error when ctx ends first.
func (l *Listener) Accept(ctx context.Context, expectPID int) (*Conn, error) {
	if expectPID <= 0 {
		return nil, fmt.Errorf("accept on %s: invalid expected pid %d", l.path, expectPID)
	}
	l.acceptMu.Lock()
	defer l.acceptMu.Unlock()
	uid := os.Getuid()
	for {
		if err := ctx.Err(); err != nil {
			return nil, fmt.Errorf("accept on %s: %w", l.path, err)
		}
		uc, err := l.acceptOnce(ctx)
		if err != nil {
			if ctxErr := ctx.Err(); ctxErr != nil {
				return nil, fmt.Errorf("accept on %s: %w", l.path, ctxErr)
			}
			return nil, fmt.Errorf("accept on %s: %w", l.path, err)
		}
		c, err := NewConn(uc)
		if err != nil {
			l.refuse(Peer{}, err)
			continue
		}
		switch {
		case c.peer.UID != uid:
			l.refuse(c.peer, fmt.Errorf("%w: uid %d (pid %d), want uid %d", ErrWrongPeer, c.peer.UID, c.peer.PID, uid))
		case c.peer.PID != expectPID:
			l.refuse(c.peer, fmt.Errorf("%w: pid %d, want pid %d", ErrWrongPeer, c.peer.PID, expectPID))
		default:
			return c, nil
		}
		_ = c.Close()
	}
}

func (l *Listener) refuse(p Peer, reason error) {
	l.refused.Add(1)
	if fn := l.onRefuse.Load(); fn != nil {
		(*fn)(p, reason)
	}
}

// acceptOnce accepts one connection, interrupted by ctx through the
// listener's deadline.
func (l *Listener) acceptOnce(ctx context.Context) (*net.UnixConn, error) {
	if err := l.ln.SetDeadline(time.Time{}); err != nil {
		return nil, err
	}
	fired := make(chan struct{})
	stop := context.AfterFunc(ctx, func() {
		defer close(fired)
		_ = l.ln.SetDeadline(time.Unix(1, 0))
	})
	uc, err := l.ln.AcceptUnix()
	if !stop() {
		<-fired // the deadline is set; do not let it race the next reset
	}
	return uc, err
}

// Close stops listening and removes the socket file. Idempotent.
func (l *Listener) Close() error {
	l.closeOnce.Do(func() {
		if err := l.ln.Close(); err != nil {
			l.closeErr = fmt.Errorf("close listener %s: %w", l.path, err)
		}
	})
	return l.closeErr
}
