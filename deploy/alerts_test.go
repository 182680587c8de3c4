package deploy_test

import (
	"context"
	"io"
	"log/slog"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/promql/promqltest"
	"github.com/prometheus/prometheus/rules"
)

// firing evaluates every alerting rule over the series in load (promqltest's
// notation, one sample per 15s from time 0), every 15s as Prometheus would,
// and returns the alerts firing at the end.
func firing(t *testing.T, load string, until time.Duration) []string {
	t.Helper()
	var in strings.Builder
	in.WriteString("load 15s\n")
	for _, line := range strings.Split(load, "\n") {
		if strings.TrimSpace(line) != "" {
			in.WriteString("  " + strings.TrimSpace(line) + "\n")
		}
	}
	storage := promqltest.LoadedStorage(t, in.String())
	engine := promqltest.NewTestEngine(t, false, 5*time.Minute, promqltest.DefaultMaxSamplesPerQuery)
	query := rules.EngineQueryFunc(engine, storage)
	logger := slog.New(slog.NewTextHandler(io.Discard, nil))
	var out []string
	for _, g := range loadRules(t).Groups {
		for _, r := range g.Rules {
			if r.Alert == "" {
				continue
			}
			expr, err := promqlParser.ParseExpr(r.Expr)
			if err != nil {
				t.Fatal(err)
			}
			rule := rules.NewAlertingRule(r.Alert, expr, time.Duration(r.For), time.Duration(r.KeepFiringFor),
				labels.FromMap(r.Labels), labels.FromMap(r.Annotations), labels.EmptyLabels(), "", true, logger)
			for ts := time.Duration(0); ts <= until; ts += 15 * time.Second {
				if _, err := rule.Eval(context.Background(), 0, time.Unix(0, 0).Add(ts), query, nil, 0); err != nil {
					t.Fatalf("%s at %s: %v", r.Alert, ts, err)
				}
			}
			for _, a := range rule.ActiveAlerts() {
				if a.State == rules.StateFiring {
					out = append(out, r.Alert)
					break
				}
			}
		}
	}
	sort.Strings(out)
	return out
}

// healthy is a deployment serving with a standby, under steady traffic.
const healthy = `
frmps_engine_up{instance="a",model_name="m",role="active"} 1x240
frmps_engine_up{instance="a",model_name="m",role="standby"} 1x240
frmps_engine_restarts_total{instance="a",model_name="m",role="active"} 0x240
frmps_engine_restarts_total{instance="a",model_name="m",role="standby"} 0x240
frmps_crash_loop_open{instance="a",model_name="m"} 0x240
frmps_ring_lag_records{instance="a",model_name="m"} 0x240
frmps_ring_resyncs_total{instance="a",model_name="m"} 1x240
frmps_requests_total{instance="a",model_name="m",endpoint="chat",code="200"} 0+10x240
frmps_time_to_first_token_seconds_bucket{instance="a",model_name="m",le="0.1"} 0+10x240
frmps_time_to_first_token_seconds_bucket{instance="a",model_name="m",le="+Inf"} 0+10x240
`

