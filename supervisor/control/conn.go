package control

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
)

// maxSunPath is the usable length of a unix socket path: sun_path is 108
// bytes on Linux including the terminating NUL.
const maxSunPath = 107

// Peer is the identity of the process at the other end of a unix socket, as
// the kernel reported it (SO_PEERCRED) when the connection was made.
type Peer struct {
	PID int
	UID int
	GID int
}

// Conn is one engine's control connection. It is safe for one reader and any
// number of concurrent senders.
type Conn struct {
	uc   *net.UnixConn
	raw  syscall.RawConn
	peer Peer

	sendMu sync.Mutex

	recvMu sync.Mutex
	oob    []byte // recvmsg control buffer, reused; guarded by recvMu
	// broken is set once the byte stream is out of step with the framing
	// (bad length prefix, timeout mid-frame); every later Recv returns it.
	broken error // guarded by recvMu

	closeOnce sync.Once
	closeErr  error
}

// NewConn wraps a connected unix stream socket. The Conn owns uc from then
// on, also when NewConn fails (uc is closed).
func NewConn(uc *net.UnixConn) (*Conn, error) {
	raw, err := uc.SyscallConn()
	if err != nil {
		_ = uc.Close()
		return nil, fmt.Errorf("control conn: %w", err)
	}
	peer, err := peerCred(raw)
	if err != nil {
		_ = uc.Close()
		return nil, err
	}
	return &Conn{
		uc:   uc,
		raw:  raw,
		peer: peer,
		oob:  make([]byte, unix.CmsgSpace(MaxFDs*4)),
	}, nil
}

func peerCred(raw syscall.RawConn) (Peer, error) {
	var cred *unix.Ucred
	var credErr error
	if err := raw.Control(func(fd uintptr) {
		cred, credErr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return Peer{}, fmt.Errorf("read peer credentials: %w", err)
	}
	if credErr != nil {
		return Peer{}, fmt.Errorf("read peer credentials: %w", credErr)
	}
	return Peer{PID: int(cred.Pid), UID: int(cred.Uid), GID: int(cred.Gid)}, nil
}

// checkSocketPath rejects paths that do not fit in sun_path, which the kernel
// would otherwise refuse with a bare EINVAL.
func checkSocketPath(path string) error {
	if path == "" {
		return errors.New("empty socket path")
	}
	if len(path) > maxSunPath {
		return fmt.Errorf("socket path %q is %d bytes, the limit for a unix socket path is %d: use a shorter run directory",
			path, len(path), maxSunPath)
	}
	return nil
}

// Dial connects to a control socket (the engine side; fake engines in tests).
func Dial(path string) (*Conn, error) {
	if err := checkSocketPath(path); err != nil {
		return nil, fmt.Errorf("dial control socket: %w", err)
	}
	uc, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("dial control socket: %w", err)
	}
	return NewConn(uc)
}

// PeerPID is the pid of the process at the other end, from SO_PEERCRED.
func (c *Conn) PeerPID() int { return c.peer.PID }

// Peer is the full identity of the process at the other end.
func (c *Conn) Peer() Peer { return c.peer }

// SetReadDeadline bounds the next Recv calls (zero: no deadline). A deadline
// that expires in the middle of a frame breaks the connection, since the
// stream can no longer be re-synchronised.
func (c *Conn) SetReadDeadline(t time.Time) error { return c.uc.SetReadDeadline(t) }

// SetWriteDeadline bounds the next Send calls (zero: no deadline).
func (c *Conn) SetWriteDeadline(t time.Time) error { return c.uc.SetWriteDeadline(t) }

// Close closes the connection; blocked Recv and Send calls return. The fds
// of messages not yet received are released by the kernel.
func (c *Conn) Close() error {
	c.closeOnce.Do(func() {
		c.closeErr = c.uc.Close()
	})
	return c.closeErr
}

// Send writes one message. The fds (at most MaxFDs) travel as SCM_RIGHTS on
// the first sendmsg of the frame; the kernel duplicates them, so the caller
// keeps ownership of its fds. PoolExport and Sleep must carry one fd per
// pool; other messages none.
func (c *Conn) Send(env *frmpsv1.Envelope, fds []int) error {
	if len(fds) > MaxFDs {
		return fmt.Errorf("send %s: %d fds: %w (max %d)", MessageName(env), len(fds), ErrTooManyFDs, MaxFDs)
	}
	for _, fd := range fds {
		if fd < 0 {
			return fmt.Errorf("send %s: invalid fd %d", MessageName(env), fd)
		}
	}
	frame, err := Encode(env)
	if err != nil {
		return fmt.Errorf("send: %w", err)
	}
	if err := checkFDCount(env, len(fds)); err != nil {
		return fmt.Errorf("send: %w", err)
	}
	c.sendMu.Lock()
	defer c.sendMu.Unlock()
	if err := c.writeFrame(frame, fds); err != nil {
		return fmt.Errorf("send %s: %w", MessageName(env), err)
	}
	return nil
}

// writeFrame writes frame, attaching fds to the first sendmsg. Caller holds
// sendMu so frames never interleave.
func (c *Conn) writeFrame(frame []byte, fds []int) error {
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	for len(frame) > 0 {
		var n int
		var opErr error
		err := c.raw.Write(func(fd uintptr) bool {
			for {
				n, opErr = unix.SendmsgN(int(fd), frame, oob, nil, unix.MSG_NOSIGNAL)
				if opErr == unix.EINTR {
					continue
				}
				// EAGAIN: wait for the poller to report the socket writable.
				return opErr != unix.EAGAIN
			}
		})
		if err != nil {
			return err
		}
		if opErr != nil {
			return opErr
		}
		frame = frame[n:]
		oob = nil // fds go with the first chunk only
	}
	return nil
}

