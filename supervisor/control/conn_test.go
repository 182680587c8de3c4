package control

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
)

func poolExport(sizes ...uint64) *frmpsv1.Envelope {
	pools := make([]*frmpsv1.Pool, len(sizes))
	for i, s := range sizes {
		pools[i] = &frmpsv1.Pool{Tag: "kv_cache", Index: uint32(i), Size: s, Backend: BackendHostSHM}
	}
	return &frmpsv1.Envelope{Id: 11, Msg: &frmpsv1.Envelope_PoolExport{PoolExport: &frmpsv1.PoolExport{Pools: pools}}}
}

func ping(id uint64) *frmpsv1.Envelope {
	return &frmpsv1.Envelope{Id: id, Msg: &frmpsv1.Envelope_Ping{Ping: &frmpsv1.Ping{}}}
}

// The fd that arrives refers to the same file: bytes written through the
// sender's fd are read back through the received one, and vice versa.
func TestSendRecvFDsSameFile(t *testing.T) {
	a, b := connPair(t)
	checkNoFDLeak(t)

	fd1, fd2 := memfd(t, 4096), memfd(t, 8192)
	if _, err := unix.Pwrite(fd1, []byte("written by the sender"), 100); err != nil {
		t.Fatal(err)
	}
	if err := a.Send(poolExport(4096, 8192), []int{fd1, fd2}); err != nil {
		t.Fatalf("Send: %v", err)
	}
	env, fds, err := b.Recv()
	if err != nil {
		t.Fatalf("Recv: %v", err)
	}
	defer CloseFDs(fds)
	if len(fds) != 2 || env.GetPoolExport() == nil || env.GetId() != 11 {
		t.Fatalf("got %v with %d fds", env, len(fds))
	}
	for _, fd := range fds {
		flags, err := unix.FcntlInt(uintptr(fd), unix.F_GETFD, 0)
		if err != nil || flags&unix.FD_CLOEXEC == 0 {
			t.Errorf("received fd %d: flags %#x err %v, want FD_CLOEXEC", fd, flags, err)
		}
	}
	buf := make([]byte, 21)
	if _, err := unix.Pread(fds[0], buf, 100); err != nil {
		t.Fatal(err)
	}
	if string(buf) != "written by the sender" {
		t.Fatalf("received fd reads %q", buf)
	}
	if _, err := unix.Pwrite(fds[1], []byte("reply"), 8000); err != nil {
		t.Fatal(err)
	}
	buf = buf[:5]
	if _, err := unix.Pread(fd2, buf, 8000); err != nil {
		t.Fatal(err)
	}
	if string(buf) != "reply" {
		t.Fatalf("sender's fd reads %q after a write through the received fd", buf)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fds[1], &st); err != nil || st.Size != 8192 {
		t.Fatalf("received fd size %d err %v", st.Size, err)
	}
}

func TestRecvEOFBetweenFramesAndTruncated(t *testing.T) {
	a, b := connPair(t)
	if err := a.Send(ping(1), nil); err != nil {
		t.Fatal(err)
	}
	a.Close()
	if env, _, err := b.Recv(); err != nil || env.GetId() != 1 {
		t.Fatalf("Recv = %v, %v", env, err)
	}
	if _, _, err := b.Recv(); err != io.EOF {
		t.Fatalf("Recv after peer close: %v, want io.EOF", err)
	}

	c, raw := rawPair(t)
	frame, _ := Encode(ping(2))
	unix.Write(raw, frame[:len(frame)-1])
	unix.Close(raw)
	_, _, err := c.Recv()
	if !errors.Is(err, ErrTruncated) || !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Fatalf("Recv of a truncated frame: %v, want ErrTruncated", err)
	}
}

