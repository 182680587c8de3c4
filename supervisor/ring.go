package supervisor

import (
	"context"
	"errors"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/go-hclog"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
	"github.com/frmps/frmps/ringbuf"
)

// ringConsumer reads the forward-state ring into the request snapshots a
// Resume carries. poll runs on its own goroutine for the life of the loop;
// drain is the loop's, at a failover; snapshots and size answer the resume
// and Status. All hold mu; lag and resyncs are read without it (metrics).
type ringConsumer struct {
	log   hclog.Logger
	every time.Duration // Config.PollInterval: the fastest poll
	// path is the ring file (set by setup before the loop starts; "" when
	// none was created).
	path string

	mu       sync.Mutex
	r        Ring   // nil before setup and after close
	capacity uint64 // r's

	lag     atomic.Uint64
	resyncs atomic.Uint64
}

// open makes r, of the given capacity, the ring consumed (Status may already
// read from another goroutine).
func (rc *ringConsumer) open(r Ring, capacity uint64) {
	rc.mu.Lock()
	rc.r, rc.capacity = r, capacity
	rc.mu.Unlock()
}

// fit grows the ring, before any engine has attached to it, so that a record
// of recordBytes fits (ringbuf.CapacityFor), up to limit: a new ring beside the
// old one (openRing), renamed over it, so that its path (the launch record's,
// the Welcome's) stays. A smaller need, or a failure, leaves the ring as it is;
// the engine then says that its largest snapshots are published in part.
func (rc *ringConsumer) fit(openRing func(path string, capacity uint64) (Ring, error), recordBytes, limit uint64) {
	need := min(ringbuf.CapacityFor(recordBytes), limit)
	rc.mu.Lock()
	defer rc.mu.Unlock()
	if rc.r == nil || rc.path == "" || recordBytes == 0 || need <= rc.capacity {
		return
	}
	tmp := rc.path + ".grow"
	_ = os.Remove(tmp) // a leftover of a supervisor killed right here
	r, err := openRing(tmp, need)
	if err == nil {
		if err = os.Rename(tmp, rc.path); err != nil {
			_ = r.Close()
			_ = os.Remove(tmp)
		}
	}
	if err != nil {
		rc.log.Warn("ring: could not grow it for the active's largest snapshot", "from", rc.capacity, "to", need, "error", err)
		return
	}
	if err := rc.r.Close(); err != nil {
		rc.log.Warn("close ring", "error", err)
	}
	rc.log.Info("ring grown to hold the active's largest snapshot", "record_bytes", recordBytes, "from", rc.capacity,
		"capacity", need, "capped", need == limit && ringbuf.CapacityFor(recordBytes) > limit)
	rc.r, rc.capacity = r, need
}

// close closes the ring and removes its file; false when the file could
// not be removed (what the launch record names is not gone). Idempotent.
func (rc *ringConsumer) close() (removed bool) {
	rc.mu.Lock()
	if rc.r != nil {
		if err := rc.r.Close(); err != nil {
			rc.log.Warn("close ring", "error", err)
		}
		rc.r = nil
	}
	rc.mu.Unlock()
	if rc.path != "" {
		if err := os.Remove(rc.path); err != nil && !errors.Is(err, os.ErrNotExist) {
			rc.log.Warn("remove ring", "error", err)
			return false
		}
	}
	return true
}

// poll consumes the ring into the snapshot until ctx ends or the ring is
// closed. The interval adapts: it doubles (up to 16× every) while the ring is
// idle and snaps back at the first record, so an idle deployment does not
// spin. Freshness at a failover does not depend on it: the failover drains
// the ring first. Nothing is logged per record; errors only when their text
// changes.
func (rc *ringConsumer) poll(ctx context.Context) {
	interval := rc.every
	t := time.NewTimer(interval)
	defer t.Stop()
	var lastErr string
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		rc.mu.Lock()
		if rc.r == nil {
			rc.mu.Unlock()
			return
		}
		n, err := rc.r.Poll()
		rc.noteProgress()
		rc.mu.Unlock()
		if msg := errString(err); msg != lastErr {
			if msg != "" {
				rc.log.Warn("ring poll", "error", msg)
			}
			lastErr = msg
		}
		if n > 0 || err != nil {
			interval = rc.every
		} else if interval < 16*rc.every {
			interval *= 2
		}
		t.Reset(interval)
	}
}

// noteProgress publishes the ring's lag and resyncs (mu held).
func (rc *ringConsumer) noteProgress() {
	rc.lag.Store(rc.r.Lag())
	rc.resyncs.Store(rc.r.Resyncs())
}

func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

// drainPolls bounds drain: a live writer cannot keep it.
const drainPolls = 64

// drain consumes everything committed, so the snapshot is as fresh as the
// dead active left it.
func (rc *ringConsumer) drain() {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	if rc.r == nil {
		return
	}
	for range drainPolls {
		n, err := rc.r.Poll()
		if err != nil {
			rc.log.Warn("drain ring", "error", err)
		}
		if n == 0 && err == nil {
			break
		}
	}
	rc.noteProgress()
}

// snapshots gives each open request the ring's snapshot of it, with its
// prompt elided where the snapshot starts with it (elidePrompt).
func (rc *ringConsumer) snapshots(reqs []*frmpsv1.ResumeRequest) {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	for _, r := range reqs {
		if r == nil || rc.r == nil {
			continue
		}
		if snap, ok := rc.r.Snapshot(r.GetKey()); ok {
			r.Snapshot = elidePrompt(snap, r.GetPromptTokenIds())
		}
	}
}

// size is the number of requests the ring knows (-1: no ring).
func (rc *ringConsumer) size() int {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	if rc.r == nil {
		return -1
	}
	return rc.r.Len()
}
