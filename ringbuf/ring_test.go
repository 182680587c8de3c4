package ringbuf

import (
	"encoding/binary"
	"errors"
	"os"
	"path/filepath"
	"testing"
)

func TestCreate(t *testing.T) {
	p := newRing(t, 1<<16)
	st, err := os.Stat(p)
	if err != nil {
		t.Fatal(err)
	}
	if st.Mode().Perm() != 0o600 || st.Size() != HeaderSize+1<<16 {
		t.Fatalf("mode %v size %d", st.Mode(), st.Size())
	}
	if err := Create(p, 1<<16); !errors.Is(err, os.ErrExist) {
		t.Fatalf("second Create: %v, want ErrExist", err)
	}
	for _, c := range []uint64{0, 1, 2048, 4095, 4097, 6000, 1 << 35} {
		q := filepath.Join(t.TempDir(), "r")
		if err := Create(q, c); !errors.Is(err, ErrCapacity) {
			t.Errorf("Create(%d): %v, want ErrCapacity", c, err)
		}
		if _, err := os.Stat(q); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("Create(%d) left a file behind", c)
		}
	}
}

func TestOpenBadHeader(t *testing.T) {
	le := binary.LittleEndian
	cases := []struct {
		name string
		edit func(b []byte) []byte
		want error
	}{
		{"empty file", func(b []byte) []byte { return nil }, ErrBadMagic},
		{"truncated header", func(b []byte) []byte { return b[:100] }, ErrBadMagic},
		{"wrong magic", func(b []byte) []byte { copy(b, "FRMPSRNX"); return b }, ErrBadMagic},
		{"zero magic", func(b []byte) []byte { clear(b[:8]); return b }, ErrBadMagic},
		{"version 2", func(b []byte) []byte { le.PutUint32(b[offVersion:], 2); return b }, ErrVersion},
		{"version 0", func(b []byte) []byte { le.PutUint32(b[offVersion:], 0); return b }, ErrVersion},
		{"header size", func(b []byte) []byte { le.PutUint32(b[offHeaderSize:], 8192); return b }, ErrVersion},
		{"capacity not power of two", func(b []byte) []byte { le.PutUint64(b[offCapacity:], 6144); return b }, ErrCapacity},
		{"capacity too small", func(b []byte) []byte { le.PutUint64(b[offCapacity:], 2048); return b }, ErrCapacity},
		{"capacity huge", func(b []byte) []byte { le.PutUint64(b[offCapacity:], 1<<63); return b }, ErrCapacity},
		{"capacity larger than file", func(b []byte) []byte { le.PutUint64(b[offCapacity:], 1<<14); return b }, ErrCapacity},
		{"capacity smaller than file", func(b []byte) []byte { le.PutUint64(b[offCapacity:], 4096); return b }, ErrCapacity},
		{"file truncated", func(b []byte) []byte { return b[:HeaderSize+4096] }, ErrCapacity},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p := newRing(t, 1<<13)
			b, err := os.ReadFile(p)
			if err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(p, c.edit(b), 0o600); err != nil {
				t.Fatal(err)
			}
			if r, err := OpenReader(p); !errors.Is(err, c.want) {
				t.Errorf("OpenReader: %v, want %v", err, c.want)
				if err == nil {
					_ = r.Close()
				}
			}
			if w, err := OpenWriter(p); !errors.Is(err, c.want) {
				t.Errorf("OpenWriter: %v, want %v", err, c.want)
				if err == nil {
					_ = w.Close()
				}
			}
		})
	}
	if _, err := OpenReader(filepath.Join(t.TempDir(), "missing")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("missing file: %v", err)
	}
}

// TestModelRoundTrip runs a random workload through the Go writer and reader
// over a small ring (it wraps, with PAD records, hundreds of times) and checks
// every request after every poll.
func TestModelRoundTrip(t *testing.T) {
	for _, every := range []int{1, 3, 7} {
		p := newRing(t, 1<<16)
		r := openReader(t, p)
		w := openWriter(t, p)
		wl := newWorkload(uint64(every))
		s := NewSnapshot()
		mustPublish(t, w, 0, nil, true)
		pads := 0
		for step := uint64(1); step <= 3000; step++ {
			before := w.seq
			if w.ResyncRequested() {
				wl.step()
				mustPublish(t, w, step, wl.full(), true)
			} else {
				mustPublish(t, w, step, wl.step(), false)
			}
			pads += int(w.seq - before - 1)
			if step%uint64(every) == 0 {
				if _, err := r.Poll(s); err != nil {
					t.Fatal(err)
				}
				if s.Stale() || s.Step() != step || r.Lag() != 0 {
					t.Fatalf("step %d: stale %v, snapshot step %d, lag %d", step, s.Stale(), s.Step(), r.Lag())
				}
				checkSnapshot(t, s, wl)
			}
		}
		if w.cursor < 20*w.r.capacity || pads < 10 {
			t.Fatalf("the ring wrapped %d times with %d PAD records; the test wants many", w.cursor/w.r.capacity, pads)
		}
		if r.Resyncs() != 1 {
			t.Fatalf("%d resyncs, want only the initial one", r.Resyncs())
		}
	}
}

