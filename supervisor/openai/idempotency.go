package openai

import (
	"container/list"
	"context"
	"crypto/sha256"
	"errors"
	"net/http"
	"sync"
	"time"
)

// Idempotency-Key semantics:
//
//   - Scope: the key is scoped to the endpoint (chat, completions, responses). A request
//     carrying a key that is new (or whose entry expired) runs normally; its
//     response (status, headers, body or SSE stream) is recorded.
//   - While that request runs, a request with the same key and a byte-identical
//     body attaches to it: it receives the recorded response from the start
//     and then follows it live — no second generation. A different body under
//     the same key is refused with 422.
//   - The generation runs detached from the connection that started it: when
//     the last attached client goes away it keeps running for
//     IdempotencyDetachGrace so a reconnecting client can attach, then it is
//     aborted and the entry dropped.
//   - After it finishes, the response stays replayable for IdempotencyTTL,
//     unless it was retryable (429, 5xx, client gone) or larger than
//     IdempotencyMaxBytes: then the entry is dropped and a retry runs afresh.
//   - The cache holds at most IdempotencyMaxEntries, and finished responses
//     of at most IdempotencyMaxTotalBytes together; the oldest finished
//     entries are evicted first. When every entry is still running, a new key
//     is served without idempotency rather than refused.
//   - Keys longer than 255 bytes are refused with 400.

var errDetached = errors.New("every client of the idempotent request went away")

type idemEntry struct {
	key      string
	fp       [32]byte
	rec      *recorder
	ctx      context.Context
	cancel   context.CancelCauseFunc
	refs     int
	done     bool
	finished time.Time
	size     int // bytes counted in kept, once finished
	grace    *time.Timer
	elem     *list.Element
}

type idempotency struct {
	ttl, grace time.Duration
	maxEntries int
	maxBytes   int
	maxTotal   int
	m          *metrics

	mu      sync.Mutex
	entries map[string]*idemEntry
	order   *list.List // of *idemEntry, oldest first
	kept    int        // bytes of the finished responses kept
}

const maxIdempotencyKeyLen = 255

func newIdempotency(cfg Config, m *metrics) *idempotency {
	return &idempotency{ttl: cfg.IdempotencyTTL, grace: cfg.IdempotencyDetachGrace, maxEntries: cfg.IdempotencyMaxEntries,
		maxBytes: cfg.IdempotencyMaxBytes, maxTotal: cfg.IdempotencyMaxTotalBytes, m: m, entries: make(map[string]*idemEntry), order: list.New()}
}

// attach returns the entry for key, creating it (fresh=true) when absent.
// A nil entry and nil error mean "serve without idempotency".
func (c *idempotency) attach(key string, fp [32]byte, now time.Time) (e *idemEntry, fresh bool, apiErr *apiError) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if e = c.entries[key]; e != nil && e.done && now.Sub(e.finished) > c.ttl {
		c.removeLocked(e)
		e = nil
	}
	if e != nil {
		if e.fp != fp {
			return nil, false, &apiError{Status: 422, Type: typeInvalidRequest, Code: "idempotency_key_reused",
				Message: "This Idempotency-Key was used with a different request body."}
		}
		e.refs++
		if e.grace != nil {
			e.grace.Stop()
			e.grace = nil
		}
		return e, false, nil
	}
	if len(c.entries) >= c.maxEntries && !c.evictLocked(now) {
		return nil, false, nil
	}
	ctx, cancel := context.WithCancelCause(context.Background())
	e = &idemEntry{key: key, fp: fp, rec: newRecorder(), ctx: ctx, cancel: cancel, refs: 1}
	e.elem = c.order.PushBack(e)
	c.entries[key] = e
	return e, true, nil
}

// evictLocked drops expired entries, or else the oldest finished one.
func (c *idempotency) evictLocked(now time.Time) bool {
	var oldestDone *idemEntry
	evicted := false
	for el := c.order.Front(); el != nil; {
		next := el.Next()
		e := el.Value.(*idemEntry)
		if e.done {
			if now.Sub(e.finished) > c.ttl {
				c.removeLocked(e)
				evicted = true
			} else if oldestDone == nil {
				oldestDone = e
			}
		}
		el = next
	}
	if !evicted && oldestDone != nil {
		c.removeLocked(oldestDone)
		evicted = true
	}
	return evicted
}

func (c *idempotency) removeLocked(e *idemEntry) {
	if c.entries[e.key] == e {
		delete(c.entries, e.key)
	}
	c.kept -= e.size
	e.size = 0
	if e.elem != nil {
		c.order.Remove(e.elem)
		e.elem = nil
	}
	if e.grace != nil {
		e.grace.Stop()
		e.grace = nil
	}
}

// detach is called when an attached client is done with the entry.
func (c *idempotency) detach(e *idemEntry) {
	c.mu.Lock()
	defer c.mu.Unlock()
	e.refs--
	if e.refs == 0 && !e.done && e.grace == nil {
		e.grace = time.AfterFunc(c.grace, func() { e.cancel(errDetached) })
	}
}

