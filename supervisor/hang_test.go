package supervisor

import (
	"cmp"
	"fmt"
	"os"
	"runtime"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"golang.org/x/sys/unix"

	"github.com/frmps/frmps/internal/testenv"
	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
	"github.com/frmps/frmps/supervisor/failover"
)

func TestHangPolicyDerivedTimes(t *testing.T) {
	cfg := Config{Model: "m", Engine: "ref"}
	cfg.setDefaults()
	p := cfg.hangPolicy()
	if p.heartbeat != time.Second || p.stepFactor != 8 || p.stepMin != time.Second || p.stepDefault != time.Minute {
		t.Fatalf("defaults %+v", p)
	}
	if got := p.beatInterval(); got != 125*time.Millisecond {
		t.Fatalf("beat interval %s", got)
	}
	if got := p.tick(); got != 50*time.Millisecond {
		t.Fatalf("tick %s", got)
	}
	for _, tc := range []struct{ expected, want time.Duration }{
		{0, time.Minute},                          // no estimate: the default
		{20 * time.Millisecond, time.Second},      // 8 × 20ms is under the minimum
		{500 * time.Millisecond, 4 * time.Second}, // 8 × the estimate
	} {
		if got := p.stepBound(tc.expected); got != tc.want {
			t.Errorf("bound for an estimate of %s: %s, want %s", tc.expected, got, tc.want)
		}
	}
	off := hangPolicy{heartbeat: -1, stepFactor: 8, stepMin: time.Second, stepDefault: time.Minute}
	if off.enabled() || off.beatInterval() != time.Second {
		t.Fatalf("disabled policy: enabled %v, interval %s", off.enabled(), off.beatInterval())
	}
	now := time.Unix(100, 0)
	if c, _ := off.verdict(beats{last: now.Add(-time.Hour), interval: time.Second}, now, 0); c != "" {
		t.Fatalf("disabled policy judged an engine %s", c)
	}
	// Fast timeouts: intervals and ticks keep a floor.
	fast := hangPolicy{heartbeat: 40 * time.Millisecond, stepFactor: 8, stepMin: 40 * time.Millisecond, stepDefault: time.Second}
	if fast.beatInterval() != 10*time.Millisecond || fast.tick() != 10*time.Millisecond {
		t.Fatalf("fast policy: interval %s tick %s", fast.beatInterval(), fast.tick())
	}
}

// Time spent waiting for a CPU is excused, up to the default step bound;
// nothing else is.
func TestVerdictExcusesCPUWait(t *testing.T) {
	p := hangPolicy{heartbeat: time.Second, stepFactor: 8, stepMin: time.Second, stepDefault: 10 * time.Second}
	now := time.Unix(1000, 0)
	silent := func(d time.Duration) beats { return beats{last: now.Add(-d), interval: 100 * time.Millisecond} }
	step := func(age time.Duration) beats {
		return beats{last: now, interval: 100 * time.Millisecond, stepAge: age, expected: 10 * time.Millisecond}
	}
	for _, tc := range []struct {
		name    string
		b       beats
		starved time.Duration
		want    string
	}{
		{"silent 1.6s, 1.2s of it starved", silent(1600 * time.Millisecond), 1200 * time.Millisecond, ""},
		{"silent 1.6s, 0.5s of it starved", silent(1600 * time.Millisecond), 500 * time.Millisecond, classStalled},
		{"silent 1.6s, not starved (stopped)", silent(1600 * time.Millisecond), 0, classStalled},
		{"silent 12s, all of it starved: past the cap", silent(12 * time.Second), 12 * time.Second, classStalled},
		{"step 1.35s, 1.2s of it waiting for a CPU", step(1350 * time.Millisecond), 1200 * time.Millisecond, ""},
		{"step 1.35s, 0.2s waiting", step(1350 * time.Millisecond), 200 * time.Millisecond, classHung},
		{"step 12s, all waiting: past the cap", step(12 * time.Second), 12 * time.Second, classHung},
	} {
		class, detail := p.verdict(tc.b, now, tc.starved)
		if class != tc.want {
			t.Errorf("%s: class %q (%s), want %q", tc.name, class, detail, tc.want)
		}
	}
	_, detail := p.verdict(step(1350*time.Millisecond), now, 200*time.Millisecond)
	if detail != "hung: step 1 running for 1.35s, 200ms of it waiting for a CPU, bound 1s (engine expected 10ms, 0 tokens)" {
		t.Errorf("detail %q", detail)
	}
	// Suspicion starts at half a threshold, and names its episode.
	if e := p.suspicion(silent(400*time.Millisecond), now); e != "" {
		t.Errorf("suspicion at 0.4s of silence: %q", e)
	}
	if e := p.suspicion(silent(600*time.Millisecond), now); e == "" || e == p.suspicion(silent(700*time.Millisecond), now) {
		t.Errorf("silences after different heartbeats: %q", e)
	}
	if e := p.suspicion(step(600*time.Millisecond), now); e != "step 1" {
		t.Errorf("suspicion of a step at 0.6s: %q", e)
	}
}

