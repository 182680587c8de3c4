package control

import (
	"errors"
	"fmt"
	"sync"

	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
)

// BackendHostSHM is the Pool.backend of a /dev/shm (or memfd) file.
const BackendHostSHM = "host-shm"

// BackendCUDAVMM is the Pool.backend of a CUDA VMM POSIX-fd handle.
const BackendCUDAVMM = "cuda-vmm"

// ErrBrokerClosed is returned by Put after Close.
var ErrBrokerClosed = errors.New("fd broker closed")

// Broker holds the shared pool fds for the life of the deployment: holding
// an fd keeps the memory alive through the death of every engine that mapped
// it, so a standby can take over a KV cache whose writer is gone.
type Broker struct {
	mu     sync.Mutex
	pools  []*frmpsv1.Pool
	fds    []int
	closed bool
}

// NewBroker returns an empty broker.
func NewBroker() *Broker { return &Broker{} }

// Put hands the pools of an active's PoolExport to the broker. The broker
// takes ownership of fds in every case: on error they are closed. It refuses
// a layout different from the one it holds; the same layout again (a fresh
// active after every engine was lost allocated new memory) replaces the held
// fds, closing the old ones.
func (b *Broker) Put(pools []*frmpsv1.Pool, fds []int) error {
	if err := b.put(pools, fds); err != nil {
		closeDistinct(fds)
		return err
	}
	return nil
}

func (b *Broker) put(pools []*frmpsv1.Pool, fds []int) error {
	if len(pools) != len(fds) {
		return fmt.Errorf("broker put: %d pools but %d fds", len(pools), len(fds))
	}
	if len(pools) == 0 {
		return errors.New("broker put: empty pool layout")
	}
	if err := ValidateLayout(pools); err != nil {
		return fmt.Errorf("broker put: %w", err)
	}
	seen := make(map[int]bool, len(fds))
	for i, fd := range fds {
		if seen[fd] {
			return fmt.Errorf("broker put: fd %d given twice", fd)
		}
		seen[fd] = true
		if err := checkPoolFD(pools[i], fd); err != nil {
			return fmt.Errorf("broker put: pool %d (%s): %w", i, describePool(pools[i]), err)
		}
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return fmt.Errorf("broker put: %w", ErrBrokerClosed)
	}
	if b.pools != nil {
		if err := SameLayout(b.pools, pools); err != nil {
			return fmt.Errorf("broker put: refusing a second, different layout: %w", err)
		}
	}
	old := b.fds
	b.pools = clonePools(pools)
	b.fds = append([]int(nil), fds...)
	closeAll(old)
	return nil
}

// checkPoolFD verifies that fd is open and, for a host-shm pool, that the
// file is at least as large as the pool (mapping past EOF would SIGBUS).
func checkPoolFD(p *frmpsv1.Pool, fd int) error {
	if fd < 0 {
		return fmt.Errorf("invalid fd %d", fd)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return fmt.Errorf("fd %d: %w", fd, err)
	}
	if p.GetBackend() == BackendHostSHM {
		if st.Mode&unix.S_IFMT != unix.S_IFREG {
			return fmt.Errorf("fd %d is not a regular file", fd)
		}
		if uint64(st.Size) < p.GetSize() {
			return fmt.Errorf("fd %d: file is %d bytes, pool is %d", fd, st.Size, p.GetSize())
		}
	}
	return nil
}

// Pools returns a copy of the held layout (nil before the first Put).
func (b *Broker) Pools() []*frmpsv1.Pool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return clonePools(b.pools)
}

// FDs returns the held fds, in pool order. They are borrowed: valid until
// the next Put or Close; do not close them.
func (b *Broker) FDs() []int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([]int(nil), b.fds...)
}

// SleepMessage builds the Sleep command for a standby together with the fds
// to send with it (borrowed, as FDs). ok is false when no layout is held.
func (b *Broker) SleepMessage(id uint64) (env *frmpsv1.Envelope, fds []int, ok bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.pools == nil || b.closed {
		return nil, nil, false
	}
	env = &frmpsv1.Envelope{Id: id, Msg: &frmpsv1.Envelope_Sleep{Sleep: &frmpsv1.Sleep{Pools: clonePools(b.pools)}}}
	return env, append([]int(nil), b.fds...), true
}

// Close closes every held fd. Idempotent; Put fails afterwards.
func (b *Broker) Close() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return nil
	}
	b.closed = true
	err := CloseFDs(b.fds)
	b.fds = nil
	b.pools = nil
	if err != nil {
		return fmt.Errorf("broker close: %w", err)
	}
	return nil
}

func clonePools(pools []*frmpsv1.Pool) []*frmpsv1.Pool {
	if pools == nil {
		return nil
	}
	out := make([]*frmpsv1.Pool, len(pools))
	for i, p := range pools {
		out[i] = proto.Clone(p).(*frmpsv1.Pool)
	}
	return out
}

// closeDistinct closes each distinct non-negative fd once, so a duplicated
// fd number never closes someone else's descriptor.
func closeDistinct(fds []int) {
	seen := make(map[int]bool, len(fds))
	for _, fd := range fds {
		if fd < 0 || seen[fd] {
			continue
		}
		seen[fd] = true
		_ = unix.Close(fd)
	}
}
