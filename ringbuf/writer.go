package ringbuf

import (
	"encoding/binary"
	"fmt"
)

// Entry is one request's entry in a DELTA or FULL record, as the writer publishes it.
type Entry struct {
	Key, Seed   uint64
	NumComputed uint32
	NumPrompt   uint32
	Flags       uint32 // FlagReset | FlagFinished | FlagAborted
	Blocks      []uint32
	Tokens      []uint32
}

// Writer is the Go implementation of the ring writer (FORMAT.md, "Writer
// algorithm"). The engines use the Python writer; this one drives tests, test
// vectors and the crash test, and follows the same algorithm byte for byte.
// A Writer is not safe for concurrent use.
type Writer struct {
	r         *region
	epoch     uint64
	seq       uint64 // last committed seq
	cursor    uint64 // write_cursor as last stored by us
	sawFull   bool
	ownRegion bool
}

// OpenWriter attaches to an existing ring: it validates the header and
// increments the epoch. The caller must publish a FULL record first.
func OpenWriter(path string) (*Writer, error) {
	r, err := mapFile(path, "open ring writer")
	if err != nil {
		return nil, err
	}
	w := newWriter(r)
	w.ownRegion = true
	return w, nil
}

func newWriter(r *region) *Writer {
	w := &Writer{r: r}
	w.epoch = r.load(offEpoch) + 1
	r.store(offEpoch, w.epoch)
	w.cursor = r.load(offWriteCursor)
	w.seq = r.load(offWriteSeq)
	return w
}

// Epoch is the epoch this writer stamps on its records.
func (w *Writer) Epoch() uint64 { return w.epoch }

// ResyncRequested reports whether a reader asked for full state not yet answered.
func (w *Writer) ResyncRequested() bool {
	return w.r.load(offResyncRequest) != w.r.load(offResyncAck)
}

// Publish commits one DELTA (full=false) or FULL record and returns its seq.
func (w *Writer) Publish(step uint64, entries []Entry, full bool) (uint64, error) {
	if w.r == nil || w.r.mem == nil {
		return 0, fmt.Errorf("publish: %w", ErrClosed)
	}
	if !full && !w.sawFull {
		return 0, fmt.Errorf("publish: %w", ErrNotFull)
	}
	var sumB, sumT uint64
	for i := range entries {
		sumB += uint64(len(entries[i].Blocks))
		sumT += uint64(len(entries[i].Tokens))
		if full && entries[i].Flags&FlagReset == 0 {
			return 0, fmt.Errorf("publish: entry %d of a FULL record lacks RESET", i)
		}
	}
	n := uint64(len(entries))
	plen := payloadLen(n, sumB, sumT)
	length := alignUp(RecordHeaderSize + plen)
	if length > w.r.capacity/2 || plen > 1<<32-1 {
		return 0, fmt.Errorf("publish: %w: %d bytes, capacity %d", ErrTooLarge, length, w.r.capacity)
	}
	var ack uint64
	if full {
		ack = w.r.load(offResyncRequest)
	}
	w.padIfNeeded(length)
	off := w.cursor % w.r.capacity
	rec := w.r.data[off : off+length]
	p := rec[RecordHeaderSize : RecordHeaderSize+plen]
	encodePayload(p, step, entries, n)
	typ := uint16(TypeDelta)
	if full {
		typ = TypeFull
	}
	w.commit(rec, typ, plen)
	if full {
		w.sawFull = true
		w.r.store(offResyncAck, ack)
	}
	return w.seq, nil
}

func encodePayload(p []byte, step uint64, entries []Entry, n uint64) {
	le := binary.LittleEndian
	le.PutUint32(p[0:], uint32(n))
	le.PutUint32(p[4:], 0)
	le.PutUint64(p[8:], step)
	keys := p[payloadFixed:]
	seeds := keys[8*n:]
	numComputed := seeds[8*n:]
	numPrompt := numComputed[4*n:]
	flags := numPrompt[4*n:]
	nBlocks := flags[4*n:]
	nTokens := nBlocks[4*n:]
	tail := nTokens[4*n:]
	for i := range entries {
		e := &entries[i]
		le.PutUint64(keys[8*i:], e.Key)
		le.PutUint64(seeds[8*i:], e.Seed)
		le.PutUint32(numComputed[4*i:], e.NumComputed)
		le.PutUint32(numPrompt[4*i:], e.NumPrompt)
		le.PutUint32(flags[4*i:], e.Flags)
		le.PutUint32(nBlocks[4*i:], uint32(len(e.Blocks)))
		le.PutUint32(nTokens[4*i:], uint32(len(e.Tokens)))
	}
	for i := range entries {
		for _, b := range entries[i].Blocks {
			le.PutUint32(tail, b)
			tail = tail[4:]
		}
	}
	for i := range entries {
		for _, t := range entries[i].Tokens {
			le.PutUint32(tail, t)
			tail = tail[4:]
		}
	}
}

// padIfNeeded commits a PAD record when the next record would not fit before
// the end of the data region.
func (w *Writer) padIfNeeded(length uint64) {
	off := w.cursor % w.r.capacity
	left := w.r.capacity - off
	if left >= length {
		return
	}
	w.commit(w.r.data[off:off+left], TypePad, 0)
}

// commit writes the header of rec (whose payload is already in place) and
// publishes it with one 8-byte store of write_cursor.
func (w *Writer) commit(rec []byte, typ uint16, plen uint64) {
	le := binary.LittleEndian
	seq := w.seq + 1
	le.PutUint32(rec[recOffLength:], uint32(len(rec)))
	le.PutUint16(rec[recOffType:], typ)
	le.PutUint16(rec[recOffFlags:], 0)
	le.PutUint64(rec[recOffSeq:], seq)
	le.PutUint64(rec[recOffEpoch:], w.epoch)
	le.PutUint32(rec[recOffPayloadLen:], uint32(plen))
	le.PutUint32(rec[recOffCRC:], recordCRC(rec, rec[RecordHeaderSize:RecordHeaderSize+plen]))
	w.cursor += uint64(len(rec))
	w.seq = seq
	// write_seq first: a writer killed between the two stores leaves write_seq
	// one ahead of the committed records, so the next writer skips a seq
	// (allowed at an epoch change) rather than reusing one.
	w.r.store(offWriteSeq, seq)
	w.r.store(offWriteCursor, w.cursor) // the commit point
}

// Close unmaps the ring. The file stays.
func (w *Writer) Close() error {
	if w.r == nil {
		return nil
	}
	var err error
	if w.ownRegion {
		err = w.r.close()
	}
	w.r = nil
	if err != nil {
		return fmt.Errorf("close ring writer: %w", err)
	}
	return nil
}
