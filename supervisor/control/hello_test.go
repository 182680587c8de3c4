package control

import (
	"errors"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
)

func layout() []*frmpsv1.Pool {
	return []*frmpsv1.Pool{
		{Tag: "weights", Index: 0, Size: 8192, Backend: BackendHostSHM},
		{Tag: "kv_cache", Index: 0, Size: 4096, Backend: BackendHostSHM},
	}
}

func TestValidateHello(t *testing.T) {
	good := func() *frmpsv1.Hello {
		return &frmpsv1.Hello{ProtocolVersion: ProtocolVersion, Role: frmpsv1.Role_ROLE_STANDBY, Pid: 1234, Model: "tiny", Pools: layout()}
	}
	want := HelloExpect{Role: frmpsv1.Role_ROLE_STANDBY, PID: 1234, Model: "tiny", Pools: layout()}
	cases := []struct {
		name   string
		mutate func(*frmpsv1.Hello, *HelloExpect)
		errSay string // "" = accepted
		is     error
	}{
		{"good", func(*frmpsv1.Hello, *HelloExpect) {}, "", nil},
		{"any layout", func(h *frmpsv1.Hello, w *HelloExpect) { w.Pools = nil; h.Pools = h.Pools[:1] }, "", nil},
		{"no checks on pid and model", func(h *frmpsv1.Hello, w *HelloExpect) { w.PID = 0; w.Model = ""; h.Model = "x" }, "", nil},
		{"version 0", func(h *frmpsv1.Hello, _ *HelloExpect) { h.ProtocolVersion = 0 },
			"engine speaks PROTOCOL_VERSION_UNSPECIFIED (0), supervisor speaks PROTOCOL_VERSION_1 (1)", ErrVersionMismatch},
		{"version from the future", func(h *frmpsv1.Hello, _ *HelloExpect) { h.ProtocolVersion = 7 },
			"engine speaks 7 (7), supervisor speaks PROTOCOL_VERSION_1 (1)", ErrVersionMismatch},
		{"wrong role", func(h *frmpsv1.Hello, _ *HelloExpect) { h.Role = frmpsv1.Role_ROLE_ACTIVE },
			"role ROLE_ACTIVE, it was launched as ROLE_STANDBY", nil},
		{"no role", func(h *frmpsv1.Hello, _ *HelloExpect) { h.Role = 0 }, "role not set", nil},
		{"wrong pid", func(h *frmpsv1.Hello, _ *HelloExpect) { h.Pid = 99 }, "pid 99, the launched process is pid 1234", nil},
		{"no pid", func(h *frmpsv1.Hello, w *HelloExpect) { h.Pid = 0; w.PID = 0 }, "invalid pid 0", nil},
		{"wrong model", func(h *frmpsv1.Hello, _ *HelloExpect) { h.Model = "big" }, `model "big", want "tiny"`, nil},
		{"fewer pools", func(h *frmpsv1.Hello, _ *HelloExpect) { h.Pools = h.Pools[:1] }, "1 pools, want 2", ErrLayoutMismatch},
		{"other size", func(h *frmpsv1.Hello, _ *HelloExpect) { h.Pools[1].Size = 4097 },
			"pool 1 is kv_cache/0 4097 bytes on host-shm, want kv_cache/0 4096 bytes", ErrLayoutMismatch},
		{"other backend", func(h *frmpsv1.Hello, _ *HelloExpect) { h.Pools[0].Backend = BackendCUDAVMM }, "on cuda-vmm", ErrLayoutMismatch},
		{"other order", func(h *frmpsv1.Hello, _ *HelloExpect) { h.Pools[0], h.Pools[1] = h.Pools[1], h.Pools[0] }, "pool 0 is kv_cache", ErrLayoutMismatch},
		{"duplicate pool", func(h *frmpsv1.Hello, w *HelloExpect) { w.Pools = nil; h.Pools[1].Tag = "weights" }, "both weights/0", nil},
		{"zero size", func(h *frmpsv1.Hello, w *HelloExpect) { w.Pools = nil; h.Pools[0].Size = 0 }, "size 0", nil},
		{"no tag", func(h *frmpsv1.Hello, w *HelloExpect) { w.Pools = nil; h.Pools[0].Tag = "" }, "no tag", nil},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h, w := good(), want
			w.Pools = layout()
			tc.mutate(h, &w)
			err := ValidateHello(h, w)
			if tc.errSay == "" {
				if err != nil {
					t.Fatalf("refused: %v", err)
				}
				return
			}
			if err == nil {
				t.Fatal("accepted")
			}
			if !strings.Contains(err.Error(), tc.errSay) {
				t.Fatalf("error %q does not say %q", err, tc.errSay)
			}
			if tc.is != nil && !errors.Is(err, tc.is) {
				t.Fatalf("error %q does not wrap %v", err, tc.is)
			}
		})
	}
	if err := ValidateHello(nil, want); err == nil {
		t.Fatal("nil Hello accepted")
	}
}

func fdIsOpen(fd int) bool {
	_, err := unix.FcntlInt(uintptr(fd), unix.F_GETFD, 0)
	return err == nil
}

