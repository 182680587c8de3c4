// Package genstream carries every request to one engine over one Generation
// Stream (proto/frmps/v1/generation.proto): the engine sends one message per
// step with a chunk for each request, instead of one gRPC message per token
// per request. Client keeps the per-request API of frmpsv1.GenerationClient
// (Generate and Resume return a per-request stream), so the front door's
// logic — resume across failovers, delivered counts — does not change.
package genstream

import (
	"context"
	"errors"
	"io"
	"sync"
	"sync/atomic"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
)

// Client multiplexes Generate and Resume over one Stream per engine
// connection; Abort and Health pass through. An engine without Stream
// (UNIMPLEMENTED) is served by the per-request RPCs, as before.
type Client struct {
	frmpsv1.GenerationClient
	perRequest atomic.Bool // the engine does not implement Stream

	mu     sync.Mutex
	conn   *conn // nil: none open (or the last one broke)
	closed bool
}

// New wraps c.
func New(c frmpsv1.GenerationClient) *Client { return &Client{GenerationClient: c} }

// Close ends the shared stream (its reader goroutine returns); requests still
// on it fail with Unavailable.
func (c *Client) Close() {
	c.mu.Lock()
	cn := c.conn
	c.conn, c.closed = nil, true
	c.mu.Unlock()
	if cn != nil {
		cn.cancel()
		<-cn.done
	}
}

type genStream = grpc.ServerStreamingClient[frmpsv1.GenerateResponse]

// Generate starts a request on the shared stream.
func (c *Client) Generate(ctx context.Context, req *frmpsv1.GenerateRequest, opts ...grpc.CallOption) (genStream, error) {
	if c.perRequest.Load() {
		return c.GenerationClient.Generate(ctx, req, opts...)
	}
	return c.open(ctx, req.GetKey(), &frmpsv1.StreamRequest{Op: &frmpsv1.StreamRequest_Generate{Generate: req}},
		func() (genStream, error) { return c.GenerationClient.Generate(ctx, req, opts...) })
}

// Resume re-attaches to an adopted request on the shared stream.
func (c *Client) Resume(ctx context.Context, req *frmpsv1.ResumeStreamRequest, opts ...grpc.CallOption) (genStream, error) {
	if c.perRequest.Load() {
		return c.GenerationClient.Resume(ctx, req, opts...)
	}
	return c.open(ctx, req.GetKey(), &frmpsv1.StreamRequest{Op: &frmpsv1.StreamRequest_Resume{Resume: req}},
		func() (genStream, error) { return c.GenerationClient.Resume(ctx, req, opts...) })
}

func (c *Client) open(ctx context.Context, key uint64, op *frmpsv1.StreamRequest, fallback func() (genStream, error)) (genStream, error) {
	cn, err := c.shared()
	if err != nil {
		return nil, err
	}
	v := &view{c: c, cn: cn, key: key, ctx: ctx, notify: make(chan struct{}, 1), fallback: fallback}
	if err := cn.add(v); err != nil {
		// The stream broke before this request joined it: the engine may already
		// have refused Stream itself.
		if c.noStream(err) {
			return fallback()
		}
		return nil, err
	}
	if err := cn.send(op); err != nil {
		cn.remove(v)
		if errors.Is(err, io.EOF) {
			// The engine ended the stream: Send says only io.EOF, the reader's
			// Recv gets the stream's status. Unimplemented (an engine without
			// Stream) means the per-request RPCs, as when Recv sees it first.
			select {
			case <-cn.done:
			case <-ctx.Done():
				return nil, status.FromContextError(ctx.Err()).Err()
			}
			cn.mu.Lock()
			serr := cn.err
			cn.mu.Unlock()
			if c.noStream(serr) {
				return fallback()
			}
			if serr != nil {
				err = serr
			}
		}
		return nil, status.Error(codes.Unavailable, "generation stream: "+err.Error())
	}
	return v, nil
}

// noStream reports whether err says the engine has no Stream (Unimplemented);
// if so, this and every later request use the per-request RPCs.
func (c *Client) noStream(err error) bool {
	if status.Code(err) != codes.Unimplemented {
		return false
	}
	c.perRequest.Store(true)
	return true
}

// shared returns the open stream, opening one when there is none.
func (c *Client) shared() (*conn, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil, status.Error(codes.Unavailable, "generation client closed")
	}
	if c.conn != nil && !c.conn.broken() {
		return c.conn, nil
	}
	ctx, cancel := context.WithCancel(context.Background())
	s, err := c.GenerationClient.Stream(ctx)
	if err != nil {
		cancel()
		return nil, err
	}
	cn := &conn{s: s, cancel: cancel, views: map[uint64]*view{}, done: make(chan struct{})}
	c.conn = cn
	go cn.read()
	return cn, nil
}

// conn is one Stream and the requests on it.
type conn struct {
	s      grpc.BidiStreamingClient[frmpsv1.StreamRequest, frmpsv1.StreamResponse]
	cancel context.CancelFunc
	sendMu sync.Mutex
	done   chan struct{}

	mu    sync.Mutex
	views map[uint64]*view
	err   error // set once the stream broke
}

func (cn *conn) broken() bool {
	cn.mu.Lock()
	defer cn.mu.Unlock()
	return cn.err != nil
}

