package openai

import (
	"context"
	"errors"
	"sync/atomic"
	"time"
)

var (
	errQueueFull    = errors.New("request queue is full")
	errQueueTimeout = errors.New("timed out waiting for a free slot")
)

// limiter bounds concurrent requests and the queue of requests waiting for a slot.
type limiter struct {
	slots    chan struct{}
	queued   atomic.Int64
	maxQueue int64
	timeout  time.Duration
	m        *metrics
}

func newLimiter(maxConcurrent, maxQueue int, timeout time.Duration, m *metrics) *limiter {
	return &limiter{slots: make(chan struct{}, maxConcurrent), maxQueue: int64(maxQueue), timeout: timeout, m: m}
}

func (l *limiter) acquire(ctx context.Context) error {
	select {
	case l.slots <- struct{}{}:
		l.m.inflight.Inc()
		return nil
	default:
	}
	if l.queued.Add(1) > l.maxQueue {
		l.queued.Add(-1)
		return errQueueFull
	}
	l.m.queued.Inc()
	defer func() {
		l.queued.Add(-1)
		l.m.queued.Dec()
	}()
	t := time.NewTimer(l.timeout)
	defer t.Stop()
	select {
	case l.slots <- struct{}{}:
		l.m.inflight.Inc()
		return nil
	case <-ctx.Done():
		return context.Cause(ctx)
	case <-t.C:
		return errQueueTimeout
	}
}

func (l *limiter) release() {
	<-l.slots
	l.m.inflight.Dec()
}
