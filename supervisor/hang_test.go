package supervisor

import (
	"fmt"
	"os"
	"runtime"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
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
		t.Skip("this kernel keeps no schedstat")
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