func (cn *conn) add(v *view) error {
	cn.mu.Lock()
	defer cn.mu.Unlock()
	if cn.err != nil {
		return cn.err
	}
	if old := cn.views[v.key]; old != nil {
		old.fail(status.Error(codes.Aborted, "request re-opened on the same stream"))
	}
	cn.views[v.key] = v
	return nil
}

func (cn *conn) remove(v *view) bool {
	cn.mu.Lock()
	defer cn.mu.Unlock()
	if cn.views[v.key] != v {
		return false
	}
	delete(cn.views, v.key)
	return true
}

func (cn *conn) send(op *frmpsv1.StreamRequest) error {
	cn.sendMu.Lock()
	defer cn.sendMu.Unlock()
	return cn.s.Send(op)
}

// read dispatches the engine's messages to the requests until the stream
// breaks; then every request still on it fails with the stream's error.
func (cn *conn) read() {
	defer close(cn.done)
	for {
		resp, err := cn.s.Recv()
		if err != nil {
			if errors.Is(err, io.EOF) { // the engine ended the stream: as good as gone
				err = status.Error(codes.Unavailable, "generation stream ended by the engine")
			}
			cn.mu.Lock()
			cn.err = err
			views := cn.views
			cn.views = map[uint64]*view{}
			cn.mu.Unlock()
			for _, v := range views {
				v.fail(err)
			}
			cn.cancel()
			return
		}
		cn.mu.Lock()
		for _, ch := range resp.GetChunks() {
			v := cn.views[ch.GetKey()]
			if v == nil {
				continue // detached, or a request of a stream the client gave up
			}
			if ch.GetStatusCode() != 0 || ch.GetResponse().GetFinishReason() != frmpsv1.FinishReason_FINISH_REASON_UNSPECIFIED {
				delete(cn.views, ch.GetKey())
			}
			v.push(ch)
		}
		cn.mu.Unlock()
	}
}

// view is one request's per-request stream over the shared one. Its queue
// is unbounded (a request's output is bounded by its max_tokens), so a slow
// reader never holds up the others.
type view struct {
	c      *Client
	cn     *conn
	key    uint64
	ctx    context.Context
	notify chan struct{}

	mu   sync.Mutex
	q    []*frmpsv1.StreamChunk
	err  error
	got  bool // a chunk was returned
	end  bool // the last chunk was returned: io.EOF next
	fall genStream
	// fallback opens this request with the per-request RPC (the engine has no Stream).
	fallback func() (genStream, error)
}

func (v *view) push(ch *frmpsv1.StreamChunk) {
	v.mu.Lock()
	v.q = append(v.q, ch)
	v.mu.Unlock()
	v.wake()
}

func (v *view) fail(err error) {
	v.mu.Lock()
	if v.err == nil {
		v.err = err
	}
	v.mu.Unlock()
	v.wake()
}

func (v *view) wake() {
	select {
	case v.notify <- struct{}{}:
	default:
	}
}

// Recv returns the request's next chunk, in order; io.EOF after its last.
func (v *view) Recv() (*frmpsv1.GenerateResponse, error) {
	for {
		v.mu.Lock()
		if v.fall != nil {
			f := v.fall
			v.mu.Unlock()
			return f.Recv()
		}
		if v.end {
			v.mu.Unlock()
			return nil, io.EOF
		}
		if len(v.q) > 0 {
			ch := v.q[0]
			v.q = v.q[1:]
			v.got = true
			if code := ch.GetStatusCode(); code != 0 {
				v.end = true
				v.mu.Unlock()
				return nil, status.Error(codes.Code(code), ch.GetStatusMessage())
			}
			resp := ch.GetResponse()
			if resp.GetFinishReason() != frmpsv1.FinishReason_FINISH_REASON_UNSPECIFIED {
				v.end = true
			}
			v.mu.Unlock()
			return resp, nil
		}
		if err := v.err; err != nil {
			got := v.got
			v.mu.Unlock()
			if !got && v.c.noStream(err) {
				f, ferr := v.fallback()
				if ferr != nil {
					return nil, ferr
				}
				v.mu.Lock()
				v.fall = f
				v.mu.Unlock()
				continue
			}
			return nil, err
		}
		v.mu.Unlock()
		select {
		case <-v.notify:
		case <-v.ctx.Done():
			if v.cn.remove(v) {
				// Best effort: the engine stops sending it; Abort is the caller's to send.
				_ = v.cn.send(&frmpsv1.StreamRequest{Op: &frmpsv1.StreamRequest_Detach{Detach: &frmpsv1.AbortRequest{Key: v.key}}})
			}
			return nil, status.FromContextError(v.ctx.Err()).Err()
		}
	}
}

// The rest of grpc.ClientStream: a view has no headers or trailers of its own.
func (v *view) Header() (metadata.MD, error) { return nil, nil }
func (v *view) Trailer() metadata.MD         { return nil }
func (v *view) CloseSend() error             { return nil }
func (v *view) Context() context.Context     { return v.ctx }
func (v *view) SendMsg(any) error            { return errors.New("genstream: a request's stream sends nothing") }
func (v *view) RecvMsg(any) error            { return errors.New("genstream: use Recv") }
