package openai

import (
	"github.com/prometheus/client_golang/prometheus"
)

type metrics struct {
	requests       *prometheus.CounterVec
	duration       *prometheus.HistogramVec
	ttft           prometheus.Observer
	resumes        *prometheus.CounterVec
	tokens         prometheus.Counter
	inflight       prometheus.Gauge
	queued         prometheus.Gauge
	idempotentHits prometheus.Counter
	chunkOverhead  prometheus.Observer
	resumePhase    *prometheus.HistogramVec
}

func newMetrics(reg prometheus.Registerer, model string) (*metrics, error) {
	labels := prometheus.Labels{"model_name": model}
	latency := []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300}
	requests := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "frmps_requests_total", Help: "OpenAI API requests by endpoint and outcome (HTTP status; 499 = client went away; an in-stream error counts as its error status).",
		ConstLabels: labels}, []string{"endpoint", "code"})
	duration := prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name: "frmps_request_duration_seconds", Help: "Time from request arrival to the last byte of the response.",
		ConstLabels: labels, Buckets: latency}, []string{"endpoint"})
	ttft := prometheus.NewHistogram(prometheus.HistogramOpts{
		Name: "frmps_time_to_first_token_seconds", Help: "Time from request arrival to the first output token handed to the client.",
		ConstLabels: labels, Buckets: latency})
	resumes := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "frmps_stream_resumes_total", Help: "Open requests re-attached to a new engine after a failover, by outcome (ok, failed).",
		ConstLabels: labels}, []string{"outcome"})
	tokens := prometheus.NewCounter(prometheus.CounterOpts{
		Name: "frmps_tokens_generated_total", Help: "Output tokens delivered to clients (each token once, across failovers).",
		ConstLabels: labels})
	inflight := prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "frmps_inflight_requests", Help: "Requests holding a concurrency slot.", ConstLabels: labels})
	queued := prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "frmps_queued_requests", Help: "Requests waiting for a concurrency slot.", ConstLabels: labels})
	idem := prometheus.NewCounter(prometheus.CounterOpts{
		Name: "frmps_idempotent_replays_total", Help: "Requests answered from, or attached to, an earlier request with the same Idempotency-Key.",
		ConstLabels: labels})
	overhead := prometheus.NewHistogram(prometheus.HistogramOpts{
		Name: "frmps_stream_chunk_overhead_seconds", Help: "Front door time per streamed chunk: from receiving it from the engine to handing it to the client's socket.",
		ConstLabels: labels, Buckets: []float64{1e-6, 2e-6, 3e-6, 5e-6, 7.5e-6, 1e-5, 1.5e-5, 2e-5, 3e-5, 5e-5, 7.5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 5e-3, 2e-2}})
	resumePhase := prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name: "frmps_stream_resume_phase_seconds",
		Help: "A stream resumed after a failover, by phase: engine (its engine's stream broke -> a newer engine published), " +
			"open (-> the resume stream opened on it), first_token (-> its first resumed token received).",
		ConstLabels: labels, Buckets: latency}, []string{"phase"})
	m := &metrics{requests: requests, duration: duration, ttft: ttft, resumes: resumes, tokens: tokens,
		inflight: inflight, queued: queued, idempotentHits: idem, chunkOverhead: overhead, resumePhase: resumePhase}
	for _, c := range []prometheus.Collector{requests, duration, ttft, resumes, tokens, inflight, queued, idem, overhead, resumePhase} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	// Every label value known in advance starts at zero, so that each series
	// is on the first scrape: every endpoint (its success code; other codes
	// appear with their first request), both resume outcomes, every phase.
	for _, ep := range endpoints {
		requests.WithLabelValues(ep.String(), "200").Add(0)
		duration.WithLabelValues(ep.String())
	}
	for _, o := range []string{"ok", "failed"} {
		resumes.WithLabelValues(o).Add(0)
	}
	for _, p := range []string{"engine", "open", "first_token"} {
		resumePhase.WithLabelValues(p)
	}
	return m, nil
}
