package ringbuf

import (
	"encoding/binary"
	"fmt"
)

// payloadView is a validated DELTA/FULL payload, its columns sliced out of the record bytes.
type payloadView struct {
	n                                uint64
	step                             uint64
	keys, seeds                      []byte
	numComputed, numPrompt, flags    []byte
	nBlocks, nTokens, blocks, tokens []byte
	sumBlocks, sumTokens             uint64
}

// parsePayload checks the columnar layout without touching the snapshot.
func parsePayload(p []byte, full bool) (payloadView, error) {
	le := binary.LittleEndian
	var v payloadView
	if len(p) < payloadFixed {
		return v, fmt.Errorf("%w: payload of %d bytes", ErrCorrupt, len(p))
	}
	v.n = uint64(le.Uint32(p[0:]))
	if r := le.Uint32(p[4:]); r != 0 {
		return v, fmt.Errorf("%w: reserved payload word %#x", ErrCorrupt, r)
	}
	v.step = le.Uint64(p[8:])
	plen := uint64(len(p))
	if payloadLen(v.n, 0, 0) > plen {
		return v, fmt.Errorf("%w: %d entries do not fit in a %d-byte payload", ErrCorrupt, v.n, plen)
	}
	n := v.n
	cols := p[payloadFixed:]
	v.keys, cols = cols[:8*n], cols[8*n:]
	v.seeds, cols = cols[:8*n], cols[8*n:]
	v.numComputed, cols = cols[:4*n], cols[4*n:]
	v.numPrompt, cols = cols[:4*n], cols[4*n:]
	v.flags, cols = cols[:4*n], cols[4*n:]
	v.nBlocks, cols = cols[:4*n], cols[4*n:]
	v.nTokens, cols = cols[:4*n], cols[4*n:]
	for i := uint64(0); i < n; i++ {
		v.sumBlocks += uint64(le.Uint32(v.nBlocks[4*i:]))
		v.sumTokens += uint64(le.Uint32(v.nTokens[4*i:]))
		f := le.Uint32(v.flags[4*i:])
		if f&^flagsKnown != 0 {
			return v, fmt.Errorf("%w: entry %d has unknown flags %#x", ErrCorrupt, i, f)
		}
		if full && f&FlagReset == 0 {
			return v, fmt.Errorf("%w: entry %d of a FULL record lacks RESET", ErrCorrupt, i)
		}
	}
	if want := payloadLen(n, v.sumBlocks, v.sumTokens); want != plen {
		return v, fmt.Errorf("%w: payload_len %d, columns need %d", ErrCorrupt, plen, want)
	}
	v.blocks, cols = cols[:4*v.sumBlocks], cols[4*v.sumBlocks:]
	v.tokens = cols[:4*v.sumTokens]
	return v, nil
}

func appendU32(dst []uint32, src []byte) []uint32 {
	for i := 0; i+4 <= len(src); i += 4 {
		dst = append(dst, binary.LittleEndian.Uint32(src[i:]))
	}
	return dst
}

// applyRecord applies a CRC-checked DELTA or FULL record. It reports whether
// the record changed the snapshot (DELTAs are skipped while it is stale).
func applyRecord(s *Snapshot, h recordHeader, p []byte) (bool, error) {
	full := h.typ == TypeFull
	if !full && s.stale {
		return false, nil
	}
	v, err := parsePayload(p, full)
	if err != nil {
		return false, err
	}
	if full {
		if err := applyFull(s, &v); err != nil {
			return false, err
		}
	} else if err := applyDelta(s, &v); err != nil {
		return false, err
	}
	s.lastSeq, s.step, s.epoch = h.seq, v.step, h.epoch
	return true, nil
}

// applyFull builds the new table aside and swaps it in, so a bad FULL record
// leaves the old table untouched.
func applyFull(s *Snapshot, v *payloadView) error {
	le := binary.LittleEndian
	reqs := make(map[uint64]*RequestState, v.n)
	var bo, to uint64
	for i := uint64(0); i < v.n; i++ {
		key := le.Uint64(v.keys[8*i:])
		nb, nt := uint64(le.Uint32(v.nBlocks[4*i:])), uint64(le.Uint32(v.nTokens[4*i:]))
		blocks, tokens := v.blocks[4*bo:4*(bo+nb)], v.tokens[4*to:4*(to+nt)]
		bo, to = bo+nb, to+nt
		if _, dup := reqs[key]; dup {
			return fmt.Errorf("%w: key %d twice in a FULL record", ErrInconsistent, key)
		}
		st := &RequestState{Key: key}
		if err := resetEntry(st, v, i, blocks, tokens); err != nil {
			return err
		}
		if le.Uint32(v.flags[4*i:])&(FlagFinished|FlagAborted) == 0 {
			reqs[key] = st
		}
	}
	s.reqs = reqs
	s.stale = false
	return nil
}

func resetEntry(st *RequestState, v *payloadView, i uint64, blocks, tokens []byte) error {
	le := binary.LittleEndian
	nt := uint32(len(tokens) / 4)
	np, nc := le.Uint32(v.numPrompt[4*i:]), le.Uint32(v.numComputed[4*i:])
	if np > nt || nc > nt {
		return fmt.Errorf("%w: key %d: num_prompt %d, num_computed %d, %d tokens", ErrInconsistent, st.Key, np, nc, nt)
	}
	st.BlockIDs = appendU32(st.BlockIDs[:0], blocks)
	st.TokenIDs = appendU32(st.TokenIDs[:0], tokens)
	st.NumPrompt, st.NumComputed = np, nc
	st.Seed = le.Uint64(v.seeds[8*i:])
	st.Step = v.step
	return nil
}

// applyDelta applies the entries in order; each entry is checked before it
// changes anything. On an inconsistent entry the caller resyncs, which marks
// the snapshot stale.
func applyDelta(s *Snapshot, v *payloadView) error {
	le := binary.LittleEndian
	var bo, to uint64
	for i := uint64(0); i < v.n; i++ {
		key := le.Uint64(v.keys[8*i:])
		flags := le.Uint32(v.flags[4*i:])
		nb, nt := uint64(le.Uint32(v.nBlocks[4*i:])), uint64(le.Uint32(v.nTokens[4*i:]))
		blocks, tokens := v.blocks[4*bo:4*(bo+nb)], v.tokens[4*to:4*(to+nt)]
		bo, to = bo+nb, to+nt
		st, known := s.reqs[key]
		if flags&FlagReset != 0 {
			if !known {
				st = &RequestState{Key: key}
			}
			if err := resetEntry(st, v, i, blocks, tokens); err != nil {
				return err
			}
			if !known {
				s.reqs[key] = st
			}
		} else {
			if !known {
				return fmt.Errorf("%w: delta for unknown key %d", ErrInconsistent, key)
			}
			np, nc := le.Uint32(v.numPrompt[4*i:]), le.Uint32(v.numComputed[4*i:])
			if newLen := uint64(len(st.TokenIDs)) + nt; np != 0 || uint64(nc) > newLen {
				return fmt.Errorf("%w: key %d: delta with num_prompt %d, num_computed %d, %d tokens", ErrInconsistent, key, np, nc, newLen)
			}
			st.BlockIDs = appendU32(st.BlockIDs, blocks)
			st.TokenIDs = appendU32(st.TokenIDs, tokens)
			st.NumComputed = nc
			st.Seed = le.Uint64(v.seeds[8*i:])
			st.Step = v.step
		}
		if flags&(FlagFinished|FlagAborted) != 0 {
			delete(s.reqs, key)
		}
	}
	return nil
}