func TestRecvAfterOwnCloseFails(t *testing.T) {
	_, b := connPair(t)
	done := make(chan error, 1)
	go func() { _, _, err := b.Recv(); done <- err }()
	time.Sleep(10 * time.Millisecond) // let Recv block; the test holds either way
	b.Close()
	select {
	case err := <-done:
		if err == nil {
			t.Fatal("Recv returned no error after Close")
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Recv still blocked after Close")
	}
}

// sendRaw writes bytes with optional SCM_RIGHTS, bypassing Send's checks.
func sendRaw(t *testing.T, fd int, data []byte, fds []int) {
	t.Helper()
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	if err := unix.Sendmsg(fd, data, oob, nil, 0); err != nil {
		t.Fatalf("sendmsg: %v", err)
	}
}

func TestHostileFrames(t *testing.T) {
	good, _ := Encode(ping(99))
	garbage := []byte{0x0f, 1, 2, 3, 4, 5, 6, 7}
	cases := []struct {
		name     string
		data     []byte
		nfds     int
		specific error
		inStep   bool // the stream stays usable: the next good frame is received
	}{
		{"huge length", frameOf(0xfffffff0, nil), 1, ErrFrameTooLarge, false},
		{"zero length", frameOf(0, nil), 0, ErrEmptyFrame, false},
		{"garbage with fds", frameOf(uint32(len(garbage)), garbage), 2, nil, true},
		{"too many fds", good, MaxFDs + 20, ErrTooManyFDs, true},
		{"fds on a ping", good, 1, nil, true},
		{"fewer fds than pools", mustEncode(t, poolExport(4096, 4096)), 1, nil, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c, raw := rawPair(t)
			pool := memfd(t, 4096)
			checkNoFDLeak(t)
			fds := make([]int, tc.nfds)
			for i := range fds {
				fds[i] = pool
			}
			sendRaw(t, raw, tc.data, fds)
			sendRaw(t, raw, good, nil)
			env, got, err := c.Recv()
			if err == nil {
				CloseFDs(got)
				t.Fatalf("Recv accepted %v", env)
			}
			if got != nil {
				t.Errorf("Recv returned fds %v with an error", got)
			}
			if !errors.Is(err, ErrProtocol) || (tc.specific != nil && !errors.Is(err, tc.specific)) {
				t.Fatalf("error %q: want ErrProtocol and %v", err, tc.specific)
			}
			env, got, err = c.Recv()
			if tc.inStep {
				if err != nil || env.GetId() != 99 || len(got) != 0 {
					t.Fatalf("next frame: %v %v %v, want ping 99", env, got, err)
				}
			} else if err == nil {
				t.Fatalf("stream out of step but the next Recv returned %v", env)
			}
		})
	}
}

func mustEncode(t *testing.T, env *frmpsv1.Envelope) []byte {
	t.Helper()
	b, err := Encode(env)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// fds sent with a frame are attributed to that frame even when the reader
// is slow and several frames are queued.
func TestFDsStayWithTheirFrame(t *testing.T) {
	a, b := connPair(t)
	fd := memfd(t, 4096)
	checkNoFDLeak(t)
	if err := a.Send(ping(1), nil); err != nil {
		t.Fatal(err)
	}
	if err := a.Send(poolExport(4096), []int{fd}); err != nil {
		t.Fatal(err)
	}
	if err := a.Send(ping(3), nil); err != nil {
		t.Fatal(err)
	}
	for _, want := range []struct {
		name string
		nfds int
	}{{"Ping", 0}, {"PoolExport", 1}, {"Ping", 0}} {
		env, fds, err := b.Recv()
		if err != nil {
			t.Fatal(err)
		}
		if MessageName(env) != want.name || len(fds) != want.nfds {
			t.Fatalf("got %s with %d fds, want %s with %d", MessageName(env), len(fds), want.name, want.nfds)
		}
		CloseFDs(fds)
	}
}

func TestSendRefuses(t *testing.T) {
	a, _ := connPair(t)
	fd := memfd(t, 4096)
	if err := a.Send(ping(1), []int{fd}); !errors.Is(err, ErrProtocol) {
		t.Errorf("Send of a Ping with an fd: %v", err)
	}
	if err := a.Send(poolExport(1, 2), []int{fd}); err == nil {
		t.Error("Send of 2 pools with 1 fd succeeded")
	}
	if err := a.Send(poolExport(1), []int{-1}); err == nil {
		t.Error("Send of fd -1 succeeded")
	}
	if err := a.Send(nil, nil); err == nil {
		t.Error("Send(nil) succeeded")
	}
	many := make([]int, MaxFDs+1)
	if err := a.Send(ping(1), many); !errors.Is(err, ErrTooManyFDs) {
		t.Errorf("Send with %d fds: %v", len(many), err)
	}
}

// Concurrent senders never interleave frames, including frames large
// enough to need several sendmsg calls.
func TestConcurrentSend(t *testing.T) {
	a, b := connPair(t)
	const senders, each = 8, 20
	big := strings.Repeat("d", 300<<10)
	var wg sync.WaitGroup
	for s := range senders {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range each {
				env := &frmpsv1.Envelope{Id: uint64(s*1000 + i), Msg: &frmpsv1.Envelope_Fault{Fault: &frmpsv1.Fault{Detail: big}}}
				if err := a.Send(env, nil); err != nil {
					t.Errorf("Send: %v", err)
					return
				}
			}
		}()
	}
	seen := map[uint64]bool{}
	for range senders * each {
		env, _, err := b.Recv()
		if err != nil {
			t.Fatalf("Recv after %d messages: %v", len(seen), err)
		}
		if env.GetFault().GetDetail() != big || seen[env.GetId()] {
			t.Fatalf("corrupt or duplicate message id %d", env.GetId())
		}
		seen[env.GetId()] = true
	}
	wg.Wait()
}