// Each alert fires on its trouble and only then; a healthy deployment and a
// drill fire nothing.
func TestAlertsFire(t *testing.T) {
	for _, tc := range []struct {
		name  string
		load  string
		until time.Duration
		want  []string
	}{
		{"healthy", healthy, time.Hour, nil},
		{"a failover's gap", `
frmps_engine_up{instance="a",model_name="m",role="active"} 1x10 0 0 1x40
frmps_engine_up{instance="a",model_name="m",role="standby"} 1x10 0 0 0 0 1x40
frmps_crash_loop_open{instance="a",model_name="m"} 0x60
`, 15 * time.Minute, nil},
		{"drills are not failovers", healthy + `frmps_failovers_total{instance="a",model_name="m",cause="drill"} 0 1 2 3 4 5x60`, 15 * time.Minute, nil},
		{"crash loop", `
frmps_crash_loop_open{instance="a",model_name="m"} 0x20 1x40
frmps_engine_up{instance="a",model_name="m",role="active"} 1x20 0x40
frmps_engine_up{instance="a",model_name="m",role="standby"} 1x20 0x40
`, 15 * time.Minute, []string{"FrmpsCrashLoop", "FrmpsNotServing"}},
		{"a failover", healthy + `
frmps_failovers_total{instance="a",model_name="m",cause="mmu_fault"} 0x10 1x60
frmps_engine_restarts_total{instance="a",model_name="m",role="standby"} 0x10 1x60
frmps_failover_duration_seconds_bucket{instance="a",model_name="m",le="0.05"} 0x10 1x60
frmps_failover_duration_seconds_bucket{instance="a",model_name="m",le="+Inf"} 0x10 1x60
`, 5 * time.Minute, []string{"FrmpsFailover"}},
		{"failovers every few minutes", `
frmps_failovers_total{instance="a",model_name="m",cause="mmu_fault"} 0+1x20 20x40
frmps_failovers_total{instance="a",model_name="m",cause="xid"} 0+1x60
`, 15 * time.Minute, []string{"FrmpsFailover", "FrmpsFrequentFailovers"}},
		{"slow takeovers", `
frmps_failover_duration_seconds_bucket{instance="a",model_name="m",le="0.05"} 0x60
frmps_failover_duration_seconds_bucket{instance="a",model_name="m",le="4"} 0+1x60
frmps_failover_duration_seconds_bucket{instance="a",model_name="m",le="+Inf"} 0+1x60
`, 15 * time.Minute, []string{"FrmpsSlowTakeover"}},
		{"standby gone", `
frmps_engine_up{instance="a",model_name="m",role="active"} 1x60
frmps_engine_up{instance="a",model_name="m",role="standby"} 1x10 0x50
frmps_engine_restarts_total{instance="a",model_name="m",role="standby"} 0x10 1 2 3 4 5 6x40
`, 15 * time.Minute, []string{"FrmpsEngineRestarts", "FrmpsStandbyMissing"}},
		{"spares on, one ready after each use", healthy + `
frmps_spare_enabled{instance="a",model_name="m"} 1x240
frmps_spare_ready{instance="a",model_name="m"} 1x20 0 0 1x30 0x3 1x186
`, time.Hour, nil},
		{"spares off", healthy + `
frmps_spare_enabled{instance="a",model_name="m"} 0x240
frmps_spare_ready{instance="a",model_name="m"} 0x240
`, time.Hour, nil},
		{"spares failing", healthy + `
frmps_spare_enabled{instance="a",model_name="m"} 1x240
frmps_spare_ready{instance="a",model_name="m"} 1x20 0x220
`, time.Hour, []string{"FrmpsSpareUnavailable"}},
		{"streams cut at a failover", healthy + `frmps_stream_resumes_total{instance="a",model_name="m",outcome="failed"} 0x10 2x60`,
			5 * time.Minute, []string{"FrmpsResumeFailures"}},
		{"ring behind", `
frmps_ring_lag_records{instance="a",model_name="m"} 0x10 5000x40
frmps_ring_resyncs_total{instance="a",model_name="m"} 1x10 2 3 4 5 6x40
`, 10 * time.Minute, []string{"FrmpsRingLag", "FrmpsRingResyncs"}},
		{"errors and slow first tokens", `
frmps_requests_total{instance="a",model_name="m",endpoint="chat",code="200"} 0+10x80
frmps_requests_total{instance="a",model_name="m",endpoint="chat",code="503"} 0+2x80
frmps_time_to_first_token_seconds_bucket{instance="a",model_name="m",le="5"} 0x80
frmps_time_to_first_token_seconds_bucket{instance="a",model_name="m",le="30"} 0+10x80
frmps_time_to_first_token_seconds_bucket{instance="a",model_name="m",le="+Inf"} 0+10x80
`, 20 * time.Minute, []string{"FrmpsErrors", "FrmpsSlowFirstToken"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := firing(t, tc.load, tc.until); !slices.Equal(got, tc.want) {
				t.Errorf("firing %v, want %v", got, tc.want)
			}
		})
	}
}
