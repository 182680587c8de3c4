package supervisor

import (
	"context"
	"time"
)

// The ring's consumer: pollRing runs on its own goroutine for the life of
// the loop; drainRing is the loop's, at a failover. Both hold ringMu.

// pollRing consumes the ring into the snapshot. The interval adapts: it
// doubles (up to 16× PollInterval) while the ring is idle and snaps back at
// the first record, so an idle deployment does not spin. Freshness at a
// failover does not depend on it: the failover drains the ring first.
// Nothing is logged per record; errors only when their text changes.
func (s *Supervisor) pollRing(ctx context.Context) {
	interval := s.cfg.PollInterval
	t := time.NewTimer(interval)
	defer t.Stop()
	var lastErr string
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		s.ringMu.Lock()
		if s.ring == nil {
			s.ringMu.Unlock()
			return
		}
		n, err := s.ring.Poll()
		s.ringLag.Store(s.ring.Lag())
		s.ringResyncs.Store(s.ring.Resyncs())
		s.ringMu.Unlock()
		if msg := errString(err); msg != lastErr {
			if msg != "" {
				s.log.Warn("ring poll", "error", msg)
			}
			lastErr = msg
		}
		if n > 0 || err != nil {
			interval = s.cfg.PollInterval
		} else if interval < 16*s.cfg.PollInterval {
			interval *= 2
		}
		t.Reset(interval)
	}
}

func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

// drainRing consumes everything committed, so the snapshot is as fresh as
// the dead active left it.
func (s *Supervisor) drainRing() {
	s.ringMu.Lock()
	defer s.ringMu.Unlock()
	if s.ring == nil {
		return
	}
	for range 64 { // bounded: a live writer cannot keep us here
		n, err := s.ring.Poll()
		if err != nil {
			s.log.Warn("drain ring", "error", err)
		}
		if n == 0 && err == nil {
			break
		}
	}
	s.ringLag.Store(s.ring.Lag())
	s.ringResyncs.Store(s.ring.Resyncs())
}