func TestOverrunResync(t *testing.T) {
	p := newRing(t, 1<<15)
	r := openReader(t, p)
	w := openWriter(t, p)
	wl := newWorkload(42)
	s := NewSnapshot()
	mustPublish(t, w, 0, nil, true)
	if _, err := r.Poll(s); err != nil || s.Stale() {
		t.Fatalf("poll: %v stale %v", err, s.Stale())
	}
	step := uint64(1)
	for ; w.cursor < 3*w.r.capacity; step++ {
		mustPublish(t, w, step, wl.step(), false)
	}
	_, err := r.Poll(s)
	if !errors.Is(err, ErrResync) || !errors.Is(err, ErrOverrun) {
		t.Fatalf("poll after overrun: %v", err)
	}
	if !s.Stale() || !w.ResyncRequested() || r.Resyncs() != 2 {
		t.Fatalf("stale %v, resync requested %v, resyncs %d", s.Stale(), w.ResyncRequested(), r.Resyncs())
	}
	// DELTAs published before the writer notices are not applied.
	mustPublish(t, w, step, wl.step(), false)
	step++
	if n, err := r.Poll(s); err != nil || n != 0 || !s.Stale() {
		t.Fatalf("poll: %d %v stale %v", n, err, s.Stale())
	}
	wl.step()
	mustPublish(t, w, step, wl.full(), true)
	if w.ResyncRequested() {
		t.Fatal("FULL did not acknowledge the resync")
	}
	if n, err := r.Poll(s); err != nil || n != 1 || s.Stale() {
		t.Fatalf("poll: %d %v stale %v", n, err, s.Stale())
	}
	checkSnapshot(t, s, wl)
}

// publishSome leaves a reader in sync with a few committed records; it returns
// the data offset of the last record.
func publishSome(t *testing.T, w *Writer, r *Reader, s *Snapshot, wl *workload) uint64 {
	t.Helper()
	mustPublish(t, w, 0, nil, true)
	for i := uint64(1); i <= 5; i++ {
		mustPublish(t, w, i, wl.step(), false)
	}
	if _, err := r.Poll(s); err != nil {
		t.Fatal(err)
	}
	for len(wl.live) == 0 {
		mustPublish(t, w, 6, wl.step(), false)
	}
	if _, err := r.Poll(s); err != nil {
		t.Fatal(err)
	}
	return w.cursor % w.r.capacity
}

