package genstream

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
)

// engine is a TEST DOUBLE of an engine's generation server: every request
// gets max_tokens tokens (key*1000 + index), one per step; a step sends one
// message with a chunk for every request that has a token.
type engine struct {
	frmpsv1.UnimplementedGenerationServer
	noStream bool          // answer Stream with UNIMPLEMENTED
	breakAt  int           // end every Stream with UNAVAILABLE once breakOn requests have had this many tokens each (0: never)
	breakOn  int           // how many requests the break waits for
	mu       sync.Mutex    // guards detached
	detached []uint64      // detach ops seen
	steps    chan struct{} // one per step sent, when not nil
}

type req struct {
	key    uint64
	max, i int
}

func (e *engine) Stream(s grpc.BidiStreamingServer[frmpsv1.StreamRequest, frmpsv1.StreamResponse]) error {
	if e.noStream {
		return status.Error(codes.Unimplemented, "no Stream here")
	}
	in := make(chan *frmpsv1.StreamRequest)
	go func() {
		defer close(in)
		for {
			r, err := s.Recv()
			if err != nil {
				return
			}
			select {
			case in <- r:
			case <-s.Context().Done():
				return
			}
		}
	}()
	var live []*req
	tick := time.NewTicker(time.Millisecond)
	defer tick.Stop()
	for {
		var chunks []*frmpsv1.StreamChunk
	drain:
		for {
			select {
			case r, ok := <-in:
				if !ok {
					return nil
				}
				switch op := r.GetOp().(type) {
				case *frmpsv1.StreamRequest_Generate:
					g := op.Generate
					if g.GetKey() == 13 {
						chunks = append(chunks, &frmpsv1.StreamChunk{Key: 13, StatusCode: int32(codes.InvalidArgument), StatusMessage: "unlucky"})
						continue
					}
					live = append(live, &req{key: g.GetKey(), max: int(g.GetParams().GetMaxTokens())})
					chunks = append(chunks, &frmpsv1.StreamChunk{Key: g.GetKey(), Response: &frmpsv1.GenerateResponse{Usage: &frmpsv1.Usage{PromptTokens: 3}}})
				case *frmpsv1.StreamRequest_Detach:
					e.mu.Lock()
					e.detached = append(e.detached, op.Detach.GetKey())
					e.mu.Unlock()
				}
			default:
				break drain
			}
		}
		if e.breakAt > 0 && len(live) >= e.breakOn {
			ready := 0
			for _, r := range live {
				if r.i >= e.breakAt {
					ready++
				}
			}
			if ready >= e.breakOn {
				return status.Error(codes.Unavailable, "engine died")
			}
		}
		var next []*req
		for _, r := range live {
			resp := &frmpsv1.GenerateResponse{TokenIds: []uint32{uint32(r.key*1000) + uint32(r.i)}, OutputIndex: uint32(r.i)}
			r.i++
			if r.i == r.max {
				resp.FinishReason = frmpsv1.FinishReason_FINISH_REASON_LENGTH
			} else {
				next = append(next, r)
			}
			chunks = append(chunks, &frmpsv1.StreamChunk{Key: r.key, Response: resp})
		}
		live = next
		if len(chunks) > 0 {
			if err := s.Send(&frmpsv1.StreamResponse{Chunks: chunks}); err != nil {
				return err
			}
			if e.steps != nil {
				e.steps <- struct{}{}
			}
		}
		select {
		case <-tick.C:
		case <-s.Context().Done():
			return nil
		}
	}
}

func (e *engine) Generate(g *frmpsv1.GenerateRequest, s grpc.ServerStreamingServer[frmpsv1.GenerateResponse]) error {
	for i := 0; i < int(g.GetParams().GetMaxTokens()); i++ {
		resp := &frmpsv1.GenerateResponse{TokenIds: []uint32{uint32(g.GetKey()*1000) + uint32(i)}, OutputIndex: uint32(i)}
		if i == int(g.GetParams().GetMaxTokens())-1 {
			resp.FinishReason = frmpsv1.FinishReason_FINISH_REASON_LENGTH
		}
		if err := s.Send(resp); err != nil {
			return err
		}
	}
	return nil
}

func serve(t *testing.T, e *engine) (*Client, func()) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "gen.sock")
	lis, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	frmpsv1.RegisterGenerationServer(srv, e)
	go func() { _ = srv.Serve(lis) }()
	cc, err := grpc.NewClient("unix://"+path, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	c := New(frmpsv1.NewGenerationClient(cc))
	return c, func() {
		c.Close()
		_ = cc.Close()
		srv.Stop()
	}
}

func gen(key uint64, max uint32) *frmpsv1.GenerateRequest {
	return &frmpsv1.GenerateRequest{Key: key, Params: &frmpsv1.SamplingParams{MaxTokens: max}}
}

// readAll reads a request to its end: its token ids, then the error that ended it (io.EOF after a finish).
func readAll(s grpc.ServerStreamingClient[frmpsv1.GenerateResponse]) ([]uint32, error) {
	var ids []uint32
	for {
		r, err := s.Recv()
		if err != nil {
			return ids, err
		}
		ids = append(ids, r.GetTokenIds()...)
	}
}

func wantTokens(key uint64, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(key*1000) + uint32(i)
	}
	return out
}

