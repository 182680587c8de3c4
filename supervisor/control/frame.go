// Package control implements the supervisor side (and, for tests, the engine
// side) of the frmps control protocol: length-prefixed protobuf Envelopes on a
// unix stream socket, with pool file descriptors passed as SCM_RIGHTS.
//
// The wire format is specified once, in proto/frmps/v1/control.proto:
//
//	uint32 little-endian length N (1 <= N <= MaxFrame) | N bytes: an Envelope
package control

import (
	"encoding/binary"
	"errors"
	"fmt"

	"google.golang.org/protobuf/proto"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
)

// MaxFrame is the largest Envelope accepted or sent, in bytes. A Resume with
// thousands of requests fits comfortably; anything bigger is a broken or
// hostile peer, and refusing it bounds the memory one peer can make us hold.
const MaxFrame = 16 << 20

// MaxFDs bounds the file descriptors accepted with one message. It stays
// below the kernel's SCM_MAX_FD (253) so the limit is ours to report, and a
// pool layout is a handful of allocations (weights, KV cache) in practice.
const MaxFDs = 128

// headerLen is the size of the length prefix.
const headerLen = 4

// ErrProtocol is wrapped by every error caused by what the peer sent (bad
// framing, undecodable Envelope, fds where none belong), as opposed to I/O
// errors on the socket.
var ErrProtocol = errors.New("control protocol violation")

// ErrFrameTooLarge is wrapped when a length prefix exceeds MaxFrame.
var ErrFrameTooLarge = errors.New("frame too large")

// ErrEmptyFrame is wrapped when a length prefix is zero.
var ErrEmptyFrame = errors.New("empty frame")

// ErrTruncated is wrapped when a frame ends before its announced length.
var ErrTruncated = errors.New("truncated frame")

// ErrTooManyFDs is wrapped when a message carries more than MaxFDs fds.
var ErrTooManyFDs = errors.New("too many file descriptors")

// protoErr wraps a protocol error so that both ErrProtocol and the specific
// sentinel match with errors.Is.
func protoErr(specific error, format string, args ...any) error {
	return fmt.Errorf("%w: %w: %s", ErrProtocol, specific, fmt.Sprintf(format, args...))
}

// checkLength validates a length prefix.
func checkLength(n uint32) error {
	if n == 0 {
		return protoErr(ErrEmptyFrame, "length prefix is 0")
	}
	if n > MaxFrame {
		return protoErr(ErrFrameTooLarge, "length prefix %d exceeds the maximum of %d bytes", n, MaxFrame)
	}
	return nil
}

// Encode marshals env into one frame: the length prefix followed by the
// Envelope bytes.
func Encode(env *frmpsv1.Envelope) ([]byte, error) {
	if env == nil {
		return nil, errors.New("encode envelope: nil envelope")
	}
	if env.GetMsg() == nil {
		return nil, errors.New("encode envelope: no message set")
	}
	size := proto.Size(env)
	if size > MaxFrame {
		return nil, fmt.Errorf("encode envelope: %d bytes exceeds the maximum of %d: %w", size, MaxFrame, ErrFrameTooLarge)
	}
	buf := make([]byte, headerLen, headerLen+size)
	buf, err := proto.MarshalOptions{}.MarshalAppend(buf, env)
	if err != nil {
		return nil, fmt.Errorf("encode envelope: %w", err)
	}
	binary.LittleEndian.PutUint32(buf[:headerLen], uint32(len(buf)-headerLen))
	return buf, nil
}

// Decode parses one complete frame (length prefix included). It never panics
// on any input; every rejection wraps ErrProtocol.
func Decode(frame []byte) (*frmpsv1.Envelope, error) {
	if len(frame) < headerLen {
		return nil, protoErr(ErrTruncated, "%d bytes is shorter than the %d-byte length prefix", len(frame), headerLen)
	}
	n := binary.LittleEndian.Uint32(frame[:headerLen])
	if err := checkLength(n); err != nil {
		return nil, err
	}
	body := frame[headerLen:]
	if uint64(len(body)) < uint64(n) {
		return nil, protoErr(ErrTruncated, "length prefix says %d bytes, frame has %d", n, len(body))
	}
	if uint64(len(body)) > uint64(n) {
		return nil, fmt.Errorf("%w: %d trailing bytes after a %d-byte frame", ErrProtocol, uint64(len(body))-uint64(n), n)
	}
	return decodeBody(body)
}

// decodeBody parses the Envelope bytes of a frame whose length was checked.
func decodeBody(body []byte) (*frmpsv1.Envelope, error) {
	env := &frmpsv1.Envelope{}
	if err := proto.Unmarshal(body, env); err != nil {
		return nil, fmt.Errorf("%w: decode envelope: %w", ErrProtocol, err)
	}
	if env.GetMsg() == nil {
		// Garbage often parses as an Envelope made only of unknown fields;
		// a message of a kind we do not know is equally unusable.
		return nil, fmt.Errorf("%w: envelope carries no known message", ErrProtocol)
	}
	return env, nil
}

// MessageName names the message an Envelope carries, for logs and errors.
func MessageName(env *frmpsv1.Envelope) string {
	if env == nil || env.GetMsg() == nil {
		return "none"
	}
	switch env.GetMsg().(type) {
	case *frmpsv1.Envelope_Hello:
		return "Hello"
	case *frmpsv1.Envelope_PoolExport:
		return "PoolExport"
	case *frmpsv1.Envelope_Ready:
		return "Ready"
	case *frmpsv1.Envelope_Reply:
		return "Reply"
	case *frmpsv1.Envelope_Fault:
		return "Fault"
	case *frmpsv1.Envelope_Heartbeat:
		return "Heartbeat"
	case *frmpsv1.Envelope_Welcome:
		return "Welcome"
	case *frmpsv1.Envelope_Sleep:
		return "Sleep"
	case *frmpsv1.Envelope_Resume:
		return "Resume"
	case *frmpsv1.Envelope_Shutdown:
		return "Shutdown"
	case *frmpsv1.Envelope_Ping:
		return "Ping"
	default:
		return fmt.Sprintf("%T", env.GetMsg())
	}
}

// expectedFDs returns how many fds must accompany env: one per pool for the
// messages that hand over pools, none for every other message.
func expectedFDs(env *frmpsv1.Envelope) int {
	switch m := env.GetMsg().(type) {
	case *frmpsv1.Envelope_PoolExport:
		return len(m.PoolExport.GetPools())
	case *frmpsv1.Envelope_Sleep:
		return len(m.Sleep.GetPools())
	default:
		return 0
	}
}

// checkFDCount verifies that a message carries exactly the fds it announces.
func checkFDCount(env *frmpsv1.Envelope, got int) error {
	want := expectedFDs(env)
	if got != want {
		return fmt.Errorf("%w: %s announces %d pool fds, %d arrived", ErrProtocol, MessageName(env), want, got)
	}
	return nil
}
