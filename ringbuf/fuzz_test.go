package ringbuf

import (
	"errors"
	"testing"
	"unsafe"
)

const fuzzCap = 4096

// memRegion is a ring in ordinary memory (8-byte aligned for the atomics).
func memRegion() *region {
	words := make([]uint64, (HeaderSize+fuzzCap)/8)
	mem := unsafe.Slice((*byte)(unsafe.Pointer(&words[0])), HeaderSize+fuzzCap)
	initHeader(mem, fuzzCap)
	return &region{mem: mem, data: mem[HeaderSize:], capacity: fuzzCap}
}

// fuzzSeed returns the bytes of a ring written by the Go writer.
func fuzzSeed(steps int, seed uint64, maxTokens int) []byte {
	reg := memRegion()
	w := newWriter(reg)
	wl := newWorkload(seed)
	wl.maxLive, wl.maxTokens = 4, maxTokens
	if _, err := w.Publish(0, nil, true); err != nil {
		panic(err)
	}
	for i := 1; i <= steps; i++ {
		e := wl.step()
		if i%5 == 0 {
			e = wl.full()
			_, _ = w.Publish(uint64(i), e, true)
			continue
		}
		_, _ = w.Publish(uint64(i), e, false)
	}
	return fuzzInput(reg.mem)
}

// fuzzHeaderBytes is how much of the file header a fuzz input carries: every
// field is in the first 256 bytes; the rest is zero. Short inputs keep the
// fuzzer's minimisation cheap.
const fuzzHeaderBytes = 256

// fuzzInput encodes a ring as a fuzz input: mode byte, header, then the data
// region without its trailing zeros.
func fuzzInput(mem []byte) []byte {
	data := mem[HeaderSize:]
	end := len(data)
	for end > 0 && data[end-1] == 0 {
		end--
	}
	out := append([]byte{1}, mem[:fuzzHeaderBytes]...)
	return append(out, data[:end]...)
}

// FuzzReader feeds arbitrary header and data bytes to the reader. The first
// input byte chooses whether the file header is forced valid (even) or taken
// as is (odd), so the fuzzer spends its time on the records.
func FuzzReader(f *testing.F) {
	f.Add(fuzzSeed(0, 1, 2))
	f.Add(fuzzSeed(3, 2, 2))
	f.Add(fuzzSeed(12, 3, 4))
	f.Add(fuzzSeed(60, 4, 8)) // wraps, with PAD records
	f.Add([]byte{0})
	f.Add([]byte{1, 'F', 'R', 'M', 'P', 'S', 'R', 'N', 'G'})
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) == 0 {
			return
		}
		reg := memRegion()
		mode := data[0]
		data = data[1:]
		hdr := data[:min(len(data), fuzzHeaderBytes)]
		copy(reg.mem, hdr)
		copy(reg.data, data[len(hdr):])
		if mode&1 == 0 {
			initHeader(reg.mem, fuzzCap)
		}
		if _, err := validateHeader(reg.mem, int64(len(reg.mem))); err != nil {
			if !errors.Is(err, ErrBadMagic) && !errors.Is(err, ErrVersion) && !errors.Is(err, ErrCapacity) {
				t.Fatalf("unexpected header error %v", err)
			}
			return
		}
		rd := newReaderAt(reg, 0)
		s := NewSnapshot()
		for range 3 {
			_, err := rd.Poll(s)
			if err != nil && !errors.Is(err, ErrResync) {
				t.Fatalf("poll error without resync: %v", err)
			}
			s.Range(func(r RequestState) bool {
				if int(r.NumComputed) > len(r.TokenIDs) || int(r.NumPrompt) > len(r.TokenIDs) {
					t.Fatalf("snapshot invariant broken: %+v", r)
				}
				return true
			})
		}
	})
}
