package openai

import (
	"bytes"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/prometheus/client_golang/prometheus"
)

// A resumed stream's phases go to the histogram; one whose first token came
// 50 ms or more after its old stream broke is also logged, phase by phase.
func TestResumePhasesSlowResumeIsLogged(t *testing.T) {
	reg := prometheus.NewRegistry()
	m, err := newMetrics(reg, "test-model")
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	s := &Server{m: m, log: hclog.New(&hclog.LoggerOptions{Output: &buf})}
	t0 := time.Now()
	s.noteResumePhases(7, 3, t0, t0.Add(2*time.Millisecond), t0.Add(3*time.Millisecond), t0.Add(13*time.Millisecond))
	if buf.Len() != 0 {
		t.Fatalf("a 13 ms resume was logged: %s", buf.String())
	}
	s.noteResumePhases(8, 4, t0, t0.Add(2*time.Millisecond), t0.Add(3*time.Millisecond), t0.Add(90*time.Millisecond))
	line := buf.String()
	for _, want := range []string{"slow stream resume", "key=8", "generation=4", "total=90ms", "waited_for_engine=2ms", "stream_open=1ms", "first_token_after_open=87ms"} {
		if !strings.Contains(line, want) {
			t.Errorf("log %q lacks %q", line, want)
		}
	}
	s.noteResumePhases(9, 5, time.Time{}, t0, t0, t0) // no break seen: nothing recorded
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != "frmps_stream_resume_phase_seconds" {
			continue
		}
		for _, mm := range mf.GetMetric() {
			if n := mm.GetHistogram().GetSampleCount(); n != 2 {
				t.Errorf("%v: %d samples, want 2", mm.GetLabel(), n)
			}
		}
		return
	}
	t.Fatal("no frmps_stream_resume_phase_seconds")
}
