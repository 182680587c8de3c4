// Package fakegen is a TEST DOUBLE of an engine's generation API, for the
// front door's tests and benchmark: a gRPC server on a unix socket whose
// output is a deterministic function of the request (input and seed), with
// controllable pacing and failures (die after K tokens, refuse a resume). It
// runs no model. Backend is a test double of the supervisor's side.
package fakegen

import (
	"context"
	"fmt"
	"hash/fnv"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
)

// Config shapes the fake's behaviour.
type Config struct {
	Model       string
	MaxModelLen int
	// OutputLen is the output length when a request gives no max_tokens; the
	// request then finishes with "stop" (as on EOS), else with "length".
	OutputLen int
	// TokensPerChunk groups tokens per streamed chunk (default 1).
	TokensPerChunk int
	// Interval paces chunks (default: as fast as possible).
	Interval time.Duration
	// KillAfter > 0: once a stream has sent this many output tokens, the engine
	// dies — every stream breaks with Unavailable after the tokens it sent, and
	// later calls fail.
	KillAfter int
	// ResumeFromAdopted makes Resume restart at the delivered count the engine
	// adopted rather than the one the Resume call gives, so the front door
	// sees duplicates it must drop.
	ResumeFromAdopted bool
	// RejectLongPrompts answers prompts of MaxModelLen tokens or more with
	// INVALID_ARGUMENT, as a real engine would.
	RejectLongPrompts bool
	// AbortAt > 0 ends every request with FINISH_REASON_ABORT after this many
	// tokens, as an engine that dropped the request itself.
	AbortAt int
	// TextPad appends this many bytes of padding to each chunk's text
	// (to fill socket buffers in tests of stalled clients).
	TextPad int
	// StampText makes each chunk's text the emit time in Unix nanoseconds (benchmarks).
	StampText bool
	// HoldText sends every other chunk's tokens with no text, their text going
	// out with the next chunk, as a detokeniser holds back a token that ends
	// inside a UTF-8 character.
	HoldText bool
	// PromptIDs makes Generate's first chunk carry the prompt's token ids, as
	// the real engines do (one id per word, three per chat message's role); a
	// request is then identified by those ids, whichever input carries them.
	PromptIDs bool
	// Script makes the output's token texts these, in order (token k's text is
	// Script[k]) instead of TokenText, for tests of what the front door reads in
	// the text (tool calls); the output ends with "stop" after the last one,
	// or with "length" where max_tokens cuts it first.
	Script []string
}

// tokenText is the text of output token k, id.
func (c *Config) tokenText(k int, id uint32) string {
	if c.Script != nil {
		return c.Script[k]
	}
	return TokenText(id)
}

// TokenText is the text of one output token in the fake's vocabulary.
func TokenText(id uint32) string { return " w" + strconv.FormatUint(uint64(id), 10) }

// TokenID is output token i of a request whose input hashes to ident.
func TokenID(ident uint64, i int) uint32 {
	return uint32(100 + (ident+uint64(i)*7919)%50000)
}

// Engine is a running fake.
type Engine struct {
	cfg  Config
	srv  *grpc.Server
	lis  net.Listener
	conn *grpc.ClientConn
	cl   frmpsv1.GenerationClient

	dead     atomic.Bool
	deadCh   chan struct{}
	killOnce sync.Once
	stopOnce sync.Once
	wg       sync.WaitGroup

	mu       sync.Mutex
	adopted  map[uint64]*frmpsv1.ResumeRequest
	running  map[uint64]context.CancelFunc
	aborted  []uint64
	abortCh  chan uint64
	requests []*frmpsv1.GenerateRequest
	resumes  []*frmpsv1.ResumeStreamRequest
	tokenize []*frmpsv1.TokenizeRequest
}