// Recv reads one message. Received fds are owned by the caller and have
// O_CLOEXEC set. It returns io.EOF when the peer closed the connection
// between messages. A message that fails to decode, or carries fds it does
// not announce, is refused with an error wrapping ErrProtocol and its fds are
// closed; errors that leave the stream out of step (bad length prefix,
// truncation) also break the connection for later calls.
func (c *Conn) Recv() (*frmpsv1.Envelope, []int, error) {
	c.recvMu.Lock()
	defer c.recvMu.Unlock()
	if c.broken != nil {
		return nil, nil, c.broken
	}
	r := frameReader{c: c}
	env, err := r.read()
	if err != nil {
		closeAll(r.fds)
		if r.outOfStep {
			c.broken = err
		}
		return nil, nil, err
	}
	return env, r.fds, nil
}

// frameReader accumulates one frame and the fds that arrive with it. It only
// ever asks recvmsg for the bytes of the current frame, so fds can never be
// attributed to a neighbouring message.
type frameReader struct {
	c         *Conn
	fds       []int
	truncFDs  bool // the kernel dropped fds (MSG_CTRUNC) or more than MaxFDs came
	consumed  int  // bytes of this frame read so far
	outOfStep bool // set when the stream cannot be re-synchronised
}

func (r *frameReader) read() (*frmpsv1.Envelope, error) {
	var hdr [headerLen]byte
	if err := r.fill(hdr[:]); err != nil {
		return nil, err
	}
	n := binary.LittleEndian.Uint32(hdr[:])
	if err := checkLength(n); err != nil {
		r.outOfStep = true
		return nil, err
	}
	// Grow the body as bytes arrive rather than trusting the prefix, so a
	// peer that announces 16 MiB and stalls does not pin 16 MiB.
	body := make([]byte, 0, min(int(n), 64<<10))
	for len(body) < int(n) {
		if len(body) == cap(body) {
			grown := make([]byte, len(body), min(int(n), 2*cap(body)))
			copy(grown, body)
			body = grown
		}
		got, err := r.recv(body[len(body):cap(body)])
		body = body[:len(body)+got]
		if err != nil {
			return nil, err
		}
	}
	if r.truncFDs {
		return nil, protoErr(ErrTooManyFDs, "more than %d fds arrived with one message", MaxFDs)
	}
	env, err := decodeBody(body)
	if err != nil {
		return nil, err
	}
	if err := checkFDCount(env, len(r.fds)); err != nil {
		return nil, err
	}
	return env, nil
}

// fill reads exactly len(p) bytes.
func (r *frameReader) fill(p []byte) error {
	for off := 0; off < len(p); {
		got, err := r.recv(p[off:])
		off += got
		if err != nil {
			return err
		}
	}
	return nil
}

// recv does one recvmsg into p, collecting any fds. It returns an error at
// EOF (io.EOF between frames, ErrTruncated inside one).
func (r *frameReader) recv(p []byte) (int, error) {
	c := r.c
	var n, oobn, flags int
	var opErr error
	err := c.raw.Read(func(fd uintptr) bool {
		for {
			// MSG_CMSG_CLOEXEC: fds must not leak into engines we exec later.
			n, oobn, flags, _, opErr = unix.Recvmsg(int(fd), p, c.oob, unix.MSG_CMSG_CLOEXEC)
			if opErr == unix.EINTR {
				continue
			}
			return opErr != unix.EAGAIN
		}
	})
	if err == nil {
		err = opErr
	}
	if err == nil && oobn > 0 {
		r.collectFDs(c.oob[:oobn])
	}
	if flags&unix.MSG_CTRUNC != 0 {
		r.truncFDs = true
	}
	if err != nil {
		if r.consumed > 0 {
			r.outOfStep = true
		}
		return 0, err
	}
	if n == 0 {
		if r.consumed == 0 {
			return 0, io.EOF
		}
		r.outOfStep = true
		return 0, fmt.Errorf("%w: %w: connection closed %d bytes into a frame: %w", ErrProtocol, ErrTruncated, r.consumed, io.ErrUnexpectedEOF)
	}
	r.consumed += n
	return n, nil
}

func (r *frameReader) collectFDs(oob []byte) {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		// The kernel wrote this buffer; a parse failure would mean fds we
		// cannot find to close. Record it as a refusal of the message.
		r.truncFDs = true
		return
	}
	for i := range msgs {
		if msgs[i].Header.Level != unix.SOL_SOCKET || msgs[i].Header.Type != unix.SCM_RIGHTS {
			continue
		}
		fds, err := unix.ParseUnixRights(&msgs[i])
		if err != nil {
			r.truncFDs = true
			continue
		}
		if len(r.fds)+len(fds) > MaxFDs {
			// Close at once rather than hold them: a hostile peer could
			// otherwise attach fds to every byte of a 16 MiB frame.
			closeAll(fds)
			r.truncFDs = true
			continue
		}
		r.fds = append(r.fds, fds...)
	}
}

// closeAll closes fds, ignoring errors: used on paths that are already
// failing, where the fds are ours to release.
func closeAll(fds []int) {
	for _, fd := range fds {
		_ = unix.Close(fd)
	}
}

// CloseFDs closes every fd in fds and returns the first error.
func CloseFDs(fds []int) error {
	var first error
	for _, fd := range fds {
		if err := unix.Close(fd); err != nil && first == nil {
			first = fmt.Errorf("close fd %d: %w", fd, err)
		}
	}
	return first
}
