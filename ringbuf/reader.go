package ringbuf

import (
	"encoding/binary"
	"fmt"
	"sync"
	"sync/atomic"
)

// Reader consumes the ring (FORMAT.md, "Reader algorithm") into a Snapshot.
// Poll must be called from one goroutine; Lag and Resyncs are safe from any.
type Reader struct {
	r         *region
	ownRegion bool
	mu        sync.Mutex // guards r against Close while Lag reads the header

	pos      uint64 // data position of the next record
	nextSeq  uint64 // 0 = unknown (after a resync)
	epoch    uint64 // epoch of the last DELTA/FULL seen; 0 = none
	seqEpoch uint64 // epoch of the last record of any type
	needFull bool   // the snapshot must be marked stale at the next Poll

	hdr [RecordHeaderSize]byte
	buf []byte // payload copy, reused

	consumedSeq atomic.Uint64
	resyncs     atomic.Uint64
}

// OpenReader maps an existing ring, validates its header and requests a
// resync: the reader starts at the current write position and its snapshot
// stays stale until the writer answers with a FULL record.
func OpenReader(path string) (*Reader, error) {
	reg, err := mapFile(path, "open ring")
	if err != nil {
		return nil, err
	}
	rd := &Reader{r: reg, ownRegion: true}
	rd.requestResync()
	return rd, nil
}

// newReaderAt reads an already validated region from data position pos
// without requesting a resync (fuzzing and test vectors).
func newReaderAt(reg *region, pos uint64) *Reader {
	return &Reader{r: reg, pos: pos, needFull: true}
}

// Close unmaps the ring; the file stays (the supervisor removes it).
func (rd *Reader) Close() error {
	rd.mu.Lock()
	defer rd.mu.Unlock()
	if rd.r == nil {
		return nil
	}
	var err error
	if rd.ownRegion {
		err = rd.r.close()
	}
	rd.r = nil
	if err != nil {
		return fmt.Errorf("close ring: %w", err)
	}
	return nil
}

// Lag is the number of records committed but not yet consumed.
func (rd *Reader) Lag() uint64 {
	rd.mu.Lock()
	defer rd.mu.Unlock()
	if rd.r == nil {
		return 0
	}
	// Caught up: write_seq can be one ahead of the records actually committed
	// (a writer killed between its two stores), so compare positions first.
	if rd.r.load(offReaderCursor) == rd.r.load(offWriteCursor) {
		return 0
	}
	ws, cs := rd.r.load(offWriteSeq), rd.consumedSeq.Load()
	if ws <= cs {
		return 0
	}
	return ws - cs
}

// Resyncs is the number of resyncs requested so far (including the one OpenReader makes).
func (rd *Reader) Resyncs() uint64 { return rd.resyncs.Load() }

func (rd *Reader) requestResync() {
	atomic.AddUint64(rd.r.word(offResyncRequest), 1)
	rd.resyncs.Add(1)
	rd.pos = rd.r.load(offWriteCursor)
	rd.nextSeq = 0
	rd.needFull = true
	// Approximate (a writer may be between its two stores); it only feeds Lag.
	rd.consumedSeq.Store(rd.r.load(offWriteSeq))
	rd.r.store(offReaderCursor, rd.pos)
}

func (rd *Reader) resync(s *Snapshot, cause error) error {
	rd.requestResync()
	s.stale = true
	rd.needFull = false
	return fmt.Errorf("%w; %w", cause, ErrResync)
}

