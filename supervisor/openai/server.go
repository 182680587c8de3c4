package openai

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"golang.org/x/net/netutil"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
	"github.com/frmps/frmps/supervisor/buildinfo"
)

// Server is the OpenAI-compatible front door.
type Server struct {
	cfg     Config
	backend Backend
	model   ModelInfo
	log     hclog.Logger
	m       *metrics
	lim     *limiter
	idem    *idempotency
	handler http.Handler
	apiKey  [32]byte // sha256 of the key: fixed length for the constant-time compare

	nextKey atomic.Uint64
	// served: an engine has served since the start (ReadinessReporter said so once);
	// until then /v1/models answers 503, as a vllm serve that is still starting answers nothing.
	served atomic.Bool

	// base ends when Shutdown gives up waiting: every request's context follows it.
	base       context.Context
	cancelBase context.CancelCauseFunc

	mu       sync.Mutex
	open     map[uint64]*openRequest
	active   int  // requests inside execute, including detached idempotent runs
	closing  bool // Shutdown called: new requests get 503
	drained  chan struct{}
	draining bool
}

// New builds a front door over b. reg receives the metrics; when it is also a
// prometheus.Gatherer (a *prometheus.Registry) it serves /metrics unless
// cfg.Gatherer is set.
func New(cfg Config, b Backend, log hclog.Logger, reg prometheus.Registerer) (*Server, error) {
	if b == nil {
		return nil, errors.New("new front door: nil backend")
	}
	if reg == nil {
		return nil, errors.New("new front door: nil prometheus registerer")
	}
	if log == nil {
		log = hclog.NewNullLogger()
	}
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, fmt.Errorf("new front door: %w", err)
	}
	model := b.Model()
	if model.Name == "" {
		return nil, errors.New("new front door: backend reports no model name")
	}
	m, err := newMetrics(reg, model.Name)
	if err != nil {
		return nil, fmt.Errorf("register front door metrics: %w", err)
	}
	if cfg.Gatherer == nil {
		if g, ok := reg.(prometheus.Gatherer); ok {
			cfg.Gatherer = g
		}
	}
	if cfg.Version == "" {
		cfg.Version = buildinfo.Get().Version
	}
	s := &Server{
		cfg: cfg, backend: b, model: model, log: log.Named("openai"), m: m,
		lim:     newLimiter(cfg.MaxConcurrent, cfg.MaxQueue, cfg.QueueTimeout, m),
		open:    make(map[uint64]*openRequest),
		drained: make(chan struct{}),
	}
	s.base, s.cancelBase = context.WithCancelCause(context.Background())
	if cfg.APIKey != "" {
		s.apiKey = sha256.Sum256([]byte(cfg.APIKey))
	}
	if cfg.IdempotencyTTL > 0 {
		s.idem = newIdempotency(cfg, m)
	}
	s.handler = s.routes()
	return s, nil
}

// Handler returns the HTTP handler serving the API.
func (s *Server) Handler() http.Handler { return s.handler }

// HTTPServer returns an http.Server for Handler with the header and idle
// timeouts of the Config, so that slow or idle clients cannot hold
// connections. It has no ReadTimeout or WriteTimeout: those would cut long
// streams (the body's read time is bounded per request, BodyReadTimeout).
func (s *Server) HTTPServer() *http.Server {
	return &http.Server{Handler: s.handler, ReadHeaderTimeout: s.cfg.ReadHeaderTimeout, IdleTimeout: s.cfg.IdleTimeout}
}

// Listener bounds l to Config.MaxConnections open connections.
func (s *Server) Listener(l net.Listener) net.Listener {
	if s.cfg.MaxConnections < 0 {
		return l
	}
	return netutil.LimitListener(l, s.cfg.MaxConnections)
}