func TestCorruptRecord(t *testing.T) {
	le := binary.LittleEndian
	cases := []struct {
		name   string
		edit   func(rec []byte)
		fixCRC bool
	}{
		{"payload bit flip", func(rec []byte) { rec[RecordHeaderSize+20] ^= 0x10 }, false},
		{"crc", func(rec []byte) { rec[recOffCRC] ^= 1 }, false},
		{"seq gap", func(rec []byte) { le.PutUint64(rec[recOffSeq:], le.Uint64(rec[recOffSeq:])+1) }, false},
		{"type", func(rec []byte) { le.PutUint16(rec[recOffType:], 9) }, false},
		{"flags", func(rec []byte) { le.PutUint16(rec[recOffFlags:], 1) }, false},
		{"length not aligned", func(rec []byte) { le.PutUint32(rec[recOffLength:], le.Uint32(rec[recOffLength:])+4) }, false},
		{"length zero", func(rec []byte) { le.PutUint32(rec[recOffLength:], 0) }, false},
		{"length past cursor", func(rec []byte) { le.PutUint32(rec[recOffLength:], le.Uint32(rec[recOffLength:])+32) }, false},
		{"payload_len too big", func(rec []byte) { le.PutUint32(rec[recOffPayloadLen:], le.Uint32(rec[recOffLength:])) }, false},
		{"zeroed header", func(rec []byte) { clear(rec[:RecordHeaderSize]) }, false},
		{"old epoch", func(rec []byte) { le.PutUint64(rec[recOffEpoch:], 0) }, false},
		{"seq gap, valid crc", func(rec []byte) { le.PutUint64(rec[recOffSeq:], le.Uint64(rec[recOffSeq:])+1) }, true},
		{"old epoch, valid crc", func(rec []byte) { le.PutUint64(rec[recOffEpoch:], 0) }, true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p := newRing(t, 1<<16)
			r := openReader(t, p)
			w := openWriter(t, p)
			wl := newWorkload(3)
			s := NewSnapshot()
			publishSome(t, w, r, s, wl)
			before := snapshotDigest(s)
			off := w.cursor % w.r.capacity
			mustPublish(t, w, 7, wl.step(), false)
			rec := w.r.data[off:]
			c.edit(rec)
			if c.fixCRC {
				plen := le.Uint32(rec[recOffPayloadLen:])
				le.PutUint32(rec[recOffCRC:], recordCRC(rec, rec[RecordHeaderSize:RecordHeaderSize+plen]))
			}
			n, err := r.Poll(s)
			if !errors.Is(err, ErrResync) || !errors.Is(err, ErrCorrupt) || n != 0 {
				t.Fatalf("poll: %d, %v; want ErrCorrupt", n, err)
			}
			if !s.Stale() || snapshotDigest(s) != before {
				t.Fatal("a corrupt record changed the snapshot or left it fresh")
			}
			t.Log(err)
		})
	}
}

func TestCorruptPayloadWithValidCRC(t *testing.T) {
	// Records whose framing and CRC are right but whose payload is not: the
	// writer's CRC is recomputed after the edit.
	le := binary.LittleEndian
	cases := []struct {
		name string
		edit func(p []byte)
		want error
	}{
		{"n too big", func(p []byte) { le.PutUint32(p[0:], 1<<20) }, ErrCorrupt},
		{"reserved", func(p []byte) { le.PutUint32(p[4:], 1) }, ErrCorrupt},
		{"unknown flag", func(p []byte) { le.PutUint32(p[16+16+8:], 1<<5) }, ErrCorrupt},
		{"n_tokens off", func(p []byte) { le.PutUint32(p[16+16+16:], 5) }, ErrCorrupt},
		{"unknown key", func(p []byte) { le.PutUint64(p[16:], 999999) }, ErrInconsistent},
		{"num_computed past tokens", func(p []byte) { le.PutUint32(p[16+16:], 1000) }, ErrInconsistent},
		{"num_prompt on delta", func(p []byte) { le.PutUint32(p[16+16+4:], 1) }, ErrInconsistent},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p := newRing(t, 1<<16)
			r := openReader(t, p)
			w := openWriter(t, p)
			wl := newWorkload(3)
			s := NewSnapshot()
			publishSome(t, w, r, s, wl)
			var key uint64
			for k := range wl.live {
				key = k
			}
			m := wl.live[key]
			off := w.cursor % w.r.capacity
			// One delta entry (n=1) with one token and no blocks.
			mustPublish(t, w, 7, []Entry{{Key: key, Seed: m.seed, NumComputed: uint32(len(m.tokens)), Tokens: []uint32{5}}}, false)
			rec := w.r.data[off:]
			plen := le.Uint32(rec[recOffPayloadLen:])
			c.edit(rec[RecordHeaderSize : RecordHeaderSize+plen])
			le.PutUint32(rec[recOffCRC:], recordCRC(rec, rec[RecordHeaderSize:RecordHeaderSize+plen]))
			before := snapshotDigest(s)
			n, err := r.Poll(s)
			if !errors.Is(err, ErrResync) || !errors.Is(err, c.want) || n != 0 {
				t.Fatalf("poll: %d, %v; want %v", n, err, c.want)
			}
			if !s.Stale() || snapshotDigest(s) != before {
				t.Fatal("a bad record changed the snapshot or left it fresh")
			}
		})
	}
}

func TestRestartedReader(t *testing.T) {
	p := newRing(t, 1<<16)
	w := openWriter(t, p)
	wl := newWorkload(9)
	mustPublish(t, w, 0, nil, true)
	for i := uint64(1); i <= 50; i++ {
		mustPublish(t, w, i, wl.step(), false)
	}
	r := openReader(t, p) // a supervisor that restarted
	s := NewSnapshot()
	if n, err := r.Poll(s); err != nil || n != 0 || !s.Stale() || s.Len() != 0 {
		t.Fatalf("fresh reader: %d %v stale %v len %d", n, err, s.Stale(), s.Len())
	}
	if !w.ResyncRequested() {
		t.Fatal("a new reader must request a resync")
	}
	mustPublish(t, w, 51, wl.step(), false) // ignored: stale until FULL
	wl.step()
	mustPublish(t, w, 52, wl.full(), true)
	mustPublish(t, w, 53, wl.step(), false)
	if n, err := r.Poll(s); err != nil || n != 2 || s.Stale() {
		t.Fatalf("poll: %d %v stale %v", n, err, s.Stale())
	}
	checkSnapshot(t, s, wl)
}