// finish records the end of the entry's run with the outcome's status.
func (c *idempotency) finish(e *idemEntry, code int) {
	// The followers' responses end after the bookkeeping (defers run last in,
	// first out): a client holding the whole response finds the entry finished.
	defer e.rec.finish()
	c.mu.Lock()
	defer c.mu.Unlock()
	e.done = true
	e.finished = time.Now()
	e.cancel(nil)
	if e.grace != nil {
		e.grace.Stop()
		e.grace = nil
	}
	size := e.rec.size()
	if code == 429 || code >= 500 || code == statusClientClosed || size > c.maxBytes {
		c.removeLocked(e)
		return
	}
	if e.elem == nil {
		return // evicted while running
	}
	e.size = size
	c.kept += size
	for el := c.order.Front(); el != nil && c.kept > c.maxTotal; {
		next := el.Next()
		if old := el.Value.(*idemEntry); old.done {
			c.removeLocked(old)
		}
		el = next
	}
}

// close stops pending grace timers; Shutdown cancels the runs themselves.
func (c *idempotency) close() {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, e := range c.entries {
		if e.grace != nil {
			e.grace.Stop()
			e.grace = nil
		}
	}
}

func (s *Server) serveIdempotent(w http.ResponseWriter, r *http.Request, key string, body []byte, j *job, rid string, arrived time.Time) {
	if len(key) > maxIdempotencyKeyLen {
		badRequest("", "The Idempotency-Key header is longer than 255 bytes.").write(w)
		s.m.requests.WithLabelValues(j.endpoint.String(), "400").Inc()
		return
	}
	fp := sha256.Sum256(body)
	e, fresh, apiErr := s.idem.attach(j.endpoint.String()+"\x00"+key, fp, arrived)
	if apiErr != nil {
		apiErr.write(w)
		s.m.requests.WithLabelValues(j.endpoint.String(), "422").Inc()
		return
	}
	if e == nil {
		s.execute(r.Context(), w, j, rid, arrived)
		return
	}
	if fresh {
		if !s.enter() {
			s.idem.finish(e, 503)
			s.idem.detach(e)
			unavailable(s.cfg.RetryAfter, "server shutting down").write(w)
			return
		}
		go func() {
			defer s.leave()
			code := s.executeEntered(e.ctx, e.rec, j, rid, arrived)
			s.idem.finish(e, code)
		}()
	} else {
		s.m.idempotentHits.Inc()
	}
	e.rec.replay(r.Context(), w, rid)
	s.idem.detach(e)
}

// recorder is an http.ResponseWriter that keeps the response for replay to
// any number of followers, live.
type recorder struct {
	header http.Header // written by the producer before WriteHeader only

	mu     sync.Mutex
	status int
	sent   http.Header // header as of WriteHeader
	body   []byte
	done   bool
	notify chan struct{} // closed and replaced on every change
}

func newRecorder() *recorder {
	return &recorder{header: make(http.Header), notify: make(chan struct{})}
}

func (r *recorder) Header() http.Header { return r.header }

func (r *recorder) WriteHeader(code int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.writeHeaderLocked(code)
}

func (r *recorder) writeHeaderLocked(code int) {
	if r.status != 0 {
		return
	}
	r.status = code
	r.sent = r.header.Clone()
	r.wakeLocked()
}

func (r *recorder) Write(p []byte) (int, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.writeHeaderLocked(http.StatusOK)
	r.body = append(r.body, p...)
	r.wakeLocked()
	return len(p), nil
}

// Flush is a no-op: every Write already wakes the followers.
func (r *recorder) Flush() {}

func (r *recorder) wakeLocked() {
	close(r.notify)
	r.notify = make(chan struct{})
}

func (r *recorder) finish() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.done = true
	r.wakeLocked()
}

func (r *recorder) size() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.body)
}

// replay copies the recorded response to w and follows it until it ends or
// ctx ends. Bytes below len(body) are never rewritten, so they are read
// outside the lock.
func (r *recorder) replay(ctx context.Context, w http.ResponseWriter, rid string) {
	flusher, _ := w.(http.Flusher)
	off, headerSent := 0, false
	for {
		r.mu.Lock()
		st, hdr, chunk, done, ch := r.status, r.sent, r.body[off:], r.done, r.notify
		r.mu.Unlock()
		if st != 0 && !headerSent {
			for k, v := range hdr {
				w.Header()[k] = v
			}
			w.Header().Set("X-Request-Id", rid)
			w.WriteHeader(st)
			headerSent = true
		}
		if len(chunk) > 0 {
			if _, err := w.Write(chunk); err != nil {
				return
			}
			if flusher != nil {
				flusher.Flush()
			}
			off += len(chunk)
		}
		if done {
			if !headerSent {
				unavailable(1, "the original request ended without a response").write(w)
			}
			return
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return
		}
	}
}