func TestCPUProbeWaitedSince(t *testing.T) {
	at := time.Unix(1000, 0)
	c := cpuProbe{episode: "x", at: at, waits: map[int]time.Duration{1: time.Second, 2: 5 * time.Second}}
	now := map[int]time.Duration{
		1: time.Second + 300*time.Millisecond, // waited 0.3s
		3: 200 * time.Millisecond,             // born since: counted whole
	} // 2 ended: not counted
	if got := c.waitedSince(now, at.Add(time.Second)); got != 500*time.Millisecond {
		t.Fatalf("waited %s, want 500ms", got)
	}
	if got := c.waitedSince(now, at.Add(400*time.Millisecond)); got != 400*time.Millisecond {
		t.Fatalf("waited %s, want at most the 400ms since the probe", got)
	}
}

// runWait on this process: busy threads pinned to one CPU wait for it, and
// that wait is what the supervisor reads.
func TestRunWaitReadsSchedstat(t *testing.T) {
	if _, err := os.Stat(fmt.Sprintf("/proc/self/task/%d/schedstat", os.Getpid())); err != nil {
		testenv.Missing(t, "this kernel keeps no /proc/<pid>/task/<tid>/schedstat (CONFIG_SCHED_INFO): hang detection reads it")
	}
	if _, ok := runWait(1 << 30); ok {
		t.Fatal("a process that does not exist read as ok")
	}
	before, ok := runWait(os.Getpid())
	if !ok || before[os.Getpid()] < 0 {
		t.Fatalf("runWait: %v %v", before, ok)
	}
	var cpus unix.CPUSet
	if err := unix.SchedGetaffinity(0, &cpus); err != nil {
		t.Fatal(err)
	}
	cpu := 0
	for !cpus.IsSet(cpu) {
		cpu++
	}
	const spinners, spin = 3, 600 * time.Millisecond
	// Every spinner needs a P of its own, or Go's scheduler, not the
	// kernel's run queue, makes them take turns.
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(spinners + 2))
	// The spinners' threads must still exist when the waits are read: a thread
	// that has exited takes its schedstat with it.
	var spun, ended sync.WaitGroup
	release := make(chan struct{})
	for range spinners {
		spun.Add(1)
		ended.Add(1)
		go func() {
			defer ended.Done()
			runtime.LockOSThread() // the thread ends with the goroutine: its pinning goes with it
			var one unix.CPUSet
			one.Set(cpu)
			if err := unix.SchedSetaffinity(0, &one); err != nil {
				t.Error(err)
				spun.Done()
				return
			}
			for t0 := time.Now(); time.Since(t0) < spin; {
			}
			spun.Done()
			<-release
		}()
	}
	spun.Wait()
	after, ok := runWait(os.Getpid())
	close(release)
	ended.Wait()
	if !ok {
		t.Fatal("runWait failed")
	}
	waited := cpuProbe{waits: before, at: time.Unix(0, 0)}.waitedSince(after, time.Unix(100, 0))
	// Three threads on one CPU for 0.6s: together they wait about 1.2s.
	if waited < spin/2 {
		t.Fatalf("run-queue wait grew by %s only", waited)
	}
}