func (s *Server) routes() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("/v1/chat/completions", s.auth(s.completionHandler(endpointChat)))
	mux.HandleFunc("/v1/completions", s.auth(s.completionHandler(endpointCompletions)))
	mux.HandleFunc("/v1/responses", s.auth(s.completionHandler(endpointResponses)))
	mux.HandleFunc("/v1/responses/", s.auth(s.handleStoredResponse))
	mux.HandleFunc("/v1/models", s.auth(s.handleModels))
	mux.HandleFunc("/tokenize", s.auth(s.handleTokenize))
	mux.HandleFunc("/detokenize", s.auth(s.handleDetokenize))
	mux.HandleFunc("/health", s.handleHealth)
	mux.HandleFunc("/readyz", s.handleHealth)
	mux.HandleFunc("/livez", s.handleLive)
	mux.HandleFunc("/version", s.handleVersion)
	if s.cfg.Gatherer != nil {
		mux.Handle("/metrics", promhttp.HandlerFor(s.cfg.Gatherer, promhttp.HandlerOpts{}))
	}
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		(&apiError{Status: 404, Type: typeNotFound, Message: fmt.Sprintf("Unknown path %s.", r.URL.Path)}).write(w)
	})
	return withRequestID(mux)
}

// withRequestID echoes a sane x-request-id or makes one.
func withRequestID(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		id := r.Header.Get("X-Request-Id")
		if !saneRequestID(id) {
			id = randomID(16)
			r.Header.Set("X-Request-Id", id)
		}
		w.Header().Set("X-Request-Id", id)
		next.ServeHTTP(w, r)
	})
}

func saneRequestID(id string) bool {
	if id == "" || len(id) > 128 {
		return false
	}
	for i := 0; i < len(id); i++ {
		if c := id[i]; c < 0x21 || c > 0x7e {
			return false
		}
	}
	return true
}

func randomID(nbytes int) string {
	b := make([]byte, nbytes)
	_, _ = rand.Read(b) // crypto/rand.Read never fails on Linux (Go ≥ 1.24 panics instead of returning an error)
	return hex.EncodeToString(b)
}

func (s *Server) auth(next http.HandlerFunc) http.HandlerFunc {
	if s.cfg.APIKey == "" {
		return next
	}
	return func(w http.ResponseWriter, r *http.Request) {
		tok, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
		got := sha256.Sum256([]byte(strings.TrimSpace(tok)))
		if !ok || subtle.ConstantTimeCompare(got[:], s.apiKey[:]) != 1 {
			w.Header().Set("WWW-Authenticate", `Bearer realm="frmps"`)
			(&apiError{Status: 401, Type: typeInvalidRequest, Code: "invalid_api_key",
				Message: "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>'."}).write(w)
			s.m.requests.WithLabelValues(endpointLabel(r.URL.Path), "401").Inc()
			return
		}
		next(w, r)
	}
}

func endpointLabel(path string) string {
	switch path {
	case "/v1/chat/completions":
		return endpointChat.String()
	case "/v1/completions":
		return endpointCompletions.String()
	case "/v1/responses":
		return endpointResponses.String()
	case "/v1/models":
		return "models"
	}
	return "other"
}

func (s *Server) handleModels(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodGet {
		methodNotAllowed(w, http.MethodGet)
		return
	}
	if !s.startedServing() {
		unavailable(s.cfg.RetryAfter, "the engine is still starting").write(w)
		return
	}
	b := []byte(`{"object":"list","data":[{"id":`)
	b = appendJSONString(b, s.model.Name)
	b = append(b, `,"object":"model","created":`...)
	b = strconv.AppendInt(b, time.Now().Unix(), 10)
	b = append(b, `,"owned_by":"frmps","root":`...)
	b = appendJSONString(b, s.model.Name)
	if n := s.modelInfo().MaxModelLen; n > 0 { // left out while no engine has told it
		b = append(b, `,"max_model_len":`...)
		b = strconv.AppendInt(b, int64(n), 10)
	}
	b = append(b, "}]}\n"...)
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write(b)
}

// startedServing reports whether an engine has served since the start. Scripts
// wait for a server with GET /v1/models (vllm serve opens its port only once its
// engine is ready): answering it before any engine can serve would send their
// first requests into the engine wait. After the first engine a failover does
// not change the answer: the model is still served, after a pause. A backend
// without ReadinessReporter is taken as serving.
func (s *Server) startedServing() bool {
	if s.served.Load() {
		return true
	}
	rr, ok := s.backend.(ReadinessReporter)
	if ok && !rr.Serving() {
		return false
	}
	s.served.Store(true)
	return true
}

