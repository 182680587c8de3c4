package ringbuf

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	if os.Getenv("FRMPS_RING_HELPER") != "" {
		os.Exit(helperMain())
	}
	goleak.VerifyTestMain(m)
}

func newRing(t testing.TB, capacity uint64) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "ring")
	if err := Create(p, capacity); err != nil {
		t.Fatal(err)
	}
	return p
}

func openReader(t testing.TB, path string) *Reader {
	t.Helper()
	r, err := OpenReader(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.Close() })
	return r
}

func openWriter(t testing.TB, path string) *Writer {
	t.Helper()
	w, err := OpenWriter(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = w.Close() })
	return w
}

func mustPublish(t testing.TB, w *Writer, step uint64, e []Entry, full bool) uint64 {
	t.Helper()
	seq, err := w.Publish(step, e, full)
	if err != nil {
		t.Fatal(err)
	}
	return seq
}

// modelReq is the writer-side truth of one request.
type modelReq struct {
	key, seed              uint64
	numPrompt, numComputed uint32
	blocks, tokens         []uint32
}

// digestOf hashes live requests like frmps_engine.ring._testwriter.state_digest.
func digestOf(reqs []modelReq) string {
	slices.SortFunc(reqs, func(a, b modelReq) int {
		switch {
		case a.key < b.key:
			return -1
		case a.key > b.key:
			return 1
		}
		return 0
	})
	h := sha256.New()
	le := binary.LittleEndian
	var b [32]byte
	for _, r := range reqs {
		le.PutUint64(b[0:], r.key)
		le.PutUint64(b[8:], r.seed)
		le.PutUint32(b[16:], r.numPrompt)
		le.PutUint32(b[20:], r.numComputed)
		le.PutUint32(b[24:], uint32(len(r.blocks)))
		h.Write(b[:28])
		for _, x := range r.blocks {
			h.Write(le.AppendUint32(nil, x))
		}
		h.Write(le.AppendUint32(nil, uint32(len(r.tokens))))
		for _, x := range r.tokens {
			h.Write(le.AppendUint32(nil, x))
		}
	}
	return hex.EncodeToString(h.Sum(nil))
}

func snapshotDigest(s *Snapshot) string {
	var reqs []modelReq
	s.Range(func(r RequestState) bool {
		reqs = append(reqs, modelReq{r.Key, r.Seed, r.NumPrompt, r.NumComputed, r.BlockIDs, r.TokenIDs})
		return true
	})
	return digestOf(reqs)
}

// workload is a seeded random engine: it produces, per step, the entries a
// writer publishes and keeps the model of what a reader must then hold.
type workload struct {
	rnd       *rand.Rand
	live      map[uint64]*modelReq
	nextKey   uint64
	nextBlock uint32
	maxLive   int
	maxTokens int
}

func newWorkload(seed uint64) *workload {
	return &workload{rnd: rand.New(rand.NewPCG(seed, 7)), live: map[uint64]*modelReq{}, nextKey: 1, nextBlock: 1, maxLive: 32, maxTokens: 16}
}

func (w *workload) blocksFor(nTokens int) []uint32 {
	n := (nTokens + 15) / 16
	b := make([]uint32, n)
	for i := range b {
		b[i] = w.nextBlock
		w.nextBlock++
	}
	return b
}

func modelReset(r *modelReq) Entry {
	return Entry{Key: r.key, Seed: r.seed, NumComputed: r.numComputed, NumPrompt: r.numPrompt, Flags: FlagReset,
		Blocks: slices.Clone(r.blocks), Tokens: slices.Clone(r.tokens)}
}

// step advances the model and returns the DELTA entries for it.
func (w *workload) step() []Entry {
	var out []Entry
	arrived := map[uint64]bool{}
	for range w.rnd.IntN(3) {
		if len(w.live) >= w.maxLive {
			break
		}
		n := 1 + w.rnd.IntN(64)
		r := &modelReq{key: w.nextKey, seed: w.rnd.Uint64(), numPrompt: uint32(n), numComputed: uint32(n), blocks: w.blocksFor(n)}
		for range n {
			r.tokens = append(r.tokens, w.rnd.Uint32N(1<<17))
		}
		w.nextKey++
		w.live[r.key] = r
		arrived[r.key] = true
		out = append(out, modelReset(r))
	}
	keys := make([]uint64, 0, len(w.live))
	for k := range w.live {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		r := w.live[k]
		if arrived[k] {
			continue
		}
		switch x := w.rnd.Float64(); {
		case x < 0.25:
		case x < 0.88:
			oldB, oldT := len(r.blocks), len(r.tokens)
			for range 1 + w.rnd.IntN(w.maxTokens) {
				r.tokens = append(r.tokens, w.rnd.Uint32N(1<<17))
				if len(r.tokens) > 16*len(r.blocks) {
					r.blocks = append(r.blocks, w.nextBlock)
					w.nextBlock++
				}
			}
			r.numComputed = uint32(len(r.tokens) - w.rnd.IntN(2))
			out = append(out, Entry{Key: k, Seed: r.seed, NumComputed: r.numComputed,
				Blocks: slices.Clone(r.blocks[oldB:]), Tokens: slices.Clone(r.tokens[oldT:])})
		case x < 0.91:
			r.blocks = w.blocksFor(len(r.tokens))
			r.numComputed = uint32(w.rnd.IntN(len(r.tokens) + 1))
			out = append(out, modelReset(r))
		case x < 0.96:
			delete(w.live, k)
			out = append(out, Entry{Key: k, Seed: r.seed, NumComputed: r.numComputed, Flags: FlagFinished})
		default:
			delete(w.live, k)
			out = append(out, Entry{Key: k, Seed: r.seed, NumComputed: r.numComputed, Flags: FlagAborted})
		}
	}
	return out
}

func (w *workload) full() []Entry {
	out := make([]Entry, 0, len(w.live))
	for _, r := range w.live {
		out = append(out, modelReset(r))
	}
	return out
}

func (w *workload) digest() string {
	reqs := make([]modelReq, 0, len(w.live))
	for _, r := range w.live {
		reqs = append(reqs, *r)
	}
	return digestOf(reqs)
}

// checkSnapshot compares every request of s with the model.
func checkSnapshot(t testing.TB, s *Snapshot, w *workload) {
	t.Helper()
	if s.Len() != len(w.live) {
		t.Fatalf("snapshot has %d requests, model %d", s.Len(), len(w.live))
	}
	for k, m := range w.live {
		g, ok := s.Get(k)
		if !ok {
			t.Fatalf("request %d missing", k)
		}
		if g.Seed != m.seed || g.NumPrompt != m.numPrompt || g.NumComputed != m.numComputed ||
			!slices.Equal(g.BlockIDs, m.blocks) || !slices.Equal(g.TokenIDs, m.tokens) {
			t.Fatalf("request %d: got %+v, want %+v", k, g, *m)
		}
	}
}
