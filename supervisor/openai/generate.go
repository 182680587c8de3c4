package openai

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
)

// openRequest is one request between its submission to an engine and its end.
// It holds what a failover needs: the original input and parameters, and every
// token id already delivered to the client.
type openRequest struct {
	key       uint64
	requestID string
	gen       *frmpsv1.GenerateRequest // immutable once registered
	// sibling: one of a request's choices after its first; the request's time
	// to first token is its first choice's.
	sibling bool

	mu        sync.Mutex
	submitted bool // sent to an engine: only these belong in a resume set
	delivered []uint32
	promptIDs []uint32 // the prompt as the engine tokenized it (its first chunk), when it said
	engine    Engine   // the engine serving it now, for Abort
}

func (r *openRequest) setEngine(e Engine) {
	r.mu.Lock()
	r.engine = e
	r.submitted = true
	r.mu.Unlock()
}

func (r *openRequest) currentEngine() Engine {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.engine
}

// deliver records ids as delivered. The caller writes them to the client
// right after: a failover snapshot taken in between counts them as delivered,
// which is harmless since Resume carries the final count and duplicates are
// dropped by output index.
func (r *openRequest) deliver(ids []uint32) {
	r.mu.Lock()
	r.delivered = append(r.delivered, ids...)
	r.mu.Unlock()
}

// setPromptIDs keeps the prompt's token ids an engine reported: a resume then
// sends them instead of the text or messages (the next engine need not tokenize).
func (r *openRequest) setPromptIDs(ids []uint32) {
	r.mu.Lock()
	r.promptIDs = append(r.promptIDs[:0], ids...)
	r.mu.Unlock()
}

// resumeRequest builds the supervisor's view of this request for a resume set.
func (r *openRequest) resumeRequest() (*frmpsv1.ResumeRequest, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.submitted {
		return nil, false
	}
	rr := &frmpsv1.ResumeRequest{
		Key:               r.key,
		RequestId:         r.requestID,
		Params:            cloneParams(r.gen.GetParams()),
		DeliveredTokenIds: append([]uint32(nil), r.delivered...),
	}
	if len(r.promptIDs) > 0 {
		rr.PromptTokenIds = append([]uint32(nil), r.promptIDs...)
		return rr, true
	}
	switch in := r.gen.GetInput().(type) {
	case *frmpsv1.GenerateRequest_Prompt:
		rr.Prompt = in.Prompt
	case *frmpsv1.GenerateRequest_PromptTokenIds:
		rr.PromptTokenIds = append([]uint32(nil), in.PromptTokenIds.GetIds()...)
	case *frmpsv1.GenerateRequest_Messages:
		for _, m := range in.Messages.GetMessages() {
			rr.Messages = append(rr.Messages, proto.Clone(m).(*frmpsv1.ChatMessage))
		}
		rr.ToolsJson = r.gen.GetToolsJson()
	}
	return rr, true
}

// cloneParams copies every field, so that no sampling parameter is lost on a resume.
func cloneParams(p *frmpsv1.SamplingParams) *frmpsv1.SamplingParams {
	if p == nil {
		return nil
	}
	return proto.Clone(p).(*frmpsv1.SamplingParams)
}

// errShuttingDown is the cancel cause of requests cut short by Shutdown.
var errShuttingDown = errors.New("server is shutting down")

// engineFailed tells an engine's death (the stream broke without a finish)
// from the engine refusing or failing this one request.
func engineFailed(err error) bool {
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		return true
	}
	switch status.Code(err) {
	case codes.Unavailable, codes.Aborted, codes.Canceled:
		return true
	}
	return false
}

// engineError maps an engine's refusal of a request to an API error.
func engineError(err error, retryAfter int) *apiError {
	st := status.Convert(err)
	switch st.Code() {
	case codes.InvalidArgument, codes.OutOfRange:
		return &apiError{Status: 400, Type: typeInvalidRequest, Message: st.Message()}
	case codes.ResourceExhausted:
		return &apiError{Status: 429, Type: typeRateLimit, Code: "engine_overloaded", Message: "The engine is overloaded: " + st.Message(), RetryAfter: retryAfter}
	case codes.FailedPrecondition, codes.NotFound:
		// The output is reproducible (the seed is fixed): a retry gets the same answer.
		return &apiError{Status: 503, Type: typeUnavailable, Code: "stream_resume_failed", RetryAfter: retryAfter,
			Message: "The request could not be resumed on the new engine: " + st.Message()}
	}
	return &apiError{Status: 500, Type: typeServer, Message: "The engine failed the request: " + st.Message()}
}

