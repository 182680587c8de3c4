package ringbuf

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/frmps/frmps/internal/testenv"
)

const fillByte = 0xEE

// crashStats counts what the kills hit.
type crashStats struct {
	iterations, verified, stale, torn, overruns int
}

// crashRig owns the reader side of a crash test: one ring, one reader and
// snapshot that live across all the writer processes.
type crashRig struct {
	t    *testing.T
	w    *region // the reader's mapping, used to fill and inspect the data region
	r    *Reader
	s    *Snapshot
	st   crashStats
	rnd  *rand.Rand
	fill []byte
}

func newCrashRig(t *testing.T, capacity uint64) (*crashRig, string) {
	p := newRing(t, capacity)
	r := openReader(t, p)
	return &crashRig{t: t, w: r.r, r: r, s: NewSnapshot(), rnd: rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 1)),
		fill: bytes.Repeat([]byte{fillByte}, int(capacity))}, p
}

// poll consumes what is committed; only overruns are acceptable errors.
func (c *crashRig) poll() {
	c.t.Helper()
	for {
		_, err := c.r.Poll(c.s)
		if err == nil {
			return
		}
		if !errors.Is(err, ErrOverrun) {
			c.t.Fatalf("iteration %d: %v", c.st.iterations, err)
		}
		c.st.overruns++
	}
}

// beforeWriter fills the data region so that bytes a killed writer left past
// its last commit can be recognised. It returns the write cursor and the epoch
// the next writer will stamp on its records.
func (c *crashRig) beforeWriter() (cursor, epoch uint64) {
	c.poll()
	copy(c.w.data, c.fill)
	return c.w.load(offWriteCursor), c.w.load(offEpoch) + 1
}

// runUntilKilled waits until the reader has applied a record of the writer's
// epoch, polls while it runs for a random time, then SIGKILLs it. An aimed
// kill fires as soon as the writer is seen writing the payload of a record it
// has not committed yet (the writer may still commit it before the signal
// lands; that is fine).
//
// A change of write_seq is not a sign that the writer committed: write_seq is
// stored just before write_cursor, and a writer's first commit may be a PAD
// (TestWriterKilledBeforeFirstRecord). Killed there, the writer leaves
// nothing of its epoch, and the reader rightly keeps the previous writer's
// snapshot.
func (c *crashRig) runUntilKilled(epoch uint64, aim bool, kill func() error) {
	c.t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for c.s.Epoch() != epoch {
		if time.Now().After(deadline) {
			c.t.Fatalf("iteration %d: the writer never committed a record of epoch %d", c.st.iterations, epoch)
		}
		time.Sleep(20 * time.Microsecond)
		c.poll()
	}
	until := time.Now().Add(time.Duration(c.rnd.IntN(1500)) * time.Microsecond)
	for time.Now().Before(until) {
		c.poll()
	}
	for aim && time.Now().Before(deadline) {
		off := c.w.load(offWriteCursor) % c.w.capacity
		if off+RecordHeaderSize < c.w.capacity && c.w.data[off+RecordHeaderSize] != fillByte {
			break
		}
	}
	if err := kill(); err != nil {
		c.t.Fatal(err)
	}
}

// afterWriter consumes what the dead writer committed and reports whether the
// snapshot is fresh. It also counts kills that left a partly written record.
func (c *crashRig) afterWriter(cursorBefore, epoch uint64) bool {
	c.t.Helper()
	c.st.iterations++
	end := c.w.load(offWriteCursor)
	capacity := c.w.capacity
	if end-cursorBefore < capacity/2 {
		// The area after the cursor was filled and not lapped: any byte that
		// is not the fill byte belongs to a record the writer did not commit.
		off := end % capacity
		area := c.w.data[off:min(capacity, off+capacity/4)]
		if !bytes.Equal(area, c.fill[:len(area)]) {
			c.st.torn++
		}
	}
	c.poll()
	if c.r.Lag() != 0 {
		c.t.Fatalf("iteration %d: lag %d after catching up", c.st.iterations, c.r.Lag())
	}
	if c.s.Stale() {
		c.st.stale++ // the writer died before it answered a resync
		return false
	}
	if c.s.Epoch() != epoch {
		c.t.Fatalf("iteration %d: snapshot from epoch %d, writer epoch %d", c.st.iterations, c.s.Epoch(), epoch)
	}
	c.st.verified++
	return true
}

func crashIterations(t *testing.T, normal, short int) int {
	if v := os.Getenv("FRMPS_CRASH_ITERATIONS"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	if testing.Short() {
		return short
	}
	return normal
}

// TestCrashGoWriter SIGKILLs a Go writer process mid-write thousands of
// times. After each kill the reader must have applied exactly the records the
// writer committed: its snapshot equals the workload model replayed to the
// step of the last applied record, and it never reports a corrupt record.
func TestCrashGoWriter(t *testing.T) {
	// A race-instrumented test binary takes ~60 ms to start; the plain build
	// runs the full count in about half a minute.
	n := crashIterations(t, raceScaled(2000, 400), 200)
	c, path := newCrashRig(t, 1<<20)
	var running *exec.Cmd
	defer func() { // a failed iteration must not leave its writer running
		if running != nil {
			_ = running.Process.Kill()
			_ = running.Wait()
		}
	}()
	start := time.Now()
	for i := range n {
		seed := uint64(i + 1)
		cursor, epoch := c.beforeWriter()
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), "FRMPS_RING_HELPER=writer", "FRMPS_RING_PATH="+path, "FRMPS_RING_SEED="+strconv.FormatUint(seed, 10))
		var stderr strings.Builder
		cmd.Stderr = &stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		running = cmd
		c.runUntilKilled(epoch, i%2 == 1, cmd.Process.Kill)
		err := cmd.Wait()
		running = nil
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
			t.Fatalf("iteration %d: writer ended with %v: %s", i, err, stderr.String())
		}
		if !c.afterWriter(cursor, epoch) {
			continue
		}
		wl := newWorkload(seed)
		for range c.s.Step() {
			wl.step()
		}
		checkSnapshot(t, c.s, wl)
	}
	t.Logf("%d kills in %v: %d verified, %d left a partly written record, %d stale (resync unanswered), %d overruns",
		c.st.iterations, time.Since(start).Round(time.Millisecond), c.st.verified, c.st.torn, c.st.stale, c.st.overruns)
	if c.st.verified < n/3 || (n >= 100 && c.st.torn == 0) {
		t.Fatalf("the kills did not exercise enough: %+v", c.st)
	}
}