// Start serves a fake on a unix socket at path.
func Start(path string, cfg Config) (*Engine, error) {
	if cfg.TokensPerChunk <= 0 {
		cfg.TokensPerChunk = 1
	}
	if cfg.OutputLen <= 0 {
		cfg.OutputLen = 16
	}
	lis, err := net.Listen("unix", path)
	if err != nil {
		return nil, fmt.Errorf("listen fake engine: %w", err)
	}
	e := &Engine{cfg: cfg, srv: grpc.NewServer(), lis: lis, deadCh: make(chan struct{}),
		adopted: map[uint64]*frmpsv1.ResumeRequest{}, running: map[uint64]context.CancelFunc{}, abortCh: make(chan uint64, 1024)}
	frmpsv1.RegisterGenerationServer(e.srv, &service{e: e})
	conn, err := grpc.NewClient("unix://"+path, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		lis.Close()
		return nil, fmt.Errorf("dial fake engine: %w", err)
	}
	e.conn, e.cl = conn, frmpsv1.NewGenerationClient(conn)
	e.wg.Add(1)
	go func() {
		defer e.wg.Done()
		_ = e.srv.Serve(lis) // returns when stopped
	}()
	return e, nil
}

// Client is a generation client connected to the fake.
func (e *Engine) Client() frmpsv1.GenerationClient { return e.cl }

// Kill makes the engine die now: connections drop (data in flight may be
// lost, as in a crash), later calls fail.
func (e *Engine) Kill() {
	e.markDead()
	e.stopOnce.Do(func() {
		e.wg.Add(1)
		go func() { // Stop may be called from a handler: don't wait inside it
			defer e.wg.Done()
			e.srv.Stop()
		}()
	})
}

// markDead fails every stream at its next token and every later call, while
// the server keeps delivering what was already sent (deterministic tests).
func (e *Engine) markDead() {
	e.killOnce.Do(func() {
		e.dead.Store(true)
		close(e.deadCh)
	})
}

// Dead is closed when the engine died.
func (e *Engine) Dead() <-chan struct{} { return e.deadCh }

// Close stops the fake and releases its socket and client connection.
func (e *Engine) Close() {
	e.Kill()
	e.wg.Wait()
	e.conn.Close()
}

// Adopt hands the fake a resume set, as the supervisor does to a standby.
func (e *Engine) Adopt(reqs []*frmpsv1.ResumeRequest) {
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, r := range reqs {
		e.adopted[r.GetKey()] = r
	}
}

// Aborts delivers the keys of aborted requests.
func (e *Engine) Aborts() <-chan uint64 { return e.abortCh }

// Requests returns the Generate requests received so far (also those refused because the engine was dead).
func (e *Engine) Requests() []*frmpsv1.GenerateRequest {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]*frmpsv1.GenerateRequest(nil), e.requests...)
}

// Tokenizes returns the Tokenize calls received so far.
func (e *Engine) Tokenizes() []*frmpsv1.TokenizeRequest {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]*frmpsv1.TokenizeRequest(nil), e.tokenize...)
}

// Resumes returns the Resume calls received so far.
func (e *Engine) Resumes() []*frmpsv1.ResumeStreamRequest {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]*frmpsv1.ResumeStreamRequest(nil), e.resumes...)
}

// Running reports how many streams are open.
func (e *Engine) Running() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return len(e.running)
}

type service struct {
	frmpsv1.UnimplementedGenerationServer
	e *Engine
}

// plan is what a request will output.
type plan struct {
	ident        uint64
	promptTokens int
	promptIDs    []uint32 // Config.PromptIDs: what Generate's first chunk reports
	total        int
	finish       frmpsv1.FinishReason
	logprobs     int // params.logprobs, -1 when not asked
}

// promptIDs is the fake tokenizer of Config.PromptIDs.
func promptIDs(prompt string, msgs []*frmpsv1.ChatMessage) []uint32 {
	var ids []uint32
	word := func(w string) uint32 {
		h := fnv.New32a()
		h.Write([]byte(w))
		return h.Sum32() % 50000
	}
	if len(msgs) > 0 {
		for _, m := range msgs {
			r := word("<" + m.GetRole() + ">")
			ids = append(ids, r, r, r)
			for _, w := range strings.Fields(m.GetContent()) {
				ids = append(ids, word(w))
			}
		}
		return ids
	}
	for _, w := range strings.Fields(prompt) {
		ids = append(ids, word(w))
	}
	return ids
}