func unavailable(retryAfter int, why string) *apiError {
	return &apiError{Status: 503, Type: typeUnavailable, Code: "engine_unavailable", RetryAfter: retryAfter,
		Message: "No engine can serve the request right now (" + why + "); retry later."}
}

func finishReasonString(f frmpsv1.FinishReason) string {
	switch f {
	case frmpsv1.FinishReason_FINISH_REASON_STOP:
		return "stop"
	case frmpsv1.FinishReason_FINISH_REASON_LENGTH:
		return "length"
	}
	return "abort"
}

// statusClientClosed labels requests whose client went away (nginx's 499).
const statusClientClosed = 499

type genStream = grpc.ServerStreamingClient[frmpsv1.GenerateResponse]

// run drives one request through the engine, across failovers, into out. It
// returns the outcome's status for the metrics.
func (s *Server) run(ctx context.Context, j *job, or *openRequest, out output, arrived time.Time) int {
	defer out.close()
	waitCtx, cancelWait := context.WithTimeout(ctx, s.cfg.EngineWaitTimeout)
	eng, err := s.currentEngine(waitCtx, 0)
	cancelWait()
	if err != nil {
		return s.failEarly(ctx, out, err)
	}

	var (
		stream       genStream
		cancelStream context.CancelFunc = func() {}
		resuming     bool               // the current stream is a Resume
		gotChunk     bool               // the current stream delivered at least one chunk
		started      bool
		promptTokens int
		delivered    int
		resumes      int
		// gotResumedToken: OnResumedToken was called for the current resume.
		gotResumedToken bool
		// detok: the engine's detokenizer state after the last delivered chunk
		// (nil where it sent none), handed to the next engine on a resume so that
		// it need not replay the delivered tokens to continue the text.
		detok *frmpsv1.DetokState
		// The current resume's phases: the old stream broke, a newer engine was
		// published, the resume stream opened (frmps_stream_resume_phase_seconds).
		brokeAt, engineAt, openedAt time.Time
	)
	defer func() { cancelStream() }()
	open := func(resume bool) {
		var sctx context.Context
		sctx, cancelStream = context.WithCancel(ctx)
		or.setEngine(eng)
		resuming, gotChunk, gotResumedToken = resume, false, false
		if resume {
			stream, err = eng.Client.Resume(sctx, &frmpsv1.ResumeStreamRequest{Key: or.key, Delivered: uint32(delivered), Detok: detok})
		} else {
			stream, err = eng.Client.Generate(sctx, or.gen)
		}
	}
	// resumeOn resumes the stream on next, noting the resume's phases.
	resumeOn := func(next Engine) {
		eng, engineAt = next, time.Now()
		open(true)
		openedAt = time.Now()
	}
	fail := func(e *apiError) int {
		out.fail(e)
		return e.Status
	}
	open(false)
	for {
		var resp *frmpsv1.GenerateResponse
		if err == nil {
			resp, err = stream.Recv()
		}
		if err != nil {
			cancelStream()
			if ctx.Err() != nil {
				return s.ended(ctx, or, out)
			}
			if resuming && !gotChunk && delivered == 0 && status.Code(err) == codes.NotFound {
				// The new engine never adopted it and nothing reached the
				// client: starting afresh is exact (the seed is fixed).
				open(false)
				continue
			}
			if resuming && !gotChunk && status.Code(err) == codes.NotFound && resumes < s.cfg.MaxResumes {
				// The engine has no such request, but it may have handed it on
				// (a failback's handover) before this resume reached it: a newer
				// engine then has it. Only a newer one, briefly awaited; else the
				// refusal stands.
				if next, nerr := s.newerEngine(ctx, eng.Generation); nerr == nil {
					s.log.Info("resume refused by an engine no longer current; resuming on the newer one", "key", or.key,
						"refused_by", eng.Generation, "generation", next.Generation, "delivered", delivered)
					resumes++
					resumeOn(next)
					continue
				}
				if ctx.Err() != nil {
					return s.ended(ctx, or, out)
				}
			}
			if !engineFailed(err) {
				if resuming {
					s.m.resumes.WithLabelValues("failed").Inc()
				}
				if resuming || delivered > 0 {
					// A stream cut after it began: which engine ended it, and where
					// (the client sees only the error).
					s.log.Warn("engine ended a stream", "key", or.key, "generation", eng.Generation, "resume", resuming,
						"chunks_on_this_stream", gotChunk, "delivered", delivered, "failovers", resumes, "error", err)
				}
				return fail(engineError(err, s.cfg.RetryAfter))
			}
			resumes++
			if resumes > s.cfg.MaxResumes {
				s.m.resumes.WithLabelValues("failed").Inc()
				return fail(&apiError{Status: 503, Type: typeUnavailable, Code: "stream_resume_failed", RetryAfter: s.cfg.RetryAfter,
					Message: fmt.Sprintf("The request was interrupted by %d engine failovers; giving up.", resumes-1)})
			}
			out.gap(true)
			brokeAt = time.Now()
			next, nerr := s.nextEngine(ctx, eng.Generation)
			if nerr != nil {
				out.gap(false)
				if ctx.Err() != nil {
					return s.ended(ctx, or, out)
				}
				s.m.resumes.WithLabelValues("failed").Inc()
				if !started {
					return fail(unavailable(s.cfg.RetryAfter, "engine failover did not complete: "+nerr.Error()))
				}
				return fail(&apiError{Status: 503, Type: typeUnavailable, Code: "stream_resume_failed", RetryAfter: s.cfg.RetryAfter,
					Message: "The engine failed and the stream could not be resumed: " + nerr.Error()})
			}
			resumeOn(next)
			continue
		}
		received := time.Now()
		if resuming && !gotChunk {
			s.m.resumes.WithLabelValues("ok").Inc()
		}
		gotChunk = true
		out.gap(false)

		if pt := int(resp.GetUsage().GetPromptTokens()); pt > promptTokens {
			promptTokens = pt
		}
		if p := resp.GetPromptTokenIds(); len(p) > 0 {
			or.setPromptIDs(p)
		}
		if !started {
			if e := s.checkContext(j, promptTokens); e != nil {
				cancelStream()
				s.abort(or)
				return fail(e)
			}
			if err := out.start(promptTokens); err != nil {
				return s.clientGone(or)
			}
			started = true
		}
		ids, text, lps := resp.GetTokenIds(), resp.GetText(), resp.GetLogprobs()
		if idx := int(resp.GetOutputIndex()); idx != delivered {
			switch {
			case idx > delivered:
				s.abort(or)
				return fail(&apiError{Status: 500, Type: typeServer, Code: "stream_gap",
					Message: fmt.Sprintf("The engine skipped output tokens (sent index %d, %d delivered).", idx, delivered)})
			case idx+len(ids) <= delivered:
				ids, text, lps = nil, "", nil // already delivered before the failover
			default:
				// A chunk straddling the delivered boundary cannot be split:
				// its text is not divisible per token.
				s.abort(or)
				return fail(&apiError{Status: 500, Type: typeServer, Code: "stream_overlap",
					Message: fmt.Sprintf("The engine resumed inside a chunk (index %d, %d delivered).", idx, delivered)})
			}
		}
		if len(ids) > 0 {
			if delivered == 0 && !or.sibling {
				s.m.ttft.Observe(time.Since(arrived).Seconds())
			}
			if resuming && !gotResumedToken {
				gotResumedToken = true
				now := time.Now()
				if s.cfg.OnResumedToken != nil {
					s.cfg.OnResumedToken(eng.Generation, now)
				}
				s.noteResumePhases(or.key, eng.Generation, brokeAt, engineAt, openedAt, now)
			}
			or.deliver(ids)
			delivered += len(ids)
			detok = resp.GetDetok()
			s.m.tokens.Add(float64(len(ids)))
		}
		if err := out.text(text, ids, lps); err != nil {
			return s.clientGone(or)
		}
		if text != "" && j.stream {
			s.m.chunkOverhead.Observe(time.Since(received).Seconds())
		}
		if fr := resp.GetFinishReason(); fr != frmpsv1.FinishReason_FINISH_REASON_UNSPECIFIED {
			s.unregister(or) // finished: no longer part of any resume set
			if fr == frmpsv1.FinishReason_FINISH_REASON_ABORT {
				return fail(&apiError{Status: 503, Type: typeUnavailable, Code: "aborted", Message: "The engine aborted the request."})
			}
			if err := out.finish(finishReasonString(fr), usage{prompt: promptTokens, completion: delivered}); err != nil {
				return statusClientClosed
			}
			return 200
		}
	}
}