// modelInfo is the served model with its current context limit.
func (s *Server) modelInfo() ModelInfo {
	return ModelInfo{Name: s.model.Name, MaxModelLen: s.backend.Model().MaxModelLen}
}

func (s *Server) handleHealth(w http.ResponseWriter, r *http.Request) {
	ok := false
	if rr, isRR := s.backend.(ReadinessReporter); isRR {
		ok = rr.Serving()
	} else {
		ctx, cancel := context.WithTimeout(r.Context(), s.cfg.HealthTimeout)
		_, err := s.backend.Current(ctx, 0)
		cancel()
		ok = err == nil
	}
	s.mu.Lock()
	closing := s.closing
	s.mu.Unlock()
	w.Header().Set("Content-Type", "application/json")
	if !ok || closing {
		w.Header().Set("Retry-After", strconv.Itoa(s.cfg.RetryAfter))
		w.WriteHeader(http.StatusServiceUnavailable)
		_, _ = io.WriteString(w, `{"status":"unavailable"}`+"\n")
		return
	}
	_, _ = io.WriteString(w, `{"status":"ok"}`+"\n")
}

// handleLive answers whether the process should be left running: the
// backend's control loop answers (LivenessReporter), whatever the engines do.
// A draining server is still alive.
func (s *Server) handleLive(w http.ResponseWriter, r *http.Request) {
	var err error
	if lr, ok := s.backend.(LivenessReporter); ok {
		ctx, cancel := context.WithTimeout(r.Context(), s.cfg.LivenessTimeout)
		err = lr.Alive(ctx)
		cancel()
	}
	w.Header().Set("Content-Type", "application/json")
	if err != nil {
		w.WriteHeader(http.StatusServiceUnavailable)
		b := appendJSONString([]byte(`{"status":"unavailable","error":`), err.Error())
		_, _ = w.Write(append(b, "}\n"...))
		return
	}
	_, _ = io.WriteString(w, `{"status":"ok"}`+"\n")
}

func (s *Server) handleVersion(w http.ResponseWriter, _ *http.Request) {
	bi := buildinfo.Get()
	b := []byte(`{"version":`)
	b = appendJSONString(b, s.cfg.Version)
	b = append(b, `,"commit":`...)
	b = appendJSONString(b, bi.Commit)
	b = append(b, `,"go_version":`...)
	b = appendJSONString(b, bi.GoVersion)
	b = append(b, "}\n"...)
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write(b)
}

func methodNotAllowed(w http.ResponseWriter, allow string) {
	w.Header().Set("Allow", allow)
	(&apiError{Status: 405, Type: typeInvalidRequest, Message: "Method not allowed; use " + allow + "."}).write(w)
}

func (s *Server) completionHandler(ep endpoint) http.HandlerFunc {
	label := ep.String()
	return func(w http.ResponseWriter, r *http.Request) {
		arrived := time.Now()
		if r.Method != http.MethodPost {
			methodNotAllowed(w, http.MethodPost)
			s.m.requests.WithLabelValues(label, "405").Inc()
			return
		}
		body, e := s.readBody(w, r)
		if e != nil {
			e.write(w)
			s.m.requests.WithLabelValues(label, strconv.Itoa(e.Status)).Inc()
			return
		}
		j, e := parseRequest(ep, body, s.modelInfo(), &s.cfg)
		if e != nil {
			e.write(w)
			s.m.requests.WithLabelValues(label, strconv.Itoa(e.Status)).Inc()
			return
		}
		j.fixSeeds(randomSeed)
		rid := w.Header().Get("X-Request-Id")
		if key := r.Header.Get("Idempotency-Key"); key != "" && s.idem != nil {
			s.serveIdempotent(w, r, key, body, j, rid, arrived)
			return
		}
		s.execute(r.Context(), w, j, rid, arrived)
	}
}

