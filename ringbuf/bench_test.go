package ringbuf

import (
	"fmt"
	"testing"
	"unsafe"
)

// benchRing fills an in-memory ring with one FULL record then DELTA records of
// `live` requests each appending `tokens` tokens (and a block every 16 tokens),
// up to just under capacity/2 (the most a reader consumes in one go).
func benchRing(b *testing.B, live, tokens int) (*region, int) {
	const capacity = 1 << 26
	words := make([]uint64, (HeaderSize+capacity)/8)
	mem := unsafe.Slice((*byte)(unsafe.Pointer(&words[0])), HeaderSize+capacity)
	initHeader(mem, capacity)
	reg := &region{mem: mem, data: mem[HeaderSize:], capacity: capacity}
	w := newWriter(reg)
	full := make([]Entry, live)
	for i := range full {
		full[i] = Entry{Key: uint64(i + 1), Seed: uint64(i), NumPrompt: 16, NumComputed: 16, Flags: FlagReset,
			Blocks: []uint32{uint32(i)}, Tokens: make([]uint32, 16)}
	}
	if _, err := w.Publish(0, full, true); err != nil {
		b.Fatal(err)
	}
	deltas := 0
	toks := make([]uint32, tokens)
	n := make([]uint32, live)
	for step := uint64(1); ; step++ {
		e := make([]Entry, live)
		for i := range e {
			var blocks []uint32
			if (n[i]+16)/16 != (n[i]+16+uint32(tokens))/16 {
				blocks = []uint32{uint32(step)}
			}
			n[i] += uint32(tokens)
			e[i] = Entry{Key: uint64(i + 1), Seed: uint64(i), NumComputed: 16 + n[i] - 1, Blocks: blocks, Tokens: toks}
		}
		plen := alignUp(RecordHeaderSize + payloadLen(uint64(live), uint64(live), uint64(live*tokens)))
		if w.cursor+2*plen > capacity/2 {
			break
		}
		if _, err := w.Publish(step, e, false); err != nil {
			b.Fatal(err)
		}
		deltas += live
	}
	return reg, deltas
}

// BenchmarkConsume measures the reader: copy, CRC-32C check, decode and
// compaction into the snapshot, on one goroutine. Reported as request-deltas/s.
func BenchmarkConsume(b *testing.B) {
	for _, c := range []struct{ live, tokens int }{{1, 1}, {64, 1}, {256, 1}, {256, 16}} {
		b.Run(fmt.Sprintf("requests=%d/tokens=%d", c.live, c.tokens), func(b *testing.B) {
			reg, deltas := benchRing(b, c.live, c.tokens)
			b.ResetTimer()
			for range b.N {
				rd := newReaderAt(reg, 0)
				s := NewSnapshot()
				if _, err := rd.Poll(s); err != nil {
					b.Fatal(err)
				}
				if s.Len() != c.live {
					b.Fatalf("%d requests", s.Len())
				}
			}
			el := b.Elapsed().Seconds()
			b.ReportMetric(float64(deltas)*float64(b.N)/el, "deltas/s")
			b.ReportMetric(el*1e9/(float64(deltas)*float64(b.N)), "ns/delta")
		})
	}
}
