package supervisor

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/frmps/frmps/supervisor/deathcause"
)

// Every counter with label values known in advance is exported, at zero,
// before its first event: one series per failover cause, per role, per
// failback result, per launch source.
func TestMetricsOnFirstScrape(t *testing.T) {
	reg := prometheus.NewRegistry()
	m, err := newMetrics(reg, "m")
	if err != nil {
		t.Fatal(err)
	}
	for name, want := range map[string]int{
		"frmps_failovers_total":           len(deathcause.Classes()) + 4,
		"frmps_engine_up":                 2,
		"frmps_engine_restarts_total":     2,
		"frmps_failbacks_total":           2,
		"frmps_engine_launches_total":     2,
		"frmps_failover_duration_seconds": 1,
		"frmps_crash_loop_open":           1,
	} {
		if n, err := testutil.GatherAndCount(reg, name); err != nil || n != want {
			t.Errorf("%s: %d series before any event, want %d (%v)", name, n, want, err)
		}
	}
	for _, c := range []string{"drill", "stalled", "hung", "mps_fault", "signal", "illegal_memory_access"} {
		if v := testutil.ToFloat64(m.failovers.WithLabelValues(c)); v != 0 {
			t.Errorf("frmps_failovers_total{cause=%q} = %v before any failover", c, v)
		}
	}
}