// slowResume: a resumed stream whose first token comes this long after its
// old stream broke is logged with its phases (the takeover itself takes
// milliseconds; what is left is the front door's wait).
const slowResume = 50 * time.Millisecond

// noteResumePhases records where a resumed stream's wait went, from its old
// stream breaking to its first resumed token.
func (s *Server) noteResumePhases(key, gen uint64, broke, engine, opened, first time.Time) {
	if broke.IsZero() {
		return // resumed without a break seen here (not a failover's resume)
	}
	s.m.resumePhase.WithLabelValues("engine").Observe(engine.Sub(broke).Seconds())
	s.m.resumePhase.WithLabelValues("open").Observe(opened.Sub(engine).Seconds())
	s.m.resumePhase.WithLabelValues("first_token").Observe(first.Sub(opened).Seconds())
	if total := first.Sub(broke); total >= slowResume {
		s.log.Warn("slow stream resume", "key", key, "generation", gen, "total", total,
			"waited_for_engine", engine.Sub(broke), "stream_open", opened.Sub(engine), "first_token_after_open", first.Sub(opened))
	}
}

// checkContext checks the prompt length the engine reported against the model's context.
func (s *Server) checkContext(j *job, promptTokens int) *apiError {
	max := s.modelInfo().MaxModelLen
	if max <= 0 || promptTokens == 0 {
		return nil
	}
	if promptTokens >= max {
		return promptTooLong(promptTokens, max, j.endpoint.inputParam())
	}
	if j.maxTokens > 0 && promptTokens+j.maxTokens > max {
		return contextTooLong(promptTokens, j.maxTokens, max, j.endpoint.maxTokensParam())
	}
	return nil
}