func makePlan(cfg *Config, prompt string, ids []uint32, msgs []*frmpsv1.ChatMessage, p *frmpsv1.SamplingParams) plan {
	if cfg.PromptIDs && len(ids) == 0 {
		ids, prompt, msgs = promptIDs(prompt, msgs), "", nil
	}
	h := fnv.New64a()
	n := 0
	switch {
	case len(msgs) > 0:
		for _, m := range msgs {
			h.Write([]byte(m.GetRole() + "\x00" + m.GetContent() + "\x00"))
			n += 3 + len(strings.Fields(m.GetContent()))
		}
	case len(ids) > 0:
		for _, id := range ids {
			h.Write([]byte(strconv.FormatUint(uint64(id), 10) + ","))
		}
		n = len(ids)
	default:
		h.Write([]byte(prompt))
		n = len(strings.Fields(prompt))
	}
	ident := h.Sum64()
	if p.Seed != nil {
		ident ^= *p.Seed
	}
	pl := plan{ident: ident, promptTokens: n, total: cfg.OutputLen, finish: frmpsv1.FinishReason_FINISH_REASON_STOP, logprobs: -1}
	if p.Logprobs != nil {
		pl.logprobs = int(*p.Logprobs)
	}
	if cfg.PromptIDs {
		pl.promptIDs = ids
	}
	switch {
	case cfg.Script != nil:
		pl.total = len(cfg.Script)
		if m := int(p.GetMaxTokens()); m > 0 && m < pl.total {
			pl.total, pl.finish = m, frmpsv1.FinishReason_FINISH_REASON_LENGTH
		}
	case p.GetMaxTokens() > 0:
		pl.total, pl.finish = int(p.GetMaxTokens()), frmpsv1.FinishReason_FINISH_REASON_LENGTH
	}
	if cfg.MaxModelLen > 0 && n+pl.total > cfg.MaxModelLen {
		pl.total, pl.finish = max(cfg.MaxModelLen-n, 0), frmpsv1.FinishReason_FINISH_REASON_LENGTH
	}
	if cfg.AbortAt > 0 && cfg.AbortAt < pl.total {
		pl.total, pl.finish = cfg.AbortAt, frmpsv1.FinishReason_FINISH_REASON_ABORT
	}
	return pl
}

func (s *service) Generate(req *frmpsv1.GenerateRequest, stream grpc.ServerStreamingServer[frmpsv1.GenerateResponse]) error {
	e := s.e
	e.mu.Lock()
	e.requests = append(e.requests, req)
	e.mu.Unlock()
	if e.dead.Load() {
		return status.Error(codes.Unavailable, "fake engine is dead")
	}
	pl := makePlan(&e.cfg, req.GetPrompt(), req.GetPromptTokenIds().GetIds(), req.GetMessages().GetMessages(), req.GetParams())
	if e.cfg.RejectLongPrompts && e.cfg.MaxModelLen > 0 && pl.promptTokens >= e.cfg.MaxModelLen {
		return status.Errorf(codes.InvalidArgument, "prompt has %d tokens, the context holds %d", pl.promptTokens, e.cfg.MaxModelLen)
	}
	if len(pl.promptIDs) > 0 {
		if err := stream.Send(&frmpsv1.GenerateResponse{Usage: &frmpsv1.Usage{PromptTokens: uint32(pl.promptTokens)},
			PromptTokenIds: pl.promptIDs}); err != nil {
			return err
		}
	}
	return e.emit(stream, req.GetKey(), pl, 0)
}