// readBody reads the request body within MaxBodyBytes and BodyReadTimeout.
// Refused bodies are not read further; net/http then closes the connection
// after a lingering close, so a client still sending reads the error.
func (s *Server) readBody(w http.ResponseWriter, r *http.Request) ([]byte, *apiError) {
	tooLarge := &apiError{Status: http.StatusRequestEntityTooLarge, Type: typeInvalidRequest, Code: "request_too_large",
		Message: fmt.Sprintf("The request body exceeds the limit of %d bytes.", s.cfg.MaxBodyBytes)}
	if r.ContentLength > s.cfg.MaxBodyBytes {
		w.Header().Set("Connection", "close")
		return nil, tooLarge
	}
	rc := http.NewResponseController(w)
	// Not supported by every ResponseWriter (HTTP/2 streams, recorders): the
	// header timeout and the connection bound still hold there.
	_ = rc.SetReadDeadline(time.Now().Add(s.cfg.BodyReadTimeout))
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, s.cfg.MaxBodyBytes))
	if err != nil {
		var tooBig *http.MaxBytesError
		switch {
		case errors.As(err, &tooBig):
			return nil, tooLarge
		case errors.Is(err, os.ErrDeadlineExceeded):
			w.Header().Set("Connection", "close")
			return nil, &apiError{Status: http.StatusRequestTimeout, Type: typeInvalidRequest, Code: "request_timeout",
				Message: fmt.Sprintf("The request body was not received within %s.", s.cfg.BodyReadTimeout)}
		}
		return nil, &apiError{Status: 400, Type: typeInvalidRequest, Message: "Could not read the request body: " + err.Error()}
	}
	// The connection is read again only to notice a client going away.
	_ = rc.SetReadDeadline(time.Time{})
	return body, nil
}

// execute runs one validated request to its end, writing the response to w,
// and returns the outcome's status.
func (s *Server) execute(parent context.Context, w http.ResponseWriter, j *job, rid string, arrived time.Time) int {
	if !s.enter() {
		e := unavailable(s.cfg.RetryAfter, "server shutting down")
		e.write(w)
		s.m.requests.WithLabelValues(j.endpoint.String(), "503").Inc()
		return e.Status
	}
	defer s.leave()
	return s.executeEntered(parent, w, j, rid, arrived)
}

// executeEntered is execute for a caller that already holds s.enter().
func (s *Server) executeEntered(parent context.Context, w http.ResponseWriter, j *job, rid string, arrived time.Time) int {
	label := j.endpoint.String()
	code := s.executeInner(parent, w, j, rid, arrived)
	s.m.requests.WithLabelValues(label, strconv.Itoa(code)).Inc()
	s.m.duration.WithLabelValues(label).Observe(time.Since(arrived).Seconds())
	return code
}

func (s *Server) executeInner(parent context.Context, w http.ResponseWriter, j *job, rid string, arrived time.Time) int {
	ctx, cancel := context.WithCancelCause(parent)
	defer cancel(nil)
	stop := context.AfterFunc(s.base, func() { cancel(context.Cause(s.base)) })
	defer stop()

	if err := s.lim.acquire(ctx); err != nil {
		if ctx.Err() != nil && !errors.Is(context.Cause(ctx), errShuttingDown) {
			return statusClientClosed
		}
		e := &apiError{Status: 429, Type: typeRateLimit, Code: "rate_limit_exceeded", RetryAfter: s.cfg.RetryAfter,
			Message: "Too many requests in flight: " + err.Error() + "; retry later."}
		e.write(w)
		return e.Status
	}
	defer s.lim.release()

	// A client that stops reading would block a write forever and, with it,
	// Shutdown. Once the request's context ends, writes get a short deadline:
	// enough for a final error event to a live client, not a hang on a stalled one.
	var dlMu sync.Mutex
	handlerDone := false
	stopDeadline := context.AfterFunc(ctx, func() {
		dlMu.Lock()
		defer dlMu.Unlock()
		if !handlerDone { // after the handler returns the connection may serve another request
			_ = http.NewResponseController(w).SetWriteDeadline(time.Now().Add(s.cfg.FinalWriteTimeout))
		}
	})
	defer func() {
		stopDeadline()
		dlMu.Lock()
		handlerDone = true
		dlMu.Unlock()
	}()

	if e := s.detokenizeEchoes(ctx, j); e != nil {
		e.write(w)
		return e.Status
	}
	head := newHead(j, arrived)
	if j.choices != nil {
		return s.runChoices(ctx, w, j, rid, head, arrived)
	}
	or := &openRequest{key: s.nextKey.Add(1), requestID: rid, gen: j.gen}
	j.gen.Key, j.gen.RequestId = or.key, rid
	s.register(or)
	defer s.unregister(or)
	var out output
	switch {
	case j.resp != nil:
		out = newResponsesOutput(w, j, head, s.cfg.KeepAliveInterval, s.modelInfo().MaxModelLen)
	case j.stream:
		out = newSSEOutput(w, j, head, s.cfg.KeepAliveInterval)
	default:
		out = newJSONOutput(w, j, head)
	}
	return s.run(ctx, j, or, out, arrived)
}

