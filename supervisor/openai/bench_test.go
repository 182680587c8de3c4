package openai

import (
	"context"
	"io"
	"net/http"
	"strconv"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
)

// memClient is an in-memory generation client (a test double): Generate
// replays prebuilt chunks, so a benchmark measures the front door's own code.
type memClient struct{ chunks []*frmpsv1.GenerateResponse }

type memStream struct {
	grpc.ClientStream
	chunks []*frmpsv1.GenerateResponse
	i      int
}

func (s *memStream) Recv() (*frmpsv1.GenerateResponse, error) {
	if s.i == len(s.chunks) {
		return nil, io.EOF
	}
	s.i++
	return s.chunks[s.i-1], nil
}

func (c *memClient) Generate(context.Context, *frmpsv1.GenerateRequest, ...grpc.CallOption) (grpc.ServerStreamingClient[frmpsv1.GenerateResponse], error) {
	return &memStream{chunks: c.chunks}, nil
}

func (c *memClient) Resume(context.Context, *frmpsv1.ResumeStreamRequest, ...grpc.CallOption) (grpc.ServerStreamingClient[frmpsv1.GenerateResponse], error) {
	return &memStream{chunks: c.chunks}, nil
}

func (c *memClient) Abort(context.Context, *frmpsv1.AbortRequest, ...grpc.CallOption) (*frmpsv1.AbortResponse, error) {
	return &frmpsv1.AbortResponse{}, nil
}

func (c *memClient) Stream(context.Context, ...grpc.CallOption) (grpc.BidiStreamingClient[frmpsv1.StreamRequest, frmpsv1.StreamResponse], error) {
	return nil, status.Error(codes.Unimplemented, "memClient has no Stream")
}

func (c *memClient) Health(context.Context, *frmpsv1.HealthRequest, ...grpc.CallOption) (*frmpsv1.HealthResponse, error) {
	return &frmpsv1.HealthResponse{Serving: true}, nil
}

func (c *memClient) Tokenize(context.Context, *frmpsv1.TokenizeRequest, ...grpc.CallOption) (*frmpsv1.TokenIds, error) {
	return nil, status.Error(codes.Unimplemented, "memClient has no tokenizer")
}

func (c *memClient) Detokenize(context.Context, *frmpsv1.TokenIds, ...grpc.CallOption) (*frmpsv1.DetokenizeResponse, error) {
	return nil, status.Error(codes.Unimplemented, "memClient has no tokenizer")
}

type memBackend struct{ c *memClient }

func (b memBackend) Current(context.Context, uint64) (Engine, error) {
	return Engine{Client: b.c, Generation: 1}, nil
}
func (b memBackend) Model() ModelInfo { return ModelInfo{Name: "m", MaxModelLen: 1 << 20} }

// discardWriter is a ResponseWriter that only counts bytes.
type discardWriter struct {
	h http.Header
	n int
}

func (w *discardWriter) Header() http.Header         { return w.h }
func (w *discardWriter) WriteHeader(int)             {}
func (w *discardWriter) Write(p []byte) (int, error) { w.n += len(p); return len(p), nil }
func (w *discardWriter) Flush()                      {}

// BenchmarkStreamChunk measures the front door's CPU per streamed chunk
// (request bookkeeping, delivered-token record, JSON+SSE encoding, metrics),
// with the engine and the socket writes taken out.
func BenchmarkStreamChunk(b *testing.B) {
	for _, ep := range []endpoint{endpointCompletions, endpointChat} {
		b.Run(ep.String(), func(b *testing.B) {
			const perReq = 256
			chunks := make([]*frmpsv1.GenerateResponse, perReq)
			for i := range chunks {
				chunks[i] = &frmpsv1.GenerateResponse{TokenIds: []uint32{uint32(1000 + i)}, Text: " tok" + strconv.Itoa(i),
					OutputIndex: uint32(i), Usage: &frmpsv1.Usage{PromptTokens: 5, CompletionTokens: uint32(i + 1)}}
			}
			chunks[perReq-1].FinishReason = frmpsv1.FinishReason_FINISH_REASON_LENGTH
			s, err := New(Config{IdempotencyTTL: -1}, memBackend{&memClient{chunks}}, hclog.NewNullLogger(), prometheus.NewRegistry())
			if err != nil {
				b.Fatal(err)
			}
			j := &job{endpoint: ep, model: "m", stream: true, includeUsage: true,
				gen: &frmpsv1.GenerateRequest{Input: &frmpsv1.GenerateRequest_Prompt{Prompt: "x"}, Params: &frmpsv1.SamplingParams{}}}
			w := &discardWriter{h: http.Header{}}
			b.ReportAllocs()
			b.ResetTimer()
			reqs := 0
			for i := 0; i < b.N; i += perReq {
				w.h = http.Header{}
				if code := s.execute(context.Background(), w, j, "rid", time.Now()); code != 200 {
					b.Fatalf("status %d", code)
				}
				reqs++
			}
			b.StopTimer()
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(reqs*perReq), "ns/chunk")
			b.ReportMetric(float64(w.n)/float64(reqs*perReq), "bytes/chunk")
		})
	}
}
