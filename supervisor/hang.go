package supervisor

import (
	"fmt"
	"time"
)

// Hang detection judges a serving active by its Heartbeats, in two ways:
//
//   - liveness: the heartbeats come from an engine thread that never waits on
//     the device or the engine loop, so they stop only when the whole process
//     is stopped or wedged. None for hangPolicy.heartbeat → class "stalled".
//   - progress: each heartbeat carries the age of the step in progress and the
//     engine's own estimate of it (measured step times scaled to the step's
//     tokens). A step older than max(stepMin, stepFactor × estimate), or than
//     stepDefault when the engine has no estimate → class "hung".
//
// Time the engine spent waiting for a CPU is not held against it (up to
// stepDefault): on an overloaded machine a starved engine is slow, not hung,
// and a stopped or wedged one waits for no CPU. When either rule is past half
// its threshold, the supervisor notes the run-queue wait (time runnable but
// not running) of every thread of the engine, from
// /proc/<pid>/task/<tid>/schedstat; once the rule is past its threshold, the
// wait added since then is subtracted. Every thread counts: the one starved
// may be another holding Python's GIL that the heartbeat thread waits for.
//
// An engine whose heartbeats carry no interval does no hang reporting; it is
// judged by the coarse rule: no heartbeat, or a step count standing still
// with requests running, for stepDefault → "stalled".

// Death classes the supervisor gives itself, where no exit is classified
// (failover records, metrics): a fenced wedged active, a drill, a fault of
// the MPS server.
const (
	classStalled  = "stalled"
	classHung     = "hung"
	classDrill    = "drill"
	classMPSFault = "mps_fault"
)

// hangPolicy holds the thresholds (Config's, defaults applied).
type hangPolicy struct {
	heartbeat   time.Duration
	stepFactor  float64
	stepMin     time.Duration
	stepDefault time.Duration
}

func (c Config) hangPolicy() hangPolicy {
	return hangPolicy{heartbeat: c.HeartbeatTimeout, stepFactor: c.StepTimeoutFactor, stepMin: c.StepTimeoutMin, stepDefault: c.StepTimeoutDefault}
}

// enabled: a negative HeartbeatTimeout turns hang detection off.
func (p hangPolicy) enabled() bool { return p.heartbeat > 0 }

// beatInterval is the heartbeat period asked of engines (in Welcome): several
// beats fit in the timeout, so one late beat is not a death.
func (p hangPolicy) beatInterval() time.Duration {
	if !p.enabled() {
		return time.Second
	}
	return min(max(p.heartbeat/8, 10*time.Millisecond), time.Second)
}

// tick is the watchdog period: a small fraction of the shortest bound.
func (p hangPolicy) tick() time.Duration {
	return min(max(min(p.heartbeat, p.stepMin)/20, 10*time.Millisecond), 250*time.Millisecond)
}

// stepBound is how long a step with the engine's estimate may run (0: none).
func (p hangPolicy) stepBound(expected time.Duration) time.Duration {
	if expected <= 0 {
		return p.stepDefault
	}
	return max(p.stepMin, time.Duration(p.stepFactor*float64(expected)))
}

// beats is what an engine's heartbeats said, as its slot keeps it.
type beats struct {
	last      time.Time     // arrival of the latest; zero until the first
	interval  time.Duration // the engine's period; 0 = no hang reporting
	step      uint64
	stepSince time.Time // when step last changed (or requests began to run)
	running   uint32
	stepAge   time.Duration // of the step in progress at the latest heartbeat; 0 between steps
	expected  time.Duration // the engine's estimate of that step; 0 = none
	tokens    uint32
}

// silenceLimit is how long b's engine may stay silent (0: not judged).
func (p hangPolicy) silenceLimit(b beats) time.Duration {
	if !p.enabled() || b.last.IsZero() {
		return 0
	}
	if b.interval == 0 {
		return p.stepDefault
	}
	// An engine that beats slower than asked is given three of its periods.
	return max(p.heartbeat, 3*b.interval)
}

// excused is the part of d spent waiting for a CPU, at most d and stepDefault.
func (p hangPolicy) excused(d, wait time.Duration) time.Duration {
	return max(0, min(wait, d, p.stepDefault))
}

// suspicion names the episode in which an engine is past half a threshold:
// its silence since the latest heartbeat, or its step in progress; "" when
// neither. The supervisor starts measuring CPU waits there.
func (p hangPolicy) suspicion(b beats, now time.Time) string {
	if lim := p.silenceLimit(b); lim > 0 && now.Sub(b.last) > lim/2 {
		return "silence after " + b.last.Format(time.RFC3339Nano)
	}
	if p.enabled() && b.interval > 0 && b.stepAge > p.stepBound(b.expected)/2 {
		return fmt.Sprintf("step %d", b.step+1)
	}
	return ""
}

