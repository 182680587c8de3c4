package supervisor

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// Watchdog is fed by the event loop goroutine itself, between events, so a
// loop that is wedged stops feeding it (systemd's WatchdogSec restarts the
// service then). Feed must not block.
type Watchdog interface {
	Feed()
}

// SetWatchdog makes the event loop call w.Feed every interval while it runs.
// Call before Run.
func (s *Supervisor) SetWatchdog(w Watchdog, every time.Duration) {
	if w == nil || every <= 0 {
		s.watchdog, s.watchdogEvery = nil, 0
		return
	}
	s.watchdog, s.watchdogEvery = w, every
}

// watchdogTick is the loop's feeding schedule; nil (never fires) without a
// watchdog. The loop feeds once at once, so the first ping does not wait a
// full interval.
func (s *Supervisor) watchdogTick() (<-chan time.Time, func()) {
	if s.watchdog == nil {
		return nil, func() {}
	}
	s.watchdog.Feed()
	t := time.NewTicker(s.watchdogEvery)
	return t.C, t.Stop
}

// Alive reports whether the event loop answers: a ping travels through the
// loop's event queue and back, so a loop that is wedged, or so far behind
// that the ping waits until ctx ends, is not alive. It is what a liveness
// probe should ask; whether an engine can serve is Serving.
func (s *Supervisor) Alive(ctx context.Context) error {
	resp := make(chan error, 1)
	select {
	case s.events <- event{kind: evPing, resp: resp, at: time.Now()}:
	case <-s.stopped:
		return errors.New("supervisor stopped")
	case <-ctx.Done():
		return fmt.Errorf("event loop queue full: %w", context.Cause(ctx))
	}
	select {
	case err := <-resp:
		return err
	case <-s.stopped:
		return errors.New("supervisor stopped")
	case <-ctx.Done():
		return fmt.Errorf("event loop did not answer: %w", context.Cause(ctx))
	}
}