// Poll consumes every committed record into s and returns the number of
// DELTA/FULL records applied. It never blocks. After an overrun, a corrupt or
// an inconsistent record it requests a resync and returns an error wrapping
// ErrResync (and ErrOverrun, ErrCorrupt or ErrInconsistent); keep polling.
func (rd *Reader) Poll(s *Snapshot) (applied int, err error) {
	if rd.r == nil {
		return 0, fmt.Errorf("poll ring: %w", ErrClosed)
	}
	if rd.needFull {
		s.stale = true
		rd.needFull = false
	}
	defer func() { rd.r.store(offReaderCursor, rd.pos) }()
	capacity := rd.r.capacity
	data := rd.r.data
	for {
		wc := rd.r.load(offWriteCursor)
		if wc == rd.pos {
			return applied, nil
		}
		if wc < rd.pos || wc-rd.pos > capacity {
			return applied, rd.resync(s, fmt.Errorf("%w: write cursor %d, reader at %d", ErrOverrun, wc, rd.pos))
		}
		if rd.pos%RecordAlign != 0 {
			return applied, rd.resync(s, fmt.Errorf("%w: misaligned position %d", ErrCorrupt, rd.pos))
		}
		off := rd.pos % capacity
		copy(rd.hdr[:], data[off:off+RecordHeaderSize])
		h := parseRecordHeader(rd.hdr[:])
		ferr := h.checkFraming(off, wc-rd.pos, capacity)
		var payload []byte
		if ferr == nil {
			if uint64(cap(rd.buf)) < h.payloadLen {
				rd.buf = make([]byte, h.payloadLen)
			}
			payload = rd.buf[:h.payloadLen]
			start := off + RecordHeaderSize
			copy(payload, data[start:start+h.payloadLen])
		}
		// A writer in flight writes at most capacity/2 bytes past the cursor it
		// last committed; if that can reach our record, the copy may be torn.
		if wc2 := rd.r.load(offWriteCursor); wc2 < rd.pos || wc2-rd.pos > capacity/2 {
			return applied, rd.resync(s, fmt.Errorf("%w: writer lapped the reader while it copied seq %d", ErrOverrun, h.seq))
		}
		if ferr != nil {
			return applied, rd.resync(s, fmt.Errorf("%w: at position %d: %w", ErrCorrupt, rd.pos, ferr))
		}
		if got := recordCRC(rd.hdr[:], payload); got != h.crc {
			return applied, rd.resync(s, fmt.Errorf("%w: seq %d at position %d: crc32c %#08x, header says %#08x", ErrCorrupt, h.seq, rd.pos, got, h.crc))
		}
		// seq is contiguous within an epoch; a new writer may skip ahead (see FORMAT.md).
		if rd.nextSeq != 0 && h.seq != rd.nextSeq && (h.epoch <= rd.seqEpoch || h.seq < rd.nextSeq) {
			return applied, rd.resync(s, fmt.Errorf("%w: seq %d at position %d, expected %d", ErrCorrupt, h.seq, rd.pos, rd.nextSeq))
		}
		if h.typ != TypePad {
			if h.epoch < rd.epoch {
				return applied, rd.resync(s, fmt.Errorf("%w: seq %d from epoch %d after epoch %d", ErrCorrupt, h.seq, h.epoch, rd.epoch))
			}
			newEpoch := rd.epoch != 0 && h.epoch > rd.epoch
			rd.epoch = h.epoch
			if newEpoch && h.typ == TypeDelta && !s.stale {
				return applied, rd.resync(s, fmt.Errorf("%w: epoch %d starts with a DELTA (seq %d)", ErrInconsistent, h.epoch, h.seq))
			}
			ok, aerr := applyRecord(s, h, payload)
			if aerr != nil {
				return applied, rd.resync(s, fmt.Errorf("seq %d: %w", h.seq, aerr))
			}
			if ok {
				applied++
			}
		}
		rd.pos += uint64(h.length)
		rd.nextSeq = h.seq + 1
		rd.seqEpoch = h.epoch
		rd.consumedSeq.Store(h.seq)
	}
}

type recordHeader struct {
	length     uint32
	typ, flags uint16
	seq, epoch uint64
	payloadLen uint64
	crc        uint32
}

func parseRecordHeader(b []byte) recordHeader {
	le := binary.LittleEndian
	return recordHeader{
		length:     le.Uint32(b[recOffLength:]),
		typ:        le.Uint16(b[recOffType:]),
		flags:      le.Uint16(b[recOffFlags:]),
		seq:        le.Uint64(b[recOffSeq:]),
		epoch:      le.Uint64(b[recOffEpoch:]),
		payloadLen: uint64(le.Uint32(b[recOffPayloadLen:])),
		crc:        le.Uint32(b[recOffCRC:]),
	}
}

// checkFraming validates a record header at data offset off with avail
// committed bytes from there.
func (h recordHeader) checkFraming(off, avail, capacity uint64) error {
	l := uint64(h.length)
	switch {
	case l < RecordHeaderSize || l%RecordAlign != 0:
		return fmt.Errorf("length %d is not a positive multiple of %d", l, RecordAlign)
	case l > avail:
		return fmt.Errorf("length %d exceeds the %d committed bytes", l, avail)
	case l > capacity/2:
		return fmt.Errorf("length %d exceeds capacity/2", l)
	case off+l > capacity:
		return fmt.Errorf("length %d at offset %d crosses the end of the data region", l, off)
	case h.payloadLen > l-RecordHeaderSize:
		return fmt.Errorf("payload_len %d does not fit in length %d", h.payloadLen, l)
	case h.flags != 0:
		return fmt.Errorf("record flags %#x, want 0", h.flags)
	case h.seq == 0:
		return fmt.Errorf("seq 0")
	}
	switch h.typ {
	case TypeDelta, TypeFull:
		if h.payloadLen < payloadFixed {
			return fmt.Errorf("payload_len %d is shorter than the %d-byte payload header", h.payloadLen, payloadFixed)
		}
	case TypePad:
		if h.payloadLen != 0 || off+l != capacity {
			return fmt.Errorf("PAD of length %d at offset %d with payload %d does not end the data region", l, off, h.payloadLen)
		}
	default:
		return fmt.Errorf("unknown record type %d", h.typ)
	}
	return nil
}