// newHead is a new response's id, object, time and model.
func newHead(j *job, arrived time.Time) responseHead {
	head := responseHead{created: arrived.Unix(), model: j.model}
	switch {
	case j.endpoint == endpointResponses: // vLLM's: resp_ and a uuid's 32 hex digits
		head.id, head.object = "resp_"+randomID(16), "response"
	case j.endpoint == endpointChat && j.stream:
		head.id, head.object = "chatcmpl-"+randomID(12), "chat.completion.chunk"
	case j.endpoint == endpointChat:
		head.id, head.object = "chatcmpl-"+randomID(12), "chat.completion"
	default:
		head.id, head.object = "cmpl-"+randomID(12), "text_completion"
	}
	return head
}

// randomSeed is the seed of a request that gave none.
func randomSeed() uint64 {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return binary.LittleEndian.Uint64(b[:]) >> 1
}

func (s *Server) enter() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closing {
		return false
	}
	s.active++
	return true
}

func (s *Server) leave() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.active--
	if s.closing && s.active == 0 && !s.draining {
		s.draining = true
		close(s.drained)
	}
}

func (s *Server) register(or *openRequest) {
	s.mu.Lock()
	s.open[or.key] = or
	s.mu.Unlock()
}

func (s *Server) unregister(or *openRequest) {
	s.mu.Lock()
	delete(s.open, or.key)
	s.mu.Unlock()
}

// OpenRequests returns every request that an engine is (or was, before it
// died) working on: original input, parameters with the seed, and the token
// ids already delivered to the client. The supervisor adds the ring snapshot.
// Requests not yet sent to any engine are left out: they will start afresh.
func (s *Server) OpenRequests() []*frmpsv1.ResumeRequest {
	s.mu.Lock()
	reqs := make([]*openRequest, 0, len(s.open))
	for _, or := range s.open {
		reqs = append(reqs, or)
	}
	s.mu.Unlock()
	out := make([]*frmpsv1.ResumeRequest, 0, len(reqs))
	for _, or := range reqs {
		if rr, ok := or.resumeRequest(); ok {
			out = append(out, rr)
		}
	}
	return out
}

// Shutdown stops accepting requests (503) and waits for open ones to finish.
// When ctx ends first, the remaining requests are aborted (streams get an
// in-stream error event) and Shutdown returns ctx's error once they have
// ended. Call it before http.Server.Shutdown, which waits for handlers.
func (s *Server) Shutdown(ctx context.Context) error {
	s.mu.Lock()
	if !s.closing {
		s.closing = true
		if s.active == 0 {
			s.draining = true
			close(s.drained)
		}
	}
	s.mu.Unlock()
	if s.idem != nil {
		defer s.idem.close()
	}
	select {
	case <-s.drained:
		return nil
	case <-ctx.Done():
	}
	s.cancelBase(errShuttingDown)
	<-s.drained
	return fmt.Errorf("shutdown front door: %w", ctx.Err())
}
