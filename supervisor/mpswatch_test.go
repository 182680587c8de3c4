package supervisor

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/frmps/frmps/supervisor/failover"
)

func appendServerLog(t *testing.T, dir, line string) {
	t.Helper()
	f, err := os.OpenFile(filepath.Join(dir, "server.log"), os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteString(line + "\n"); err != nil {
		t.Fatal(err)
	}
}

// The MPS server's log says it tears the active's context down: the
// supervisor fails over at once, before the active dies of the fault, and
// ignores what it says about other clients and what it said before.
func TestMPSServerTeardownFailsOverAtOnce(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		w := newWorld()
		w.mps.logDir = t.TempDir()
		h := start(t, w, nil)
		act, sb := h.roles()
		appendServerLog(t, w.mps.logDir, fmt.Sprintf("[2026-11-23 22:19:03.147 Server  1623] Client {PID: %d, Context ID: 1} on device 0 to be torn down", sb.pid))
		appendServerLog(t, w.mps.logDir, "[2026-11-23 22:19:03.147 Server  1623] Client {PID: 999999, Context ID: 1} on device 0 to be torn down")
		time.Sleep(50 * time.Millisecond)
		synctest.Wait()
		if n := len(h.s.Status().Failovers); n != 0 {
			t.Fatalf("%d failovers for teardowns of other clients", n)
		}
		appendServerLog(t, w.mps.logDir, fmt.Sprintf("[2026-11-23 22:19:03.147 Server  1623] Client {PID: %d, Context: 1} encountered a fatal GPU error.", act.pid))
		time.Sleep(10 * time.Millisecond)
		synctest.Wait()
		recs := h.s.Status().Failovers
		if len(recs) != 1 || recs[0].GetCause() != "mps_fault" || !recs[0].GetOk() {
			t.Fatalf("records %v", recs)
		}
		if len(sb.resumes) != 1 {
			t.Fatalf("standby got %d resumes", len(sb.resumes))
		}
		if v := testutil.ToFloat64(h.s.metrics.failovers.WithLabelValues("mps_fault")); v != 1 {
			t.Fatalf("failovers{mps_fault} %v", v)
		}
		// frmps's own daemon is restarted before an engine is launched into it again.
		if restarts := w.mps.recovers(); restarts != 1 {
			t.Fatalf("MPS restarted %d times after the fatal error, want 1", restarts)
		}
		// The same line again (the server repeats the pid in several lines): one failover.
		appendServerLog(t, w.mps.logDir, fmt.Sprintf("[2026-11-23 22:19:03.147 Server  1623] Client {PID: %d, Context ID: 1} on device 0 to be torn down", act.pid))
		time.Sleep(30 * time.Second)
		synctest.Wait()
		if n := len(h.s.Status().Failovers); n != 1 {
			t.Fatalf("%d failovers, want 1", n)
		}
		h.wantState(failover.ServingReady)
		h.stop()
	})
}

// The operator's daemon is never restarted after a fatal error.
func TestMPSFaultLeavesTheOperatorsDaemon(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		w := newWorld()
		w.mps.logDir, w.mps.shared = t.TempDir(), true
		h := start(t, w, nil)
		act, _ := h.roles()
		appendServerLog(t, w.mps.logDir, fmt.Sprintf("[2026-11-23 22:19:03.147 Server  1623] Client {PID: %d, Context ID: 1} on device 0 to be torn down", act.pid))
		time.Sleep(30 * time.Second)
		synctest.Wait()
		if recs := h.s.Status().Failovers; len(recs) != 1 || recs[0].GetCause() != "mps_fault" {
			t.Fatalf("records %v", recs)
		}
		if restarts := w.mps.recovers(); restarts != 0 {
			t.Fatalf("the operator's daemon was restarted %d times", restarts)
		}
		h.stop()
	})
}

// With the watch turned off, the same line changes nothing.
func TestMPSFaultWatchOff(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		w := newWorld()
		w.mps.logDir = t.TempDir()
		h := start(t, w, func(c *Config) { c.NoMPSFaultWatch = true })
		act, _ := h.roles()
		appendServerLog(t, w.mps.logDir, fmt.Sprintf("[2026-11-23 22:19:03.147 Server  1623] Client {PID: %d, Context ID: 1} on device 0 to be torn down", act.pid))
		time.Sleep(time.Second)
		synctest.Wait()
		if n := len(h.s.Status().Failovers); n != 0 {
			t.Fatalf("%d failovers with the watch off", n)
		}
		h.stop()
	})
}
