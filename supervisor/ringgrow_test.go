package supervisor

import (
	"os"
	"testing"
	"testing/synctest"

	"github.com/frmps/frmps/ringbuf"
	"github.com/frmps/frmps/supervisor/failover"
)

// ringsMade is every ring the deployment created, in order.
func (w *fakeWorld) ringsMade() []*fakeRing {
	w.mu.Lock()
	defer w.mu.Unlock()
	return append([]*fakeRing(nil), w.rings...)
}

// The first active's Hello says how large its largest snapshot can be: a ring
// the supervisor sized itself (not Config.RingFixed) grows to hold it before the Welcome
// names it, at the same path; a later active (the ring in use) changes nothing.
func TestRingGrowsForTheFirstActive(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		w := newWorld()
		w.behave = func(role failover.Role, nth int) behavior {
			if role == failover.Active && nth == 0 {
				return behavior{ringRecord: 3 << 20}
			}
			return behavior{ringRecord: 100 << 20}
		}
		h := start(t, w, func(c *Config) { c.NoFailback = true; c.RingCapacity = 1 << 16 })
		h.wantState(failover.ServingReady)
		rings := w.ringsMade()
		if len(rings) != 2 || rings[0].capacity != 1<<16 || rings[1].capacity != ringbuf.CapacityFor(3<<20) || rings[1].capacity != 16<<20 {
			t.Fatalf("rings created: %+v", rings)
		}
		if !rings[0].closed || rings[1].closed {
			t.Fatalf("the first ring must be closed, the grown one open: %v %v", rings[0].closed, rings[1].closed)
		}
		path := h.s.ring.path
		if _, err := os.Stat(path); err != nil {
			t.Fatalf("the ring's path: %v", err)
		}
		if _, err := os.Stat(path + ".grow"); !os.IsNotExist(err) {
			t.Fatalf("the new ring's own name must be gone: %v", err)
		}
		if h.s.ring.capacity != 16<<20 {
			t.Fatalf("consumer capacity %d", h.s.ring.capacity)
		}
		w.liveRole(failover.Active).Kill()
		synctest.Wait()
		h.wantState(failover.ServingReady)
		if n := len(w.ringsMade()); n != 2 || h.s.ring.capacity != 16<<20 {
			t.Fatalf("a later active grew the ring in use: %d rings, capacity %d", n, h.s.ring.capacity)
		}
		h.stop()
	})
}

// With RingFixed (a capacity given), or when the record already fits, the
// ring stays as made.
func TestRingStaysWhenFixedOrBigEnough(t *testing.T) {
	for _, tc := range []struct {
		name   string
		fixed  bool
		record uint64
	}{{"fixed", true, 3 << 20}, {"fits", false, 1 << 10}, {"unknown", false, 0}} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				w := newWorld()
				w.behave = func(failover.Role, int) behavior { return behavior{ringRecord: tc.record} }
				h := start(t, w, func(c *Config) { c.NoFailback = true; c.RingCapacity = 1 << 16; c.RingFixed = tc.fixed })
				h.wantState(failover.ServingReady)
				if n := len(w.ringsMade()); n != 1 || h.s.ring.capacity != 1<<16 {
					t.Fatalf("%d rings, capacity %d", n, h.s.ring.capacity)
				}
				h.stop()
			})
		})
	}
}

// CapacityFor is the Python tracker's rule (ring/layout.py ring_capacity_needed):
// a record of up to a quarter of the ring, header included.
func TestCapacityFor(t *testing.T) {
	for record, want := range map[uint64]uint64{0: 4096, 960: 4096, 961: 8192, 8114040: 33554432, 42459616: 268435456} {
		if got := ringbuf.CapacityFor(record); got != want {
			t.Errorf("CapacityFor(%d) = %d, want %d", record, got, want)
		}
	}
}