// nextEngine waits for an engine newer than the failed generation.
func (s *Server) nextEngine(ctx context.Context, failedGen uint64) (Engine, error) {
	rctx, cancel := context.WithTimeout(ctx, s.cfg.ResumeTimeout)
	defer cancel()
	return s.currentEngine(rctx, failedGen+1)
}

// handedOnWait bounds the wait for a newer engine after a resume was refused
// (newerEngine): a handover publishes its new engine within milliseconds.
const handedOnWait = 2 * time.Second

// newerEngine is an engine newer than gen, if one is published within
// handedOnWait (or ResumeTimeout, if shorter).
func (s *Server) newerEngine(ctx context.Context, gen uint64) (Engine, error) {
	wait := min(handedOnWait, s.cfg.ResumeTimeout)
	rctx, cancel := context.WithTimeout(ctx, wait)
	defer cancel()
	return s.currentEngine(rctx, gen+1)
}

// currentEngine is Backend.Current, refusing an engine handed out without a
// generation client.
func (s *Server) currentEngine(ctx context.Context, minGeneration uint64) (Engine, error) {
	eng, err := s.backend.Current(ctx, minGeneration)
	if err == nil && eng.Client == nil {
		err = errNoClient
	}
	return eng, err
}

// errNoClient guards against a Backend handing out an engine without a client.
var errNoClient = errors.New("backend returned an engine without a generation client")

// failEarly answers a request that never reached an engine.
func (s *Server) failEarly(ctx context.Context, out output, err error) int {
	if ctx.Err() != nil {
		if errors.Is(context.Cause(ctx), errShuttingDown) {
			out.fail(unavailable(s.cfg.RetryAfter, "server shutting down"))
			return 503
		}
		return statusClientClosed
	}
	why := "engine unavailable"
	if errors.Is(err, context.DeadlineExceeded) {
		why = "timed out waiting for an engine"
	}
	out.fail(unavailable(s.cfg.RetryAfter, why))
	return 503
}

// ended handles the request context ending: the client left, or Shutdown cut it short.
func (s *Server) ended(ctx context.Context, or *openRequest, out output) int {
	s.abort(or)
	if errors.Is(context.Cause(ctx), errShuttingDown) {
		out.fail(unavailable(s.cfg.RetryAfter, "server shutting down"))
		return 503
	}
	return statusClientClosed
}

func (s *Server) clientGone(or *openRequest) int {
	s.abort(or)
	return statusClientClosed
}

// abort tells the serving engine to drop the request. Best effort: a dead
// engine has dropped it already.
func (s *Server) abort(or *openRequest) {
	eng := or.currentEngine()
	if eng.Client == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), s.cfg.AbortTimeout)
	defer cancel()
	if _, err := eng.Client.Abort(ctx, &frmpsv1.AbortRequest{Key: or.key}); err != nil {
		s.log.Debug("abort request", "key", or.key, "request_id", or.requestID, "error", err)
	}
}