// judge notes an engine's CPU waits once it is past half a threshold, and
// past the threshold excuses the wait added since; another engine is judged
// with a probe of its own.
func TestHangWatchProbesAtSuspicionAndExcusesTheWait(t *testing.T) {
	now := time.Unix(1000, 0)
	var wait time.Duration // the engine's run-queue wait so far
	reads := 0
	w := hangWatch{
		policy: hangPolicy{heartbeat: time.Second, stepFactor: 8, stepMin: time.Second, stepDefault: 10 * time.Second},
		runWait: func(int) (map[int]time.Duration, bool) {
			reads++
			return map[int]time.Duration{1: wait}, true
		},
	}
	last := now
	sl := &slot{proc: deadProcess{}}
	at := func(d time.Duration) (string, string) {
		sl.beats = beats{last: last, interval: 100 * time.Millisecond}
		return w.judge(sl, now.Add(d))
	}
	if c, _ := at(400 * time.Millisecond); c != "" || reads != 0 {
		t.Fatalf("0.4s of silence: class %q, %d CPU-wait reads; want neither", c, reads)
	}
	if c, _ := at(600 * time.Millisecond); c != "" || reads != 1 {
		t.Fatalf("0.6s of silence: class %q, %d CPU-wait reads; want the probe taken once", c, reads)
	}
	wait = 800 * time.Millisecond // starved for most of what follows
	if c, d := at(1600 * time.Millisecond); c != "" {
		t.Fatalf("1.6s silent, 0.8s of it waiting for a CPU: judged %s (%s)", c, d)
	}
	if reads != 2 {
		t.Fatalf("%d CPU-wait reads, want 2 (the probe, then one past the threshold)", reads)
	}
	if c, d := at(2500 * time.Millisecond); c != classStalled || !strings.Contains(d, "800ms of it waiting for a CPU") {
		t.Fatalf("2.5s silent, 0.8s of it starved: %q (%s), want stalled with the wait noted", c, d)
	}

	// A new engine: its probe is its own.
	sl = &slot{proc: deadProcess{}}
	reads = 0
	if c, _ := at(1600 * time.Millisecond); c != classStalled || reads != 2 {
		t.Fatalf("a new engine 1.6s silent with no probe of its own: %q after %d reads, want stalled (its wait not excused)", c, reads)
	}

	// Without CPU waits nothing is excused.
	w.runWait = nil
	sl = &slot{proc: deadProcess{}}
	wait = time.Hour
	if c, _ := at(1600 * time.Millisecond); c != classStalled {
		t.Fatalf("without CPU waits, 1.6s of silence: %q, want stalled", c)
	}
}