func TestNewEpoch(t *testing.T) {
	p := newRing(t, 1<<16)
	r := openReader(t, p)
	s := NewSnapshot()
	w1 := openWriter(t, p)
	wl := newWorkload(5)
	mustPublish(t, w1, 0, nil, true)
	for i := uint64(1); i <= 20; i++ {
		mustPublish(t, w1, i, wl.step(), false)
	}
	if _, err := r.Poll(s); err != nil {
		t.Fatal(err)
	}
	checkSnapshot(t, s, wl)
	w2 := openWriter(t, p) // the standby took over
	if w2.Epoch() != w1.Epoch()+1 {
		t.Fatalf("epoch %d after %d", w2.Epoch(), w1.Epoch())
	}
	if _, err := w2.Publish(21, nil, false); !errors.Is(err, ErrNotFull) {
		t.Fatalf("first record of a new writer as DELTA: %v", err)
	}
	wl2 := newWorkload(6)
	wl2.step()
	mustPublish(t, w2, 100, wl2.full(), true)
	mustPublish(t, w2, 101, wl2.step(), false)
	if _, err := r.Poll(s); err != nil || s.Stale() || s.Epoch() != w2.Epoch() {
		t.Fatalf("poll: %v stale %v epoch %d", err, s.Stale(), s.Epoch())
	}
	checkSnapshot(t, s, wl2)

	// A new writer whose first record is a DELTA (a broken writer) is refused.
	w3 := openWriter(t, p)
	w3.sawFull = true
	mustPublish(t, w3, 102, wl2.step(), false)
	if _, err := r.Poll(s); !errors.Is(err, ErrInconsistent) || !s.Stale() {
		t.Fatalf("poll: %v stale %v", err, s.Stale())
	}
}

// TestWriterKilledBeforeFirstRecord: a new writer killed before it committed
// a DELTA or FULL record leaves nothing of its epoch for the reader, which
// keeps the previous writer's snapshot, fresh. write_seq has moved although
// nothing of the new epoch was applied (it is stored before the commit, and a
// writer's first commit may be a PAD): the crash test once took that move for
// a commit and expected the new epoch in the snapshot.
func TestWriterKilledBeforeFirstRecord(t *testing.T) {
	for _, tc := range []struct {
		name string
		kill func(t *testing.T, w *Writer)
	}{
		{"between the write_seq and write_cursor stores", func(t *testing.T, w *Writer) {
			// What commit leaves when the process dies right before its last store.
			w.r.store(offWriteSeq, w.seq+1)
		}},
		{"after the PAD before its first FULL", func(t *testing.T, w *Writer) {
			if left := w.r.capacity - w.cursor%w.r.capacity; left != RecordAlign {
				t.Fatalf("%d bytes left before the end, want %d", left, RecordAlign)
			}
			w.padIfNeeded(alignUp(RecordHeaderSize + payloadFixed)) // Publish's first step for an empty FULL
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const capacity = 4096
			p := newRing(t, capacity)
			r := openReader(t, p)
			s := NewSnapshot()
			w1 := openWriter(t, p)
			wl := newWorkload(3)
			// A FULL record of an odd number of 32-byte units, then empty
			// 64-byte DELTAs up to 32 bytes before the end: the next writer's
			// first FULL (64 bytes) needs a PAD.
			for {
				wl.step()
				if n := recordSize(wl.full()); n/RecordAlign%2 == 1 && n <= capacity/4 {
					break
				}
			}
			mustPublish(t, w1, 0, wl.full(), true)
			for i := uint64(1); w1.cursor%capacity != capacity-RecordAlign; i++ {
				if _, err := r.Poll(s); err != nil { // keep within capacity/2
					t.Fatal(err)
				}
				mustPublish(t, w1, i, nil, false)
			}
			if _, err := r.Poll(s); err != nil || s.Stale() {
				t.Fatalf("poll: %v stale %v", err, s.Stale())
			}
			seqBefore := w1.r.load(offWriteSeq)

			w2 := openWriter(t, p)
			tc.kill(t, w2)
			if w2.r.load(offWriteSeq) == seqBefore {
				t.Fatal("write_seq did not move")
			}
			if n, err := r.Poll(s); err != nil || n != 0 {
				t.Fatalf("poll after the kill: %d records, %v", n, err)
			}
			if s.Stale() || s.Epoch() != w1.Epoch() || r.Lag() != 0 {
				t.Fatalf("stale %v epoch %d (first writer %d) lag %d", s.Stale(), s.Epoch(), w1.Epoch(), r.Lag())
			}
			checkSnapshot(t, s, wl)

			// The next writer is accepted, also when the dead one left write_seq ahead.
			w3 := openWriter(t, p)
			wl3 := newWorkload(4)
			wl3.step()
			mustPublish(t, w3, 0, wl3.full(), true)
			mustPublish(t, w3, 1, wl3.step(), false)
			if _, err := r.Poll(s); err != nil || s.Stale() || s.Epoch() != w3.Epoch() {
				t.Fatalf("poll: %v stale %v epoch %d, want %d", err, s.Stale(), s.Epoch(), w3.Epoch())
			}
			checkSnapshot(t, s, wl3)
		})
	}
}