// pythonWriter returns the interpreter for the cross-language tests. When it
// cannot import the writer the test is skipped, or fails in CI.
func pythonWriter(t *testing.T) (python string, env []string) {
	t.Helper()
	python = os.Getenv("FRMPS_PYTHON")
	if python == "" {
		python = "python3"
	}
	src, err := filepath.Abs("../vllmpatch/src")
	if err != nil {
		t.Fatal(err)
	}
	env = append(os.Environ(), "PYTHONPATH="+src+string(os.PathListSeparator)+os.Getenv("PYTHONPATH"))
	cmd := exec.Command(python, "-c", "import numpy, frmps_engine.ring._testwriter")
	cmd.Env = env
	if out, err := cmd.CombinedOutput(); err != nil {
		testenv.Missing(t, "no Python writer: %s cannot import numpy and frmps_engine.ring (%v: %s); set FRMPS_PYTHON to an interpreter with numpy", python, err, strings.TrimSpace(string(out)))
	}
	return python, env
}

// readDigests parses a writer's "step digest" log.
func readDigests(t *testing.T, path string) map[uint64]string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	m := map[uint64]string{}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) != 2 {
			continue // the last line may be cut by the kill
		}
		s, err := strconv.ParseUint(f[0], 10, 64)
		if err != nil {
			t.Fatalf("log %s: %q", path, line)
		}
		m[s] = f[1]
	}
	return m
}

// TestCrashPythonWriter SIGKILLs real Python writer processes (forked from
// one Python process, so each costs no interpreter start-up) and checks the
// Go reader's snapshot against the digest the writer logged before each step.
func TestCrashPythonWriter(t *testing.T) {
	python, env := pythonWriter(t)
	n := crashIterations(t, 100, 30)
	c, path := newCrashRig(t, 1<<20)
	logdir := t.TempDir()
	cmd := exec.Command(python, "-m", "frmps_engine.ring._testwriter", "forkserver", path, logdir)
	cmd.Env = env
	var stderr strings.Builder
	cmd.Stderr = &stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	livePID := 0
	defer func() {
		if livePID != 0 { // a failed iteration: the forkserver waits for this child
			_ = syscall.Kill(livePID, syscall.SIGKILL)
		}
		_ = stdin.Close()
		if err := cmd.Wait(); err != nil {
			t.Errorf("forkserver: %v: %s", err, stderr.String())
		}
	}()
	lines := bufio.NewScanner(stdout)
	expect := func(prefix string) int {
		if !lines.Scan() {
			t.Fatalf("forkserver ended: %v: %s", lines.Err(), stderr.String())
		}
		f := strings.Fields(lines.Text())
		if len(f) != 2 || f[0] != prefix {
			t.Fatalf("forkserver said %q, want %s", lines.Text(), prefix)
		}
		pid, err := strconv.Atoi(f[1])
		if err != nil {
			t.Fatal(err)
		}
		return pid
	}
	start := time.Now()
	for i := range n {
		cursor, epoch := c.beforeWriter()
		if _, err := fmt.Fprintf(stdin, "run %d %d\n", i, i+1); err != nil {
			t.Fatal(err)
		}
		pid := expect("pid")
		livePID = pid
		// The child is not reaped before the forkserver reports it dead, so
		// its pid cannot be reused while we may still signal it.
		c.runUntilKilled(epoch, i%2 == 1, func() error { return syscall.Kill(pid, syscall.SIGKILL) })
		if dead := expect("dead"); dead != pid {
			t.Fatalf("forkserver reaped %d, want %d", dead, pid)
		}
		livePID = 0
		if !c.afterWriter(cursor, epoch) {
			continue
		}
		digests := readDigests(t, filepath.Join(logdir, fmt.Sprintf("%d.log", i)))
		want, ok := digests[c.s.Step()]
		if !ok {
			t.Fatalf("iteration %d: snapshot at step %d, which the writer never logged", i, c.s.Step())
		}
		if got := snapshotDigest(c.s); got != want {
			t.Fatalf("iteration %d: snapshot at step %d differs from the writer's state", i, c.s.Step())
		}
	}
	if _, err := io.WriteString(stdin, "quit\n"); err != nil {
		t.Fatal(err)
	}
	t.Logf("%d kills in %v: %d verified, %d left a partly written record, %d stale (resync unanswered), %d overruns",
		c.st.iterations, time.Since(start).Round(time.Millisecond), c.st.verified, c.st.torn, c.st.stale, c.st.overruns)
	if c.st.verified < n/3 {
		t.Fatalf("too few iterations verified: %+v", c.st)
	}
}
