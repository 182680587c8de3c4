package ringbuf

import (
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestPythonWriterConcurrent runs a real Python writer process (DeltaTracker
// over RingWriter, driven by a fake engine) while the Go reader polls. Every
// snapshot the reader holds between polls must equal the writer's state at
// that step (the writer logs a digest before each record), and at the end
// every request must match the writer's final state field by field.
func TestPythonWriterConcurrent(t *testing.T) {
	python, env := pythonWriter(t)
	for _, tc := range []struct {
		name      string
		capacity  uint64
		syncEvery int
	}{
		{"every step", 1 << 20, 1},
		{"every 4 steps, small ring", 1 << 16, 4},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			path := newRing(t, tc.capacity)
			r := openReader(t, path)
			s := NewSnapshot()
			logPath, finalPath := filepath.Join(dir, "log"), filepath.Join(dir, "final.json")
			cmd := exec.Command(python, "-m", "frmps_engine.ring._testwriter", "run", path, logPath,
				"--seed", "11", "--steps", "1500", "--sync-every", strconv.Itoa(tc.syncEvery), "--final", finalPath,
				// Paced as an engine is (a step takes milliseconds), so that a reader
				// starved by a loaded machine still sees enough snapshots to check.
				"--linger", "1.5", "--sync-delay", "0.001")
			cmd.Env = env
			var out strings.Builder
			cmd.Stdout, cmd.Stderr = &out, &out
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			done := make(chan error, 1)
			go func() { done <- cmd.Wait() }()
			seen := map[uint64]string{} // step -> digest of our snapshot at that step
			overruns := 0
			poll := func() {
				if _, err := r.Poll(s); err != nil {
					if !errors.Is(err, ErrOverrun) {
						t.Errorf("poll: %v", err)
					}
					overruns++
				}
				if !s.Stale() && s.Len() > 0 {
					seen[s.Step()] = snapshotDigest(s)
				}
			}
			var werr error
			deadline := time.After(3 * time.Minute)
		loop:
			for {
				select {
				case werr = <-done:
					break loop
				case <-deadline:
					_ = cmd.Process.Kill()
					t.Fatalf("python writer still running after 3 minutes: %v\n%s", <-done, out.String())
				default:
					poll()
					time.Sleep(200 * time.Microsecond)
				}
			}
			if werr != nil {
				t.Fatalf("python writer: %v\n%s", werr, out.String())
			}
			poll()
			if t.Failed() {
				return
			}
			logged := readDigests(t, logPath)
			for step, d := range seen {
				if logged[step] != d {
					t.Fatalf("snapshot at step %d differs from the writer's state", step)
				}
			}
			var final struct {
				Step     uint64 `json:"step"`
				Requests []struct {
					Key         uint64   `json:"key"`
					Seed        uint64   `json:"seed"`
					NumPrompt   uint32   `json:"num_prompt"`
					NumComputed uint32   `json:"num_computed"`
					Blocks      []uint32 `json:"blocks"`
					Tokens      []uint32 `json:"tokens"`
				} `json:"requests"`
			}
			b, err := os.ReadFile(finalPath)
			if err != nil {
				t.Fatal(err)
			}
			if err := json.Unmarshal(b, &final); err != nil {
				t.Fatal(err)
			}
			if s.Stale() || s.Step() != final.Step || s.Len() != len(final.Requests) {
				t.Fatalf("final: stale %v step %d len %d, want step %d len %d", s.Stale(), s.Step(), s.Len(), final.Step, len(final.Requests))
			}
			for _, f := range final.Requests {
				g, ok := s.Get(f.Key)
				if !ok || g.Seed != f.Seed || g.NumPrompt != f.NumPrompt || g.NumComputed != f.NumComputed ||
					!slices.Equal(g.BlockIDs, f.Blocks) || !slices.Equal(g.TokenIDs, f.Tokens) {
					t.Fatalf("request %d: got %+v (present %v), want %+v", f.Key, g, ok, f)
				}
			}
			t.Logf("%d distinct snapshots checked against the writer, %d overruns, %d resyncs", len(seen), overruns, r.Resyncs())
			if len(seen) < 20 {
				t.Fatalf("only %d snapshots observed while the writer ran", len(seen))
			}
		})
	}
}