// verdict says whether an engine is wedged at now: its death class and a
// detail, or "" when it is fine. starved is how long its threads waited for a
// CPU during the current suspicion (0 if unknown). Engines that never sent a
// heartbeat are not judged (socket EOF and process exit still are).
func (p hangPolicy) verdict(b beats, now time.Time, starved time.Duration) (class, detail string) {
	if !p.enabled() || b.last.IsZero() {
		return "", ""
	}
	silent := now.Sub(b.last)
	if b.interval == 0 {
		switch {
		case silent > p.stepDefault:
			return classStalled, fmt.Sprintf("stalled: no heartbeat for %s", silent.Round(time.Millisecond))
		case b.running > 0 && now.Sub(b.stepSince) > p.stepDefault:
			return classStalled, fmt.Sprintf("stalled: step %d unchanged for %s with %d running requests",
				b.step, now.Sub(b.stepSince).Round(time.Millisecond), b.running)
		}
		return "", ""
	}
	if limit := p.silenceLimit(b); silent-p.excused(silent, starved) > limit {
		return classStalled, fmt.Sprintf("stalled: no heartbeat for %s%s limit %s (one every %s expected)",
			silent.Round(time.Millisecond), waitedNote(p.excused(silent, starved)), limit, b.interval)
	}
	if b.stepAge > 0 {
		waited := p.excused(b.stepAge, starved)
		if bound := p.stepBound(b.expected); b.stepAge-waited > bound {
			est := "no estimate"
			if b.expected > 0 {
				est = "engine expected " + b.expected.Round(time.Microsecond).String()
			}
			return classHung, fmt.Sprintf("hung: step %d running for %s%s bound %s (%s, %d tokens)",
				b.step+1, b.stepAge.Round(time.Millisecond), waitedNote(waited), bound.Round(time.Millisecond), est, b.tokens)
		}
	}
	return "", ""
}

func waitedNote(waited time.Duration) string {
	if waited < time.Millisecond {
		return ","
	}
	return fmt.Sprintf(", %s of it waiting for a CPU,", waited.Round(time.Millisecond))
}

// cpuProbe holds the run-queue wait of an engine's threads at the start of a
// suspicion (loop-owned).
type cpuProbe struct {
	episode string // hangPolicy.suspicion's name; "" = none
	at      time.Time
	waits   map[int]time.Duration // by thread id
}

// waitedSince is the run-queue wait added to now since the probe: by thread,
// a thread born since counted whole, one gone not at all; at most the wall
// time since the probe (several threads may wait at once).
func (c cpuProbe) waitedSince(now map[int]time.Duration, at time.Time) time.Duration {
	var sum time.Duration
	for tid, w := range now {
		sum += max(0, w-c.waits[tid])
	}
	return min(sum, max(0, at.Sub(c.at)))
}

// hangWatch judges the serving active at each watchdog tick (loop-owned). It
// keeps the CPU-wait probe of the engine it judges; a new engine is judged
// afresh.
type hangWatch struct {
	policy hangPolicy
	// runWait reads an engine's run-queue wait by thread (Deps.RunWait);
	// nil: CPU waits are not known and nothing is excused.
	runWait func(pid int) (map[int]time.Duration, bool)
	judged  *slot    // the engine probe belongs to
	probe   cpuProbe // its CPU waits during a hang suspicion
}

// judge says whether sl, serving, is wedged at now: its death class and a
// detail, or "" when it is fine. Past half a threshold it notes the engine's
// CPU waits, and past the threshold it excuses the wait added since.
func (w *hangWatch) judge(sl *slot, now time.Time) (class, detail string) {
	sl.mu.Lock()
	b := sl.beats
	sl.mu.Unlock()
	if sl != w.judged {
		w.judged, w.probe = sl, cpuProbe{}
	}
	p := w.policy
	episode := p.suspicion(b, now)
	if episode != w.probe.episode {
		w.probe = cpuProbe{episode: episode}
		if episode != "" && w.runWait != nil {
			if waits, ok := w.runWait(sl.proc.PID()); ok {
				w.probe.at, w.probe.waits = now, waits
			}
		}
	}
	class, detail = p.verdict(b, now, 0)
	if class != "" && w.probe.waits != nil {
		// Past the threshold: how much of it did the engine spend waiting for a CPU?
		if waits, ok := w.runWait(sl.proc.PID()); ok {
			class, detail = p.verdict(b, now, w.probe.waitedSince(waits, now))
		}
	}
	return class, detail
}