func (s *service) Resume(req *frmpsv1.ResumeStreamRequest, stream grpc.ServerStreamingServer[frmpsv1.GenerateResponse]) error {
	e := s.e
	if e.dead.Load() {
		return status.Error(codes.Unavailable, "fake engine is dead")
	}
	e.mu.Lock()
	e.resumes = append(e.resumes, req)
	rr, ok := e.adopted[req.GetKey()]
	e.mu.Unlock()
	if !ok {
		return status.Errorf(codes.NotFound, "request %d was not adopted", req.GetKey())
	}
	pl := makePlan(&e.cfg, rr.GetPrompt(), rr.GetPromptTokenIds(), rr.GetMessages(), rr.GetParams())
	start := int(req.GetDelivered())
	if e.cfg.ResumeFromAdopted {
		start = len(rr.GetDeliveredTokenIds())
	}
	// Exactness check a real engine gets from its KV state: what the client
	// holds must be this request's own output.
	for i, id := range rr.GetDeliveredTokenIds() {
		if id != TokenID(pl.ident, i) {
			return status.Errorf(codes.FailedPrecondition, "delivered token %d is %d, expected %d", i, id, TokenID(pl.ident, i))
		}
	}
	return e.emit(stream, req.GetKey(), pl, start)
}

func (e *Engine) emit(stream grpc.ServerStreamingServer[frmpsv1.GenerateResponse], key uint64, pl plan, start int) error {
	ctx, cancel := context.WithCancel(stream.Context())
	defer cancel()
	e.mu.Lock()
	e.running[key] = cancel
	e.mu.Unlock()
	defer func() {
		e.mu.Lock()
		delete(e.running, key)
		e.mu.Unlock()
	}()
	per := e.cfg.TokensPerChunk
	var ticker *time.Ticker
	if e.cfg.Interval > 0 {
		ticker = time.NewTicker(e.cfg.Interval)
		defer ticker.Stop()
	}
	sent, held := 0, ""
	if start >= pl.total {
		return stream.Send(&frmpsv1.GenerateResponse{OutputIndex: uint32(pl.total), FinishReason: pl.finish,
			Usage: &frmpsv1.Usage{PromptTokens: uint32(pl.promptTokens), CompletionTokens: uint32(pl.total)}})
	}
	for i := start; i < pl.total; i += per {
		if ticker != nil && i > start {
			select {
			case <-ticker.C:
			case <-ctx.Done():
				return status.FromContextError(ctx.Err()).Err()
			case <-e.deadCh:
			}
		}
		if e.dead.Load() {
			return status.Error(codes.Unavailable, "fake engine died")
		}
		if ctx.Err() != nil {
			return status.FromContextError(ctx.Err()).Err()
		}
		end := min(i+per, pl.total)
		kill := false
		if e.cfg.KillAfter > 0 && sent+end-i >= e.cfg.KillAfter {
			end, kill = i+e.cfg.KillAfter-sent, true
		}
		resp := &frmpsv1.GenerateResponse{OutputIndex: uint32(i),
			Usage: &frmpsv1.Usage{PromptTokens: uint32(pl.promptTokens), CompletionTokens: uint32(end)},
			// A detokenizer state that names the chunk it follows (the fake's own convention).
			Detok: &frmpsv1.DetokState{Prefix: uint32(end - 1), Read: uint32(end)}}
		var sb strings.Builder
		for k := i; k < end; k++ {
			id := TokenID(pl.ident, k)
			resp.TokenIds = append(resp.TokenIds, id)
			if pl.logprobs >= 0 {
				resp.Logprobs = append(resp.Logprobs, Logprobs(id, pl.logprobs))
			}
			if !e.cfg.StampText {
				sb.WriteString(e.cfg.tokenText(k, id))
			}
		}
		if e.cfg.StampText {
			sb.WriteString(strconv.FormatInt(time.Now().UnixNano(), 10))
		}
		if e.cfg.TextPad > 0 {
			sb.WriteString(strings.Repeat(".", e.cfg.TextPad))
		}
		resp.Text = held + sb.String()
		held = ""
		if e.cfg.HoldText && ((i-start)/per)%2 == 0 && end < pl.total && !kill {
			held, resp.Text = resp.Text, ""
		}
		if end == pl.total && !kill {
			resp.FinishReason = pl.finish
		}
		if err := stream.Send(resp); err != nil {
			return err
		}
		sent += end - i
		if kill {
			e.markDead()
			return status.Error(codes.Unavailable, "fake engine died")
		}
	}
	return nil
}

