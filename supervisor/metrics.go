package supervisor

import (
	"fmt"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/frmps/frmps/supervisor/buildinfo"
	"github.com/frmps/frmps/supervisor/deathcause"
	"github.com/frmps/frmps/supervisor/failover"
)

// metrics of one deployment, on an injected registry, all labelled with
// model_name so they sit beside vLLM's.
type metrics struct {
	reg              prometheus.Registerer
	model            string
	failovers        *prometheus.CounterVec
	duration         prometheus.Histogram
	resumeSentIn     prometheus.Histogram
	engineUp         *prometheus.GaugeVec
	restarts         *prometheus.CounterVec
	crashLoopG       prometheus.Gauge
	failbacks        *prometheus.CounterVec
	failbackDur      prometheus.Histogram
	placementRestore prometheus.Histogram
	placementG       prometheus.Gauge
	firstTokenIn     prometheus.Histogram
	launchesFrom     *prometheus.CounterVec
	spareReadyG      prometheus.Gauge
	spareOnG         prometheus.Gauge
	primedG          prometheus.Gauge

	mu       sync.Mutex
	launches [2]uint32
}

func newMetrics(reg prometheus.Registerer, model string) (*metrics, error) {
	if reg == nil {
		reg = prometheus.NewRegistry() // unexported: metrics then go nowhere
	}
	cl := prometheus.Labels{"model_name": model}
	m := &metrics{
		reg: reg, model: model,
		failovers: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "frmps_failovers_total",
			Help: "Completed failovers by death cause of the old active.", ConstLabels: cl}, []string{"cause"}),
		duration: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "frmps_failover_duration_seconds",
			Help: "Time from the active's death detected to the standby's resume acknowledged.", ConstLabels: cl,
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 16)}),
		resumeSentIn: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "frmps_failover_detect_to_resume_seconds",
			Help: "Time from the active's death detected to the Resume command sent.", ConstLabels: cl,
			Buckets: prometheus.ExponentialBuckets(0.00001, 2, 16)}),
		engineUp: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "frmps_engine_up",
			Help: "1 when the engine of this role is ready.", ConstLabels: cl}, []string{"role"}),
		restarts: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "frmps_engine_restarts_total",
			Help: "Engine launches beyond the first, per role.", ConstLabels: cl}, []string{"role"}),
		crashLoopG: prometheus.NewGauge(prometheus.GaugeOpts{Name: "frmps_crash_loop_open",
			Help: "1 when a crash-loop breaker stopped engine restarts.", ConstLabels: cl}),
		failbacks: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "frmps_failbacks_total",
			Help: "Planned handovers that restore the placement after a failover (the active back in MPS), by result.", ConstLabels: cl}, []string{"result"}),
		failbackDur: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "frmps_failback_duration_seconds",
			Help: "Time from Handoff sent to the standby's Resume acknowledged, per planned handover.", ConstLabels: cl,
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 16)}),
		placementRestore: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "frmps_placement_restore_seconds",
			Help: "Time from the death of an active inside MPS to the failback that put an active back inside MPS " +
				"(the placement restored; failed handovers in between included).", ConstLabels: cl,
			Buckets: prometheus.ExponentialBuckets(0.25, 2, 10)}),
		placementG: prometheus.NewGauge(prometheus.GaugeOpts{Name: "frmps_placement_ok",
			Help: "1 when the active runs in MPS and the standby outside it (or MPS is off).", ConstLabels: cl}),
		firstTokenIn: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "frmps_failover_first_token_seconds",
			Help: "Time from the active's death detected to the first resumed token reaching a client.", ConstLabels: cl,
			Buckets: prometheus.ExponentialBuckets(0.001, 2, 16)}),
		launchesFrom: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "frmps_engine_launches_total",
			Help: "Engine launches, by how: from a spare (an engine process started ahead of need) or cold.", ConstLabels: cl}, []string{"from"}),
		spareReadyG: prometheus.NewGauge(prometheus.GaugeOpts{Name: "frmps_spare_ready",
			Help: "Spare engine processes ready (their imports done) to become the next engine (at most --spares).", ConstLabels: cl}),
		spareOnG: prometheus.NewGauge(prometheus.GaugeOpts{Name: "frmps_spare_enabled",
			Help: "1 when spares are configured (--spare; auto: on for GPU devices), whether or not one is ready.", ConstLabels: cl}),
		primedG: prometheus.NewGauge(prometheus.GaugeOpts{Name: "frmps_fault_path_primed_gpus",
			Help: "GPUs whose first fault frmps paid at start (--prime-fault-path), so that the first real one is not the slow one.", ConstLabels: cl}),
	}
	bi := buildinfo.Get()
	build := prometheus.NewGauge(prometheus.GaugeOpts{Name: "frmps_build_info", Help: "Build of this frmps.",
		ConstLabels: prometheus.Labels{"model_name": model, "version": bi.Version, "commit": bi.Commit, "goversion": bi.GoVersion}})
	build.Set(1)
	for _, c := range []prometheus.Collector{m.failovers, m.duration, m.resumeSentIn, m.engineUp, m.restarts, m.crashLoopG,
		m.failbacks, m.failbackDur, m.placementRestore, m.placementG, m.firstTokenIn, m.launchesFrom, m.spareReadyG, m.spareOnG, m.primedG, build} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("register metrics: %w", err)
		}
	}
	// Every label value known in advance starts at zero, so that each series
	// is on the first scrape (dashboards and alerts read "No data" otherwise,
	// and increase() misses the first event).
	for _, c := range failoverClasses() {
		m.failovers.WithLabelValues(c).Add(0)
	}
	for _, r := range []string{"active", "standby"} {
		m.engineUp.WithLabelValues(r).Set(0)
		m.restarts.WithLabelValues(r).Add(0)
	}
	for _, r := range []string{"ok", "failed"} {
		m.failbacks.WithLabelValues(r).Add(0)
	}
	for _, f := range []string{"spare", "cold"} {
		m.launchesFrom.WithLabelValues(f).Add(0)
	}
	return m, nil
}