func TestManyRequestsShareOneStream(t *testing.T) {
	defer goleak.VerifyNone(t)
	c, stop := serve(t, &engine{})
	defer stop()
	var wg sync.WaitGroup
	errs := make(chan error, 64)
	for k := uint64(100); k < 164; k++ { // not 13: the double refuses it
		wg.Add(1)
		go func() {
			defer wg.Done()
			s, err := c.Generate(context.Background(), gen(k, 20))
			if err != nil {
				errs <- err
				return
			}
			ids, err := readAll(s)
			if !errors.Is(err, io.EOF) || fmt.Sprint(ids) != fmt.Sprint(wantTokens(k, 20)) {
				errs <- fmt.Errorf("key %d: %v %v", k, ids, err)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if c.perRequest.Load() {
		t.Fatal("fell back to per-request RPCs")
	}
}

// A request nobody reads does not hold up the others, and keeps its tokens.
func TestASlowReaderHoldsUpNobody(t *testing.T) {
	defer goleak.VerifyNone(t)
	c, stop := serve(t, &engine{})
	defer stop()
	slow, err := c.Generate(context.Background(), gen(1, 200))
	if err != nil {
		t.Fatal(err)
	}
	fast, err := c.Generate(context.Background(), gen(2, 200))
	if err != nil {
		t.Fatal(err)
	}
	if ids, err := readAll(fast); !errors.Is(err, io.EOF) || len(ids) != 200 {
		t.Fatalf("fast: %d tokens, %v", len(ids), err)
	}
	if ids, err := readAll(slow); !errors.Is(err, io.EOF) || fmt.Sprint(ids) != fmt.Sprint(wantTokens(1, 200)) {
		t.Fatalf("slow: %v %v", ids, err)
	}
}

// The engine's stream breaks: every request on it fails with UNAVAILABLE (the
// front door takes it for the engine's death and resumes elsewhere), after
// the tokens that did arrive; the next request opens a new stream.
func TestABrokenStreamFailsEveryRequestOnIt(t *testing.T) {
	defer goleak.VerifyNone(t)
	c, stop := serve(t, &engine{breakAt: 5, breakOn: 3})
	defer stop()
	var streams []grpc.ServerStreamingClient[frmpsv1.GenerateResponse]
	for k := uint64(1); k <= 3; k++ {
		s, err := c.Generate(context.Background(), gen(k, 100))
		if err != nil {
			t.Fatal(err)
		}
		streams = append(streams, s)
	}
	for i, s := range streams {
		ids, err := readAll(s)
		if status.Code(err) != codes.Unavailable || len(ids) == 0 || len(ids) >= 100 {
			t.Fatalf("request %d: %d tokens, %v", i+1, len(ids), err)
		}
		if fmt.Sprint(ids) != fmt.Sprint(wantTokens(uint64(i+1), len(ids))) {
			t.Fatalf("request %d: %v", i+1, ids)
		}
	}
	s, err := c.Generate(context.Background(), gen(7, 3))
	if err != nil {
		t.Fatal(err)
	}
	if ids, err := readAll(s); !errors.Is(err, io.EOF) || len(ids) != 3 {
		t.Fatalf("after the break: %v %v", ids, err)
	}
}

// A request's own error ends that request only.
func TestARequestErrorEndsThatRequest(t *testing.T) {
	defer goleak.VerifyNone(t)
	c, stop := serve(t, &engine{})
	defer stop()
	bad, err := c.Generate(context.Background(), gen(13, 5))
	if err != nil {
		t.Fatal(err)
	}
	good, err := c.Generate(context.Background(), gen(14, 5))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := readAll(bad); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("bad: %v", err)
	}
	if ids, err := readAll(good); !errors.Is(err, io.EOF) || len(ids) != 5 {
		t.Fatalf("good: %v %v", ids, err)
	}
}

// A caller that gives up gets its context's error at once, and the engine
// is told to stop sending that request.
func TestCancelDetaches(t *testing.T) {
	defer goleak.VerifyNone(t)
	e := &engine{}
	c, stop := serve(t, e)
	defer stop()
	ctx, cancel := context.WithCancel(context.Background())
	s, err := c.Generate(ctx, gen(5, 100000))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Recv(); err != nil {
		t.Fatal(err)
	}
	cancel()
	for {
		if _, err = s.Recv(); err != nil {
			break
		}
	}
	if status.Code(err) != codes.Canceled {
		t.Fatalf("after cancel: %v", err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		e.mu.Lock()
		n := len(e.detached)
		e.mu.Unlock()
		if n == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("no detach reached the engine")
		}
		time.Sleep(time.Millisecond)
	}
}

// An engine without Stream is served by the per-request RPCs.
func TestAnEngineWithoutStreamUsesPerRequestRPCs(t *testing.T) {
	defer goleak.VerifyNone(t)
	c, stop := serve(t, &engine{noStream: true})
	defer stop()
	for k := uint64(1); k <= 2; k++ {
		s, err := c.Generate(context.Background(), gen(k, 4))
		if err != nil {
			t.Fatal(err)
		}
		if ids, err := readAll(s); !errors.Is(err, io.EOF) || fmt.Sprint(ids) != fmt.Sprint(wantTokens(k, 4)) {
			t.Fatalf("key %d: %v %v", k, ids, err)
		}
	}
	if !c.perRequest.Load() {
		t.Fatal("did not fall back")
	}
}
