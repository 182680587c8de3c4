package supervisor

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"testing/synctest"
	"time"

	"github.com/hashicorp/go-hclog"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
	"github.com/frmps/frmps/supervisor/failover"
)

func newRingConsumer(r Ring) *ringConsumer {
	rc := &ringConsumer{log: hclog.NewNullLogger(), every: time.Millisecond}
	if r != nil {
		rc.open(r, 1<<16)
	}
	return rc
}

// drain takes everything committed, and at most drainPolls polls from a
// writer that keeps committing.
func TestRingDrainIsBounded(t *testing.T) {
	r := &fakeRing{pending: 95}
	rc := newRingConsumer(r)
	rc.drain()
	if r.pending != 0 || r.polls != 11 { // 10 polls of up to 10, one finding none
		t.Fatalf("after drain: %d pending, %d polls; want 0 pending after 11 polls", r.pending, r.polls)
	}
	r.pending, r.polls = 10*drainPolls+5, 0
	rc.drain()
	if r.polls != drainPolls || r.pending != 5 {
		t.Fatalf("drain of a writer that keeps up: %d polls, %d left; want %d polls, 5 left", r.polls, r.pending, drainPolls)
	}
	if got := rc.lag.Load(); got != 5 {
		t.Fatalf("lag %d after drain, want 5", got)
	}
	newRingConsumer(nil).drain() // no ring: nothing to do, no panic
}

// poll backs off while the ring is idle and ends when its context does or
// the ring is closed.
func TestRingPollBacksOffAndEnds(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		r := &fakeRing{}
		rc := newRingConsumer(r)
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { defer close(done); rc.poll(ctx) }()
		time.Sleep(100 * time.Millisecond)
		synctest.Wait()
		r.mu.Lock()
		idle := r.polls
		r.pending = 25
		r.mu.Unlock()
		// Doubling up to 16 ms: 1+2+4+8+16, then every 16 ms.
		if idle < 5 || idle > 12 {
			t.Fatalf("%d polls in 100 ms of an idle ring at a 1 ms interval; want the interval to double up to 16 ms", idle)
		}
		time.Sleep(20 * time.Millisecond)
		synctest.Wait()
		r.mu.Lock()
		left := r.pending
		r.mu.Unlock()
		if left != 0 {
			t.Fatalf("%d records left after the poller's interval snapped back", left)
		}
		cancel()
		synctest.Wait()
		select {
		case <-done:
		default:
			t.Fatal("poll did not return when its context ended")
		}

		rc = newRingConsumer(r)
		done = make(chan struct{})
		go func() { defer close(done); rc.poll(context.Background()) }()
		rc.close()
		time.Sleep(time.Second)
		synctest.Wait()
		select {
		case <-done:
		default:
			t.Fatal("poll did not return once the ring was closed")
		}
	})
}

// snapshots fills in the ring's snapshot of each request it knows; close
// closes the ring and removes its file once.
func TestRingSnapshotsSizeAndClose(t *testing.T) {
	path := filepath.Join(t.TempDir(), "x.ring")
	if err := os.WriteFile(path, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	r := &fakeRing{snaps: map[uint64]*frmpsv1.RequestSnapshot{7: {TokenIds: []uint32{1, 2, 3}, NumPromptTokens: 2}}}
	rc := newRingConsumer(r)
	rc.path = path
	reqs := []*frmpsv1.ResumeRequest{{Key: 7, PromptTokenIds: []uint32{1, 2}}, {Key: 8}, nil}
	rc.snapshots(reqs)
	if got := reqs[0].GetSnapshot(); got == nil || len(got.GetTokenIds()) != 0 || len(got.GetOutputTokenIds()) != 1 {
		t.Fatalf("request 7's snapshot %v: want its prompt elided, one output token", got)
	}
	if reqs[1].GetSnapshot() != nil {
		t.Fatal("a request the ring does not know got a snapshot")
	}
	if n := rc.size(); n != 1 {
		t.Fatalf("size %d, want 1", n)
	}
	if !rc.close() || !r.closed {
		t.Fatal("close did not close the ring")
	}
	if _, err := os.Stat(path); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("ring file after close: %v", err)
	}
	if n := rc.size(); n != -1 {
		t.Fatalf("size %d after close, want -1", n)
	}
	if !rc.close() {
		t.Fatal("a second close failed")
	}
}

// The ring is polled in the background, and drained completely at a
// failover before the resume set is built.
func TestRingPolledAndDrainedAtFailover(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		w := newWorld()
		h := start(t, w, nil)
		w.ring.mu.Lock()
		before := w.ring.polls
		w.ring.mu.Unlock()
		time.Sleep(100 * time.Millisecond)
		synctest.Wait()
		w.ring.mu.Lock()
		polled := w.ring.polls - before
		w.ring.pending = 1000 // more than the poller can take in one go
		w.ring.mu.Unlock()
		if polled == 0 || polled > 200 {
			t.Fatalf("%d polls in 100ms of idle ring (want adaptive, > 0)", polled)
		}
		act, _ := h.roles()
		act.Kill()
		synctest.Wait()
		h.wantState(failover.ServingReady)
		w.ring.mu.Lock()
		left := w.ring.pending
		w.ring.mu.Unlock()
		if left > 1000-64*10 { // the failover's drain took up to 64 polls
			t.Fatalf("%d records left after the failover's drain", left)
		}
		h.stop()
	})
}