func (s *service) Abort(_ context.Context, req *frmpsv1.AbortRequest) (*frmpsv1.AbortResponse, error) {
	e := s.e
	if e.dead.Load() {
		return nil, status.Error(codes.Unavailable, "fake engine is dead")
	}
	e.mu.Lock()
	cancel, found := e.running[req.GetKey()]
	e.aborted = append(e.aborted, req.GetKey())
	e.mu.Unlock()
	if found {
		cancel()
	}
	select {
	case e.abortCh <- req.GetKey():
	default:
	}
	return &frmpsv1.AbortResponse{Found: found}, nil
}

// Tokenize is the fake tokenizer of Config.PromptIDs: one id per word, three
// per chat message's role.
func (s *service) Tokenize(_ context.Context, req *frmpsv1.TokenizeRequest) (*frmpsv1.TokenIds, error) {
	if s.e.dead.Load() {
		return nil, status.Error(codes.Unavailable, "fake engine is dead")
	}
	s.e.mu.Lock()
	s.e.tokenize = append(s.e.tokenize, req)
	s.e.mu.Unlock()
	ids := promptIDs(req.GetPrompt(), req.GetMessages().GetMessages())
	if len(ids) == 0 {
		return nil, status.Error(codes.InvalidArgument, "nothing to tokenize")
	}
	return &frmpsv1.TokenIds{Ids: ids}, nil
}

// Detokenize is the text the fake gives those ids as output (TokenText).
func (s *service) Detokenize(_ context.Context, req *frmpsv1.TokenIds) (*frmpsv1.DetokenizeResponse, error) {
	if s.e.dead.Load() {
		return nil, status.Error(codes.Unavailable, "fake engine is dead")
	}
	var sb strings.Builder
	for _, id := range req.GetIds() {
		sb.WriteString(TokenText(id))
	}
	return &frmpsv1.DetokenizeResponse{Text: sb.String()}, nil
}

func (s *service) Health(context.Context, *frmpsv1.HealthRequest) (*frmpsv1.HealthResponse, error) {
	if s.e.dead.Load() {
		return nil, status.Error(codes.Unavailable, "fake engine is dead")
	}
	return &frmpsv1.HealthResponse{Serving: true, Model: s.e.cfg.Model, MaxModelLen: uint32(s.e.cfg.MaxModelLen), Running: uint32(s.e.Running())}, nil
}

// Expected is the complete output the fake produces for req: token ids, text
// and finish reason ("stop" or "length").
func Expected(cfg Config, req *frmpsv1.GenerateRequest) (ids []uint32, text string, finish string) {
	if cfg.OutputLen <= 0 {
		cfg.OutputLen = 16
	}
	pl := makePlan(&cfg, req.GetPrompt(), req.GetPromptTokenIds().GetIds(), req.GetMessages().GetMessages(), req.GetParams())
	var sb strings.Builder
	for i := 0; i < pl.total; i++ {
		id := TokenID(pl.ident, i)
		ids = append(ids, id)
		sb.WriteString(cfg.tokenText(i, id))
	}
	finish = "stop"
	if pl.finish == frmpsv1.FinishReason_FINISH_REASON_LENGTH {
		finish = "length"
	}
	return ids, sb.String(), finish
}

// Logprobs is what the fake sends for output token id with k top tokens: the
// token's text, a log probability and rank made from the id, and as top the
// next k ids with log probabilities -0.5, -1, ...
func Logprobs(id uint32, k int) *frmpsv1.TokenLogprobs {
	e := &frmpsv1.TokenLogprobs{Token: TokenText(id), Logprob: -0.25 - float32(id%4)/8, Rank: 1 + id%3}
	for j := 0; j < k; j++ {
		e.TopIds = append(e.TopIds, id+1+uint32(j))
		e.TopLogprobs = append(e.TopLogprobs, -0.5*float32(j+1))
		e.TopTokens = append(e.TopTokens, TokenText(id+1+uint32(j)))
	}
	return e
}

// Path is the fake's unix socket.
func (e *Engine) Path() string { return e.lis.Addr().String() }
