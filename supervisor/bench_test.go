package supervisor

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/frmps/frmps/supervisor/failover"
)

// BenchmarkDetectToResume measures, on the in-memory fakes (no processes),
// the supervisor's own share of a failover: from the active's death
// detected (its control socket closed) to the Resume command sent, and to
// the resume acknowledged. It prints p50 and p99. The real-process figure
// comes from TestRealSIGKILLSoak (integration build).
func BenchmarkDetectToResume(b *testing.B) {
	w := newWorld()
	cfg := testConfig(b)
	cfg.Breaker = failover.BreakerConfig{MaxRestarts: 1 << 30, Window: time.Millisecond, BaseBackoff: 0, MaxBackoff: 0}
	s, err := NewWithDeps(cfg, w.deps(), hclog.NewNullLogger(), prometheus.NewRegistry())
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	wait := func(ok func() bool) {
		for deadline := time.Now().Add(10 * time.Second); !ok(); time.Sleep(20 * time.Microsecond) {
			if time.Now().After(deadline) {
				b.Fatalf("stuck: %v", s.Status())
			}
		}
	}
	ready := func() bool { return s.Status().GetState() == "serving_ready" }
	wait(ready)
	var acked []time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		act, _ := roleProcs(w, s)
		seq := uint64(i + 1)
		act.Kill()
		wait(func() bool {
			st := s.Status()
			// and the failback that follows it done, so the next kill hits the serving active
			return st.GetState() == "serving_ready" && len(st.GetFailovers()) > 0 && st.GetFailovers()[0].GetSeq() == seq &&
				st.GetFailback().GetState() == "idle"
		})
		acked = append(acked, time.Duration(s.Status().GetFailovers()[0].GetDurationSeconds()*float64(time.Second)))
	}
	b.StopTimer()
	sent := s.failovers.detectToResumeSeen()
	cancel()
	if err := <-done; err != nil {
		b.Fatal(err)
	}
	report := func(name string, d []time.Duration) {
		slices.Sort(d)
		if len(d) == 0 {
			return
		}
		p50, p99 := d[len(d)/2], d[len(d)*99/100]
		b.ReportMetric(float64(p50.Nanoseconds())/1e3, name+"-p50-µs")
		b.ReportMetric(float64(p99.Nanoseconds())/1e3, name+"-p99-µs")
	}
	report("detect-to-resume-sent", sent)
	report("detect-to-resume-acked", acked)
}

func roleProcs(w *fakeWorld, s *Supervisor) (active, standby *fakeProc) {
	byPID := map[int32]*fakeProc{}
	w.mu.Lock()
	for _, p := range w.procs {
		byPID[int32(p.pid)] = p
	}
	w.mu.Unlock()
	for _, e := range s.Status().GetEngines() {
		if e.GetRole() == "active" {
			active = byPID[e.GetPid()]
		} else {
			standby = byPID[e.GetPid()]
		}
	}
	return active, standby
}

// TestStatusDuringFailoversRealTime runs failovers in real time (outside a
// synctest bubble) while another goroutine reads Status, Model and Serving
// without pause, so the race detector sees them overlap with every step.
func TestStatusDuringFailoversRealTime(t *testing.T) {
	w := newWorld()
	cfg := testConfig(t)
	cfg.Breaker = failover.BreakerConfig{MaxRestarts: 1 << 30, Window: time.Millisecond}
	s, err := NewWithDeps(cfg, w.deps(), hclog.NewNullLogger(), prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	stopRead := make(chan struct{})
	readDone := make(chan struct{})
	go func() {
		defer close(readDone)
		for {
			select {
			case <-stopRead:
				return
			default:
				_, _, _ = s.Status(), s.Serving(), s.Status().GetEngines()
			}
		}
	}()
	go func() { done <- s.Run(ctx) }()
	wait := func(what string, ok func() bool) {
		for deadline := time.Now().Add(20 * time.Second); !ok(); time.Sleep(50 * time.Microsecond) {
			if time.Now().After(deadline) {
				t.Fatalf("waiting for %s: %v", what, s.Status())
			}
		}
	}
	wait("ready", func() bool { return s.Status().GetState() == "serving_ready" })
	for i := range 30 { // each kill: a failover, then a failback
		act, _ := roleProcs(w, s)
		act.Kill()
		seq := uint64(i + 1)
		wait("failover", func() bool {
			st := s.Status()
			// and the failback that follows it done, so the next kill hits the serving active
			return st.GetState() == "serving_ready" && len(st.GetFailovers()) > 0 && st.GetFailovers()[0].GetSeq() == seq &&
				st.GetFailback().GetState() == "idle"
		})
	}
	close(stopRead)
	<-readDone
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}