// failoverClasses lists every cause label frmps_failovers_total can carry:
// the classes of a classified exit and those the supervisor gives itself.
func failoverClasses() []string {
	return append(deathcause.Classes(), classDrill, classStalled, classHung, classMPSFault)
}

func (m *metrics) ringLagFn(f func() float64) {
	_ = m.reg.Register(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "frmps_ring_lag_records",
		Help: "Ring records committed but not yet consumed.", ConstLabels: prometheus.Labels{"model_name": m.model}}, f))
}

func (m *metrics) ringResyncsFn(f func() float64) {
	_ = m.reg.Register(prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "frmps_ring_resyncs_total",
		Help: "Full resyncs the ring reader requested (overrun or corrupt record).", ConstLabels: prometheus.Labels{"model_name": m.model}}, f))
}

func (m *metrics) failover(cause string)            { m.failovers.WithLabelValues(cause).Inc() }
func (m *metrics) failoverDuration(d time.Duration) { m.duration.Observe(d.Seconds()) }
func (m *metrics) resumeSent(d time.Duration)       { m.resumeSentIn.Observe(d.Seconds()) }
func (m *metrics) firstToken(d time.Duration)       { m.firstTokenIn.Observe(d.Seconds()) }
func (m *metrics) up(r failover.Role, up bool)      { m.engineUp.WithLabelValues(r.String()).Set(b2f(up)) }
func (m *metrics) crashLoop(open bool)              { m.crashLoopG.Set(b2f(open)) }
func (m *metrics) placement(ok bool)                { m.placementG.Set(b2f(ok)) }
func (m *metrics) primed(gpus int)                  { m.primedG.Set(float64(gpus)) }
func (m *metrics) spare(enabled bool, ready int) {
	m.spareOnG.Set(b2f(enabled))
	m.spareReadyG.Set(float64(ready))
}

func (m *metrics) launched(fromSpare bool) {
	if fromSpare {
		m.launchesFrom.WithLabelValues("spare").Inc()
		return
	}
	m.launchesFrom.WithLabelValues("cold").Inc()
}

func (m *metrics) placementRestored(d time.Duration) { m.placementRestore.Observe(d.Seconds()) }

func (m *metrics) failback(ok bool, d time.Duration) {
	if ok {
		m.failbacks.WithLabelValues("ok").Inc()
		m.failbackDur.Observe(d.Seconds())
		return
	}
	m.failbacks.WithLabelValues("failed").Inc()
}

// started counts a launch of role and returns how many came before it.
func (m *metrics) started(r failover.Role) uint32 {
	m.mu.Lock()
	defer m.mu.Unlock()
	n := m.launches[r]
	m.launches[r]++
	if n > 0 {
		m.restarts.WithLabelValues(r.String()).Inc()
	}
	return n
}

func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}