// newPoolFDs creates one memfd per pool of the layout; the broker owns them.
func newPoolFDs(t *testing.T, pools []*frmpsv1.Pool) []int {
	t.Helper()
	fds := make([]int, len(pools))
	for i, p := range pools {
		fd, err := unix.MemfdCreate("pool", unix.MFD_CLOEXEC)
		if err != nil {
			t.Fatal(err)
		}
		if err := unix.Ftruncate(fd, int64(p.GetSize())); err != nil {
			t.Fatal(err)
		}
		fds[i] = fd
	}
	return fds
}

func TestBrokerOwnershipAndLayout(t *testing.T) {
	before := openFDs(t)
	b := NewBroker()
	if b.Pools() != nil || len(b.FDs()) != 0 {
		t.Fatal("new broker is not empty")
	}
	if _, _, ok := b.SleepMessage(1); ok {
		t.Fatal("SleepMessage before any Put")
	}

	first := newPoolFDs(t, layout())
	if err := b.Put(layout(), first); err != nil {
		t.Fatalf("Put: %v", err)
	}
	if err := SameLayout(layout(), b.Pools()); err != nil {
		t.Fatalf("Pools: %v", err)
	}
	// Pools is a copy: changing it does not change the broker.
	b.Pools()[0].Size = 1
	if b.Pools()[0].GetSize() != 8192 {
		t.Fatal("Pools returned the broker's own messages")
	}

	// A different layout is refused and its fds are closed.
	other := layout()
	other[1].Size = 8192
	otherFDs := newPoolFDs(t, other)
	if err := b.Put(other, otherFDs); !errors.Is(err, ErrLayoutMismatch) {
		t.Fatalf("Put of another layout: %v", err)
	}
	for _, fd := range otherFDs {
		if fdIsOpen(fd) {
			t.Fatalf("refused fd %d left open", fd)
		}
	}
	for _, fd := range first {
		if !fdIsOpen(fd) {
			t.Fatalf("held fd %d closed by a refused Put", fd)
		}
	}

	// The same layout again replaces the fds and closes the old ones.
	second := newPoolFDs(t, layout())
	if err := b.Put(layout(), second); err != nil {
		t.Fatalf("second Put of the same layout: %v", err)
	}
	for _, fd := range first {
		if fdIsOpen(fd) {
			t.Fatalf("replaced fd %d left open", fd)
		}
	}
	env, fds, ok := b.SleepMessage(3)
	if !ok || env.GetId() != 3 || SameLayout(layout(), env.GetSleep().GetPools()) != nil || len(fds) != 2 || fds[0] != second[0] {
		t.Fatalf("SleepMessage: %v %v %v", env, fds, ok)
	}

	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	if err := b.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	for _, fd := range second {
		if fdIsOpen(fd) {
			t.Fatalf("fd %d open after Close", fd)
		}
	}
	late := newPoolFDs(t, layout())
	if err := b.Put(layout(), late); !errors.Is(err, ErrBrokerClosed) {
		t.Fatalf("Put after Close: %v", err)
	}
	if after := openFDs(t); after != before {
		t.Fatalf("fd leak: %d before, %d after", before, after)
	}
}

func TestBrokerPutRefusals(t *testing.T) {
	before := openFDs(t)
	cases := []struct {
		name  string
		pools func() []*frmpsv1.Pool
		fds   func(t *testing.T) []int
		say   string
	}{
		{"count mismatch", layout, func(t *testing.T) []int {
			fds := newPoolFDs(t, layout())
			unix.Close(fds[1])
			return fds[:1]
		}, "2 pools but 1 fds"},
		{"empty", func() []*frmpsv1.Pool { return nil }, func(*testing.T) []int { return nil }, "empty pool layout"},
		{"file smaller than pool", layout, func(t *testing.T) []int {
			small := layout()
			small[0].Size = 10
			return newPoolFDs(t, small)
		}, "file is 10 bytes, pool is 8192"},
		{"closed fd", layout, func(t *testing.T) []int {
			fds := newPoolFDs(t, layout())
			unix.Close(fds[1])
			return fds
		}, "bad file descriptor"},
		{"same fd twice", layout, func(t *testing.T) []int {
			fds := newPoolFDs(t, layout()[:1])
			return []int{fds[0], fds[0]}
		}, "given twice"},
		{"bad layout", func() []*frmpsv1.Pool {
			l := layout()
			l[1].Backend = ""
			return l
		}, func(t *testing.T) []int { return newPoolFDs(t, layout()) }, "no backend"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			b := NewBroker()
			defer b.Close()
			fds := tc.fds(t)
			err := b.Put(tc.pools(), fds)
			if err == nil || !strings.Contains(err.Error(), tc.say) {
				t.Fatalf("Put: %v, want an error saying %q", err, tc.say)
			}
			for _, fd := range fds {
				if fdIsOpen(fd) {
					t.Fatalf("fd %d left open by a refused Put", fd)
				}
			}
			if b.Pools() != nil {
				t.Fatal("refused Put left a layout behind")
			}
		})
	}
	if after := openFDs(t); after != before {
		t.Fatalf("fd leak: %d before, %d after", before, after)
	}
}
