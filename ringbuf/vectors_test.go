package ringbuf

import (
	"bytes"
	"encoding/json"
	"flag"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"testing"
	"unsafe"
)

var update = flag.Bool("update", false, "rewrite testdata/go_writer.ring from testdata/scenario.json")

// scenario is testdata/scenario.json, written by `python -m frmps_engine.ring.vectors`.
type scenario struct {
	Capacity uint64 `json:"capacity"`
	Ops      []struct {
		Op      string `json:"op"`
		Step    uint64 `json:"step"`
		Full    bool   `json:"full"`
		Entries []struct {
			Key         uint64   `json:"key"`
			Seed        uint64   `json:"seed"`
			NumComputed uint32   `json:"num_computed"`
			NumPrompt   uint32   `json:"num_prompt"`
			Flags       uint32   `json:"flags"`
			Blocks      []uint32 `json:"blocks"`
			Tokens      []uint32 `json:"tokens"`
		} `json:"entries"`
	} `json:"ops"`
	Final map[string]struct {
		Seed        uint64   `json:"seed"`
		NumPrompt   uint32   `json:"num_prompt"`
		NumComputed uint32   `json:"num_computed"`
		Blocks      []uint32 `json:"blocks"`
		Tokens      []uint32 `json:"tokens"`
	} `json:"final"`
	Start     uint64 `json:"start"`
	EndCursor uint64 `json:"end_cursor"`
	EndSeq    uint64 `json:"end_seq"`
	EndEpoch  uint64 `json:"end_epoch"`
	Records   []struct {
		Seq   uint64 `json:"seq"`
		Type  uint16 `json:"type"`
		Epoch uint64 `json:"epoch"`
		Step  uint64 `json:"step"`
	} `json:"records"`
}

func loadScenario(t *testing.T) *scenario {
	t.Helper()
	b, err := os.ReadFile("testdata/scenario.json")
	if err != nil {
		t.Fatal(err)
	}
	var sc scenario
	if err := json.Unmarshal(b, &sc); err != nil {
		t.Fatal(err)
	}
	return &sc
}

// writeScenario performs the scenario with the Go writer.
func writeScenario(t *testing.T, sc *scenario, path string) {
	t.Helper()
	if err := Create(path, sc.Capacity); err != nil {
		t.Fatal(err)
	}
	var w *Writer
	defer func() {
		if w != nil {
			_ = w.Close()
		}
	}()
	for _, op := range sc.Ops {
		if op.Op == "attach" {
			if w != nil {
				if err := w.Close(); err != nil {
					t.Fatal(err)
				}
			}
			var err error
			if w, err = OpenWriter(path); err != nil {
				t.Fatal(err)
			}
			continue
		}
		es := make([]Entry, len(op.Entries))
		for i, e := range op.Entries {
			es[i] = Entry{Key: e.Key, Seed: e.Seed, NumComputed: e.NumComputed, NumPrompt: e.NumPrompt, Flags: e.Flags, Blocks: e.Blocks, Tokens: e.Tokens}
		}
		mustPublish(t, w, op.Step, es, op.Full)
	}
}

// decodeVector reads a ring file from the scenario's start position and
// checks what it decodes against the scenario.
func decodeVector(t *testing.T, sc *scenario, path string) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	words := make([]uint64, (len(b)+7)/8)
	mem := unsafe.Slice((*byte)(unsafe.Pointer(&words[0])), len(b))
	copy(mem, b)
	capacity, err := validateHeader(mem, int64(len(mem)))
	if err != nil {
		t.Fatal(err)
	}
	reg := &region{mem: mem, data: mem[HeaderSize:], capacity: capacity}
	if reg.load(offWriteCursor) != sc.EndCursor || reg.load(offWriteSeq) != sc.EndSeq || reg.load(offEpoch) != sc.EndEpoch {
		t.Fatalf("header: cursor %d seq %d epoch %d, want %d %d %d", reg.load(offWriteCursor), reg.load(offWriteSeq), reg.load(offEpoch), sc.EndCursor, sc.EndSeq, sc.EndEpoch)
	}
	rd := newReaderAt(reg, sc.Start)
	s := NewSnapshot()
	n, err := rd.Poll(s)
	if err != nil {
		t.Fatal(err)
	}
	want := 0
	for _, r := range sc.Records {
		if r.Type != TypePad {
			want++
		}
	}
	last := sc.Records[len(sc.Records)-1]
	if n != want || s.Stale() || s.Seq() != last.Seq || s.Step() != last.Step || s.Epoch() != last.Epoch {
		t.Fatalf("applied %d (want %d), stale %v, seq %d step %d epoch %d; want %+v", n, want, s.Stale(), s.Seq(), s.Step(), s.Epoch(), last)
	}
	if s.Len() != len(sc.Final) {
		t.Fatalf("%d requests, want %d", s.Len(), len(sc.Final))
	}
	for k, f := range sc.Final {
		key, _ := strconv.ParseUint(k, 10, 64)
		g, ok := s.Get(key)
		if !ok || g.Seed != f.Seed || g.NumPrompt != f.NumPrompt || g.NumComputed != f.NumComputed ||
			!slices.Equal(g.BlockIDs, f.Blocks) || !slices.Equal(g.TokenIDs, f.Tokens) {
			t.Fatalf("request %d: got %+v (present %v), want %+v", key, g, ok, f)
		}
	}
}

// TestVectors: the Go writer reproduces go_writer.ring byte for byte, which
// equals the Python writer's py_writer.ring; Go decodes the Python ring. The
// Python tests decode go_writer.ring.
func TestVectors(t *testing.T) {
	sc := loadScenario(t)
	p := filepath.Join(t.TempDir(), "ring")
	writeScenario(t, sc, p)
	got, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	if *update {
		if err := os.WriteFile("testdata/go_writer.ring", got, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	committed, err := os.ReadFile("testdata/go_writer.ring")
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, committed) {
		t.Fatal("the Go writer no longer produces testdata/go_writer.ring (run with -update only if the format change is intended)")
	}
	py, err := os.ReadFile("testdata/py_writer.ring")
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, py) {
		t.Fatal("the Go and Python writers produce different bytes for the same scenario")
	}
	t.Run("decode py_writer.ring", func(t *testing.T) { decodeVector(t, sc, "testdata/py_writer.ring") })
	t.Run("decode go_writer.ring", func(t *testing.T) { decodeVector(t, sc, "testdata/go_writer.ring") })
}