// A connected but wedged active is fenced and failed over from; a busy or
// idle engine, a long step within its bound and slow heartbeats that the
// engine announced are left alone. Heartbeats go every 100ms (interval_ms
// set) except in the cases of an engine without hang reporting (every
// second, no interval), judged by the coarse rule at StepTimeoutDefault.
func TestHangDetection(t *testing.T) {
	beat := func(step uint64, age, expected time.Duration) *frmpsv1.Heartbeat {
		return &frmpsv1.Heartbeat{Step: step, Running: 2, IntervalMs: 100, StepAgeNs: uint64(age), StepExpectedNs: uint64(expected), StepTokens: 8}
	}
	for _, tc := range []struct {
		name      string
		every     time.Duration // 0: 100ms
		beat      func(n int) *frmpsv1.Heartbeat
		wantClass string // "" = no failover
		wantCause string
		// detectBy, detectAfter: the failover's detection at most / more than
		// this long after the engine's last regular heartbeat (0: not checked).
		detectBy, detectAfter time.Duration
		// starved: one of the engine's threads waited for a CPU all along
		// (RunWait grows with the clock).
		starved bool
	}{
		{name: "silent", beat: func(n int) *frmpsv1.Heartbeat {
			if n > 3 {
				return nil
			}
			return beat(uint64(n), 0, 0)
		}, wantClass: "stalled", wantCause: "stalled: no heartbeat", detectBy: time.Second + 100*time.Millisecond},
		{name: "silent while waiting for a CPU: excused up to the default bound", starved: true, beat: func(n int) *frmpsv1.Heartbeat {
			if n > 3 {
				return nil
			}
			return beat(uint64(n), 0, 0)
		}, wantClass: "stalled", wantCause: "of it waiting for a CPU", detectAfter: 11 * time.Second, detectBy: 11*time.Second + 100*time.Millisecond},
		{name: "step past its bound while waiting for a CPU: excused up to the default bound", starved: true, beat: func(n int) *frmpsv1.Heartbeat {
			return beat(3, time.Duration(n+1)*100*time.Millisecond, 20*time.Millisecond)
		}, wantClass: "hung", wantCause: "hung: step 4 running for 11.1s, 10s of it waiting for a CPU, bound 1s"},
		{name: "step overruns its bound", beat: func(n int) *frmpsv1.Heartbeat {
			if n < 5 {
				return beat(uint64(n), 0, 0)
			}
			return beat(5, time.Duration(n-4)*100*time.Millisecond, 20*time.Millisecond) // bound max(1s, 8×20ms)
		}, wantClass: "hung", wantCause: "hung: step 6 running for 1.1s, bound 1s (engine expected 20ms, 8 tokens)"},
		{name: "unestimated step overruns the default", beat: func(n int) *frmpsv1.Heartbeat {
			return beat(1, time.Duration(n+1)*100*time.Millisecond, 0)
		}, wantClass: "hung", wantCause: "bound 10s (no estimate"},
		{name: "long step within the engine's estimate", beat: func(n int) *frmpsv1.Heartbeat {
			if n%150 >= 120 { // 12s steps; 8 × 2s allowed
				return beat(uint64(n/150+1), 0, 0)
			}
			return beat(uint64(n/150), time.Duration(n%150)*100*time.Millisecond, 2*time.Second)
		}},
		{name: "unestimated step within the default", beat: func(n int) *frmpsv1.Heartbeat {
			return beat(uint64(n/95), time.Duration(n%95)*100*time.Millisecond, 0) // 9.5s steps
		}},
		{name: "slow heartbeats the engine announced", every: 2 * time.Second, beat: func(n int) *frmpsv1.Heartbeat {
			return &frmpsv1.Heartbeat{Step: uint64(n), Running: 1, IntervalMs: 1000}
		}},
		{name: "progressing", beat: func(n int) *frmpsv1.Heartbeat {
			return beat(uint64(n), time.Duration(n%3)*time.Millisecond, 5*time.Millisecond)
		}},
		{name: "idle", beat: func(n int) *frmpsv1.Heartbeat { return &frmpsv1.Heartbeat{Step: 7, IntervalMs: 100} }},
		// Engines without hang reporting.
		{name: "coarse stuck step", every: time.Second, beat: func(n int) *frmpsv1.Heartbeat { return &frmpsv1.Heartbeat{Step: 5, Running: 2} },
			wantClass: "stalled", wantCause: "stalled: step 5 unchanged"},
		{name: "coarse silent", every: time.Second, beat: func(n int) *frmpsv1.Heartbeat {
			if n > 3 {
				return nil
			}
			return &frmpsv1.Heartbeat{Step: uint64(n)}
		}, wantClass: "stalled", wantCause: "stalled: no heartbeat"},
		{name: "coarse progressing", every: time.Second, beat: func(n int) *frmpsv1.Heartbeat { return &frmpsv1.Heartbeat{Step: uint64(n), Running: 3} }},
		{name: "coarse idle", every: time.Second, beat: func(n int) *frmpsv1.Heartbeat { return &frmpsv1.Heartbeat{Step: 7} }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				w := newWorld()
				var mu sync.Mutex
				var lastBeat time.Time
				t0 := time.Now()
				if tc.starved {
					w.runWait = func(pid int) map[int]time.Duration {
						if pid != w.procs[0].pid {
							t.Errorf("RunWait(%d): not the active's pid %d", pid, w.procs[0].pid)
						}
						return map[int]time.Duration{pid: 0, pid + 1: time.Since(t0)}
					}
				}
				w.behave = func(r failover.Role, n int) behavior {
					if r == failover.Active && n == 0 {
						return behavior{beatEvery: cmp.Or(tc.every, 100*time.Millisecond), heartbeat: func(n int) *frmpsv1.Heartbeat {
							hb := tc.beat(n)
							if hb != nil {
								mu.Lock()
								lastBeat = time.Now()
								mu.Unlock()
							}
							return hb
						}}
					}
					return behavior{}
				}
				h := start(t, w, func(c *Config) { c.StepTimeoutDefault = 10 * time.Second })
				time.Sleep(time.Minute)
				synctest.Wait()
				w.procs[0].mu.Lock()
				interval := w.procs[0].welcome.GetHeartbeatIntervalMs()
				w.procs[0].mu.Unlock()
				if interval != 125 {
					t.Fatalf("welcome asks for a heartbeat every %dms, want 125 (1s timeout / 8)", interval)
				}
				h.wantState(failover.ServingReady)
				recs := h.s.Status().GetFailovers()
				if tc.wantClass == "" {
					if len(recs) != 0 {
						t.Fatalf("failed over from a healthy engine: %v", recs)
					}
					h.stop()
					return
				}
				if len(recs) != 1 || recs[0].GetCause() != tc.wantClass || !strings.Contains(recs[0].GetDetail(), tc.wantCause) || !recs[0].GetOk() {
					t.Fatalf("records %v; want one of class %s caused by %q", recs, tc.wantClass, tc.wantCause)
				}
				if w.procs[0].alive() {
					t.Fatal("the wedged active was not fenced")
				}
				if v := testutil.ToFloat64(h.s.metrics.failovers.WithLabelValues(tc.wantClass)); v != 1 {
					t.Fatalf("failovers{%s} %v", tc.wantClass, v)
				}
				if tc.detectBy > 0 {
					mu.Lock()
					took := time.Unix(0, recs[0].GetUnixNanos()).Sub(lastBeat)
					mu.Unlock()
					if took <= max(time.Second, tc.detectAfter) || took > tc.detectBy {
						t.Fatalf("detected %s after the last heartbeat, want within (%s, %s]", took, max(time.Second, tc.detectAfter), tc.detectBy)
					}
				}
				h.stop()
			})
		})
	}
}