// recordSize is the length of a record carrying entries.
func recordSize(entries []Entry) uint64 {
	var b, tk uint64
	for _, e := range entries {
		b, tk = b+uint64(len(e.Blocks)), tk+uint64(len(e.Tokens))
	}
	return alignUp(RecordHeaderSize + payloadLen(uint64(len(entries)), b, tk))
}

func TestPublishLimits(t *testing.T) {
	p := newRing(t, 4096)
	w := openWriter(t, p)
	big := Entry{Key: 1, Flags: FlagReset, Tokens: make([]uint32, 600)}
	if _, err := w.Publish(0, []Entry{big}, true); !errors.Is(err, ErrTooLarge) {
		t.Fatalf("record over capacity/2: %v", err)
	}
	if _, err := w.Publish(0, []Entry{{Key: 1}}, true); err == nil {
		t.Fatal("FULL entry without RESET accepted")
	}
	// The largest record that fits, repeatedly: every wrap needs a PAD.
	r := openReader(t, p)
	s := NewSnapshot()
	e := Entry{Key: 1, Flags: FlagReset, Tokens: make([]uint32, (2048-32-16-36)/4)}
	for i := range 10 {
		mustPublish(t, w, uint64(i), []Entry{e}, true)
		if _, err := r.Poll(s); err != nil {
			t.Fatal(err)
		}
	}
	if g, ok := s.Get(1); !ok || len(g.TokenIDs) != len(e.Tokens) {
		t.Fatalf("got %v %v", ok, len(g.TokenIDs))
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := w.Publish(0, nil, true); err == nil {
		t.Fatal("publish after close")
	}
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := r.Poll(s); !errors.Is(err, ErrClosed) {
		t.Fatalf("poll after close: %v", err)
	}
}

func TestFinishedRequestsAreDropped(t *testing.T) {
	p := newRing(t, 1<<16)
	r := openReader(t, p)
	w := openWriter(t, p)
	s := NewSnapshot()
	mustPublish(t, w, 0, nil, true)
	for i := uint64(1); i <= 5000; i++ {
		// Request i arrives; request i-1 finishes; i-2 was dropped already.
		e := []Entry{{Key: i, Seed: i, NumComputed: 1, NumPrompt: 1, Flags: FlagReset, Blocks: []uint32{uint32(i)}, Tokens: []uint32{7}}}
		if i > 1 {
			e = append(e, Entry{Key: i - 1, Seed: i - 1, NumComputed: 2, Tokens: []uint32{8}, Flags: FlagFinished})
		}
		mustPublish(t, w, i, e, false)
		if _, err := r.Poll(s); err != nil {
			t.Fatal(err)
		}
		if s.Len() != 1 {
			t.Fatalf("step %d: %d live requests in the snapshot, want 1", i, s.Len())
		}
	}
}

func TestNoFDLeak(t *testing.T) {
	p := newRing(t, 1<<16)
	count := func() int {
		ents, err := os.ReadDir("/proc/self/fd")
		if err != nil {
			t.Skip("no /proc/self/fd")
		}
		return len(ents)
	}
	before := count()
	for range 50 {
		r, err := OpenReader(p)
		if err != nil {
			t.Fatal(err)
		}
		w, err := OpenWriter(p)
		if err != nil {
			t.Fatal(err)
		}
		if err := r.Close(); err != nil {
			t.Fatal(err)
		}
		if err := w.Close(); err != nil {
			t.Fatal(err)
		}
	}
	if after := count(); after != before {
		t.Fatalf("fds: %d before, %d after", before, after)
	}
}

func TestLagRangeClone(t *testing.T) {
	p := newRing(t, 1<<16)
	r := openReader(t, p)
	w := openWriter(t, p)
	s := NewSnapshot()
	mustPublish(t, w, 0, []Entry{
		{Key: 1, Flags: FlagReset, NumPrompt: 1, NumComputed: 1, Tokens: []uint32{1}, Blocks: []uint32{10}},
		{Key: 2, Flags: FlagReset, NumPrompt: 1, NumComputed: 1, Tokens: []uint32{2}, Blocks: []uint32{20}},
	}, true)
	for i := uint64(1); i <= 4; i++ {
		mustPublish(t, w, i, []Entry{{Key: 1, NumComputed: uint32(i + 1), Tokens: []uint32{uint32(i)}}}, false)
	}
	if r.Lag() != 5 {
		t.Fatalf("lag %d before polling, want 5", r.Lag())
	}
	if n, err := r.Poll(s); err != nil || n != 5 || r.Lag() != 0 {
		t.Fatalf("poll: %d %v lag %d", n, err, r.Lag())
	}
	visited := 0
	s.Range(func(RequestState) bool { visited++; return false })
	if visited != 1 {
		t.Fatalf("Range went on after fn returned false (%d calls)", visited)
	}
	g, _ := s.Get(1)
	c := g.Clone()
	mustPublish(t, w, 5, []Entry{{Key: 1, Flags: FlagReset, NumComputed: 0, Tokens: []uint32{9, 9, 9, 9, 9}}}, false)
	if _, err := r.Poll(s); err != nil {
		t.Fatal(err)
	}
	if len(c.TokenIDs) != 5 || c.TokenIDs[0] != 1 || c.Step != 4 {
		t.Fatalf("clone changed with the snapshot: %+v", c)
	}
	if g2, _ := s.Get(1); g2.TokenIDs[0] != 9 || g2.NumPrompt != 0 || len(g2.BlockIDs) != 0 {
		t.Fatalf("RESET did not replace the state: %+v", g2)
	}
}

// TestTombstone: a RESET+ABORTED entry with no data drops the request whether
// the reader knew it or not (the Python tracker's way of leaving a request
// out of the snapshot when the ring cannot take its state).
func TestTombstone(t *testing.T) {
	p := newRing(t, 1<<16)
	r := openReader(t, p)
	w := openWriter(t, p)
	s := NewSnapshot()
	mustPublish(t, w, 0, []Entry{
		{Key: 1, Seed: 11, NumComputed: 2, NumPrompt: 2, Flags: FlagReset, Blocks: []uint32{3}, Tokens: []uint32{7, 8}},
		{Key: 2, Seed: 12, NumComputed: 2, NumPrompt: 2, Flags: FlagReset, Blocks: []uint32{4}, Tokens: []uint32{9, 10}},
	}, true)
	tomb := func(key uint64) Entry { return Entry{Key: key, Flags: FlagReset | FlagAborted} }
	mustPublish(t, w, 1, []Entry{tomb(1), tomb(99)}, false) // 1 known, 99 never published
	if _, err := r.Poll(s); err != nil {
		t.Fatal(err)
	}
	if s.Stale() || s.Len() != 1 {
		t.Fatalf("stale %v, %d requests; want request 2 only", s.Stale(), s.Len())
	}
	if _, ok := s.Get(1); ok {
		t.Fatal("request 1 survived its tombstone")
	}
	if st, ok := s.Get(2); !ok || len(st.TokenIDs) != 2 {
		t.Fatalf("request 2: %+v, %v", st, ok)
	}
	// Published again whole later, the request is back.
	mustPublish(t, w, 2, []Entry{{Key: 1, Seed: 11, NumComputed: 3, NumPrompt: 2, Flags: FlagReset, Blocks: []uint32{3}, Tokens: []uint32{7, 8, 5}}}, false)
	if _, err := r.Poll(s); err != nil {
		t.Fatal(err)
	}
	if st, ok := s.Get(1); !ok || st.NumComputed != 3 || s.Len() != 2 {
		t.Fatalf("request 1 after its new RESET: %+v, %v (%d requests)", st, ok, s.Len())
	}
}