func TestReadDeadline(t *testing.T) {
	_, b := connPair(t)
	b.SetReadDeadline(time.Now().Add(20 * time.Millisecond))
	_, _, err := b.Recv()
	if err == nil || !strings.Contains(err.Error(), "timeout") {
		t.Fatalf("Recv with an expired deadline: %v", err)
	}
}

func TestLargeFrameRoundTrip(t *testing.T) {
	a, b := connPair(t)
	detail := bytes.Repeat([]byte{'z'}, MaxFrame-64)
	env := &frmpsv1.Envelope{Id: 5, Msg: &frmpsv1.Envelope_Fault{Fault: &frmpsv1.Fault{Detail: string(detail)}}}
	errc := make(chan error, 1)
	go func() { errc <- a.Send(env, nil) }()
	got, _, err := b.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	if !proto.Equal(got, env) {
		t.Fatal("large frame changed in transit")
	}
	if n := binary.LittleEndian.Uint32(mustEncode(t, env)); n > MaxFrame {
		t.Fatalf("test frame is %d bytes, over the limit", n)
	}
}

// BenchmarkPingRoundTrip measures one command and its reply over a Conn.
func BenchmarkPingRoundTrip(b *testing.B) {
	a, c := connPair(b)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			env, _, err := c.Recv()
			if err != nil {
				return
			}
			if err := c.Send(&frmpsv1.Envelope{Id: env.GetId(), Msg: &frmpsv1.Envelope_Reply{Reply: &frmpsv1.Reply{Ok: true}}}, nil); err != nil {
				return
			}
		}
	}()
	for i := 0; b.Loop(); i++ {
		if err := a.Send(ping(uint64(i)), nil); err != nil {
			b.Fatal(err)
		}
		if _, _, err := a.Recv(); err != nil {
			b.Fatal(err)
		}
	}
	a.Close()
	<-done
}

// BenchmarkPoolExportWithFDs measures sending 8 pool fds and receiving them.
func BenchmarkPoolExportWithFDs(b *testing.B) {
	a, c := connPair(b)
	sizes := make([]uint64, 8)
	fds := make([]int, 8)
	for i := range fds {
		sizes[i] = 4096
		fds[i] = memfd(b, 4096)
	}
	env := poolExport(sizes...)
	for b.Loop() {
		if err := a.Send(env, fds); err != nil {
			b.Fatal(err)
		}
		_, got, err := c.Recv()
		if err != nil {
			b.Fatal(err)
		}
		CloseFDs(got)
	}
}

// fds attached to every chunk of one frame are bounded and all closed.
func TestFDsSpreadOverAFrame(t *testing.T) {
	c, raw := rawPair(t)
	pool := memfd(t, 4096)
	checkNoFDLeak(t)
	frame := mustEncode(t, ping(1))
	fds := make([]int, 100)
	for i := range fds {
		fds[i] = pool
	}
	// One byte per sendmsg, each with 100 fds: 100 x len(frame) in total.
	for i := range frame {
		sendRaw(t, raw, frame[i:i+1], fds)
	}
	_, got, err := c.Recv()
	if !errors.Is(err, ErrTooManyFDs) || got != nil {
		t.Fatalf("Recv: %v (fds %v), want ErrTooManyFDs", err, got)
	}
}
