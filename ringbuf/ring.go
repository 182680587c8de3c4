package ringbuf

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"math/bits"
	"os"
	"sync/atomic"
	"unsafe"

	"github.com/edsrzf/mmap-go"
)

// Errors. Callers test them with errors.Is; returned errors wrap them with detail.
var (
	ErrBadMagic = errors.New("ring: bad magic")
	ErrVersion  = errors.New("ring: unsupported version")
	ErrCapacity = errors.New("ring: bad capacity")
	ErrCorrupt  = errors.New("ring: corrupt record")
	// ErrOverrun: the writer lapped the reader; the data it wanted is gone.
	ErrOverrun = errors.New("ring: reader overrun")
	// ErrInconsistent: a well-formed record that does not fit the snapshot
	// (e.g. a delta for an unknown request, or a new epoch starting with a delta).
	ErrInconsistent = errors.New("ring: inconsistent record")
	// ErrResync wraps every error after which the reader has requested a resync.
	// It is not fatal: keep polling; the snapshot is stale until a FULL record.
	ErrResync = errors.New("resync requested")
	// ErrTooLarge: a record would exceed capacity/2.
	ErrTooLarge = errors.New("ring: record too large")
	// ErrNotFull: a writer's first record after attaching must be FULL.
	ErrNotFull = errors.New("ring: first record after attach must be FULL")
	ErrClosed  = errors.New("ring: closed")
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// recordCRC computes the CRC-32C of header bytes [0,28) followed by the payload.
func recordCRC(hdr []byte, payload []byte) uint32 {
	c := crc32.Update(0, castagnoli, hdr[:recCRCHeaderBytes])
	return crc32.Update(c, castagnoli, payload)
}

// Create makes a new ring file (O_EXCL, mode 0600) of HeaderSize+capacity bytes
// with an initialised header.
func Create(path string, capacity uint64) (retErr error) {
	if err := CheckCapacity(capacity); err != nil {
		return fmt.Errorf("create ring: %w", err)
	}
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return fmt.Errorf("create ring: %w", err)
	}
	defer func() {
		if cerr := f.Close(); cerr != nil && retErr == nil {
			retErr = fmt.Errorf("create ring: %w", cerr)
		}
		if retErr != nil {
			_ = os.Remove(path)
		}
	}()
	if err := f.Truncate(int64(HeaderSize + capacity)); err != nil {
		return fmt.Errorf("create ring: %w", err)
	}
	hdr := make([]byte, HeaderSize)
	initHeader(hdr, capacity)
	if _, err := f.WriteAt(hdr, 0); err != nil {
		return fmt.Errorf("create ring: %w", err)
	}
	return nil
}

func initHeader(hdr []byte, capacity uint64) {
	copy(hdr[offMagic:], Magic)
	binary.LittleEndian.PutUint32(hdr[offVersion:], Version)
	binary.LittleEndian.PutUint32(hdr[offHeaderSize:], HeaderSize)
	binary.LittleEndian.PutUint64(hdr[offCapacity:], capacity)
}

// CheckCapacity is the one rule for a ring's capacity (the bytes of the data
// region): a power of two in [MinCapacity, MaxCapacity] (FORMAT.md). Create
// and every open of a ring file apply it, and the supervisor checks its
// configuration against it before anything starts.
func CheckCapacity(capacity uint64) error {
	if capacity < MinCapacity || capacity > MaxCapacity || bits.OnesCount64(capacity) != 1 {
		return fmt.Errorf("%w: %d is not a power of two in [%d, %d]", ErrCapacity, capacity, uint64(MinCapacity), uint64(MaxCapacity))
	}
	return nil
}

