package supervisor

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/frmps/frmps/supervisor/failover"
)

func TestFailoverSplitNamesEachStepFromTheOneBefore(t *testing.T) {
	t0 := time.Unix(100, 0)
	fo := &failoverRun{handled: t0, fenced: t0.Add(10 * time.Microsecond), drained: t0.Add(30 * time.Microsecond),
		built: t0.Add(330 * time.Microsecond), sent: t0.Add(1330 * time.Microsecond)}
	want := "fenced +10µs, ring drained +20µs, resume set +300µs, sent +1ms"
	if got := fo.split(); got != want {
		t.Fatalf("split = %q, want %q", got, want)
	}
	fo.fenced, fo.drained = time.Time{}, time.Time{} // steps that did not run are left out
	if got := fo.split(); got != "resume set +330µs, sent +1ms" {
		t.Fatalf("split without fence and drain = %q", got)
	}
	if got := (&failoverRun{}).split(); got != "" {
		t.Fatalf("split of nothing = %q", got)
	}
}

// runLogged runs a supervisor (no failback) over w whose log goes to out, up to
// its engines' start; stop ends the run.
func runLogged(t *testing.T, w *fakeWorld, out io.Writer, opts ...func(*Config)) (s *Supervisor, stop func()) {
	t.Helper()
	cfg := testConfig(t)
	cfg.NoFailback = true
	for _, o := range opts {
		o(&cfg)
	}
	log := hclog.New(&hclog.LoggerOptions{Output: out, Level: hclog.Info})
	s, err := NewWithDeps(cfg, w.deps(), log, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	s.SetFrontDoor(w.front)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	synctest.Wait()
	return s, func() { cancel(); <-done }
}

type lockedBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuf) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}
func (l *lockedBuf) String() string { l.mu.Lock(); defer l.mu.Unlock(); return l.b.String() }

// A failover's "failover done" line says where the way from the loop taking
// the death up to the Resume being sent went, step by step.
func TestFailoverDoneLogsTheWayToTheResume(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		w := newWorld()
		var out lockedBuf
		_, stop := runLogged(t, w, &out)
		w.liveRole(failover.Active).Kill()
		synctest.Wait()
		stop()
		var line string
		for _, l := range strings.Split(out.String(), "\n") {
			if strings.Contains(l, "failover done") {
				line = l
			}
		}
		if line == "" {
			t.Fatalf("no 'failover done' line in:\n%s", out.String())
		}
		for _, want := range []string{"loop_after=", `then="fenced +`, ", ring drained +", ", resume set +", ", sent +"} {
			if !strings.Contains(line, want) {
				t.Fatalf("%q not in %s", want, line)
			}
		}
	})
}

// orderProbe is a log output that notes, at the first line containing mark,
// whether the process it watches was still alive.
type orderProbe struct {
	lockedBuf
	mark      string
	proc      *fakeProc
	seen      bool
	aliveThen bool
}

func (o *orderProbe) Write(p []byte) (int, error) {
	o.mu.Lock()
	if !o.seen && o.proc != nil && strings.Contains(string(p), o.mark) {
		o.seen, o.aliveThen = true, o.proc.alive()
	}
	o.mu.Unlock()
	return o.lockedBuf.Write(p)
}

// The MPS server's teardown of the active (its process still alive) fences the
// active before anything is logged about its death and before the machine
// steps: the SIGKILL is the first thing on the way to the Resume, and the
// split shows it.
func TestDeadActiveIsFencedBeforeTheLogsAndTheStep(t *testing.T) {
	for _, tp := range []int{1, 2} {
		t.Run(fmt.Sprintf("tp%d", tp), func(t *testing.T) { testFencedFirst(t, tp) })
	}
}

// testFencedFirst: with one rank the leader is fenced first and its group once
// the Resume is sent (the split says so); with ranks in other processes of the
// group, the whole group first.
func testFencedFirst(t *testing.T, tp int) {
	synctest.Test(t, func(t *testing.T) {
		w := newWorld()
		w.mps.logDir = t.TempDir()
		probe := &orderProbe{mark: "engine died"}
		s, stop := runLogged(t, w, probe, func(c *Config) { c.TensorParallelSize = tp })
		act := w.liveRole(failover.Active)
		probe.mu.Lock()
		probe.proc = act
		probe.mu.Unlock()
		appendServerLog(t, w.mps.logDir, fmt.Sprintf("[2026-11-28 17:04:22.012 Server  1997] Client {PID: %d, Context ID: 1} on device 0 to be torn down", act.pid))
		time.Sleep(10 * time.Millisecond)
		synctest.Wait()
		stop()
		probe.mu.Lock()
		seen, alive := probe.seen, probe.aliveThen
		probe.mu.Unlock()
		if !seen {
			t.Fatalf("no 'engine died' line in:\n%s", probe.String())
		}
		if alive {
			t.Fatalf("the active was still alive when its death was logged:\n%s", probe.String())
		}
		recs := s.Status().Failovers
		if len(recs) != 1 || recs[0].GetCause() != "mps_fault" || !recs[0].GetOk() {
			t.Fatalf("records %v", recs)
		}
		kills := act.killed()
		line := probe.String()
		if i := strings.Index(line, "failover done"); i >= 0 {
			line = line[i:]
		}
		if j := strings.IndexByte(line, '\n'); j >= 0 {
			line = line[:j]
		}
		if tp == 1 {
			if len(kills) < 2 || kills[0] != "leader" || kills[1] != "group" {
				t.Fatalf("one rank: kills %v, want the leader, then the group", kills)
			}
			if !regexp.MustCompile(`then="fenced \+[^"]*, sent \+[^"]*, group fenced \+[^"]*"`).MatchString(line) {
				t.Fatalf("one rank: the group is not fenced after the Resume is sent: %s", line)
			}
		} else {
			if len(kills) == 0 || kills[0] != "group" || slices.Contains(kills, "leader") {
				t.Fatalf("tensor parallel: kills %v, want the group first and never the leader alone", kills)
			}
			if strings.Contains(line, "group fenced") || !strings.Contains(line, `then="fenced +`) {
				t.Fatalf("tensor parallel: %s", line)
			}
		}
	})
}