// CapacityFor is the smallest capacity whose records hold a payload of
// recordBytes: a writer keeps each record within a quarter of the ring (FORMAT.md;
// the Python tracker's rule, ring/layout.py ring_capacity_needed), header
// included. It may exceed MaxCapacity for an impossible record; the caller caps it.
func CapacityFor(recordBytes uint64) uint64 {
	need := 4 * (recordBytes + 64)
	if need <= MinCapacity {
		return MinCapacity
	}
	return 1 << bits.Len64(need-1)
}

// validateHeader checks a mapped (or copied) file against the format and
// returns the capacity. size is the file size.
func validateHeader(mem []byte, size int64) (uint64, error) {
	if len(mem) < HeaderSize || size < HeaderSize {
		return 0, fmt.Errorf("%w: file of %d bytes is smaller than the %d-byte header", ErrBadMagic, size, HeaderSize)
	}
	if string(mem[offMagic:offMagic+8]) != Magic {
		return 0, fmt.Errorf("%w: %q", ErrBadMagic, mem[offMagic:offMagic+8])
	}
	if v := binary.LittleEndian.Uint32(mem[offVersion:]); v != Version {
		return 0, fmt.Errorf("%w: %d (want %d)", ErrVersion, v, Version)
	}
	if hs := binary.LittleEndian.Uint32(mem[offHeaderSize:]); hs != HeaderSize {
		return 0, fmt.Errorf("%w: header_size %d (want %d)", ErrVersion, hs, HeaderSize)
	}
	capacity := binary.LittleEndian.Uint64(mem[offCapacity:])
	if err := CheckCapacity(capacity); err != nil {
		return 0, err
	}
	if uint64(size) != HeaderSize+capacity {
		return 0, fmt.Errorf("%w: capacity %d does not match file size %d", ErrCapacity, capacity, size)
	}
	return capacity, nil
}

// region is a mapped ring file (or, in tests and fuzzing, an aligned byte slice).
type region struct {
	mem      []byte
	data     []byte
	capacity uint64
	mm       mmap.MMap
	f        *os.File
}

// word returns the 8-byte header field at off for atomic access. The mapping is
// page aligned and every cursor offset is a multiple of 8.
func (r *region) word(off int) *uint64 { return (*uint64)(unsafe.Pointer(&r.mem[off])) }

func (r *region) load(off int) uint64     { return atomic.LoadUint64(r.word(off)) }
func (r *region) store(off int, v uint64) { atomic.StoreUint64(r.word(off), v) }

func mapFile(path, op string) (_ *region, retErr error) {
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", op, err)
	}
	defer func() {
		if retErr != nil {
			_ = f.Close()
		}
	}()
	st, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("%s: %w", op, err)
	}
	var hdr [HeaderSize]byte
	if st.Size() >= HeaderSize {
		if _, err := f.ReadAt(hdr[:], 0); err != nil {
			return nil, fmt.Errorf("%s: %w", op, err)
		}
	}
	capacity, err := validateHeader(hdr[:], st.Size())
	if err != nil {
		return nil, fmt.Errorf("%s: %w", op, err)
	}
	if uint64(int(HeaderSize+capacity)) != HeaderSize+capacity {
		return nil, fmt.Errorf("%s: %w: too large for this platform", op, ErrCapacity)
	}
	mm, err := mmap.MapRegion(f, int(HeaderSize+capacity), mmap.RDWR, 0, 0)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", op, err)
	}
	// Re-validate the mapped bytes: the file may have changed between read and map.
	if _, err := validateHeader(mm, st.Size()); err != nil {
		_ = mm.Unmap()
		return nil, fmt.Errorf("%s: %w", op, err)
	}
	return &region{mem: mm, data: mm[HeaderSize:], capacity: capacity, mm: mm, f: f}, nil
}

func (r *region) close() error {
	var errs []error
	if r.mm != nil {
		errs = append(errs, r.mm.Unmap())
		r.mm = nil
	}
	if r.f != nil {
		errs = append(errs, r.f.Close())
		r.f = nil
	}
	r.mem, r.data = nil, nil
	return errors.Join(errs...)
}
