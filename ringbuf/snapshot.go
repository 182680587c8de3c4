package ringbuf

// RequestState is the compacted forward state of one request.
type RequestState struct {
	Key         uint64
	BlockIDs    []uint32
	TokenIDs    []uint32 // prompt then output
	NumPrompt   uint32
	NumComputed uint32
	Seed        uint64
	Step        uint64 // engine step of the last record that touched the request
}

// Clone returns a deep copy (Get and Range hand out views into the snapshot).
func (s RequestState) Clone() RequestState {
	s.BlockIDs = append([]uint32(nil), s.BlockIDs...)
	s.TokenIDs = append([]uint32(nil), s.TokenIDs...)
	return s
}

// Snapshot is the compacted per-request table the reader maintains. Memory is
// bounded by the live requests: finished and aborted requests are dropped.
// A Snapshot is owned by the goroutine that calls Reader.Poll.
type Snapshot struct {
	reqs    map[uint64]*RequestState
	stale   bool
	lastSeq uint64
	step    uint64
	epoch   uint64
}

// NewSnapshot returns an empty snapshot, stale until the first FULL record.
func NewSnapshot() *Snapshot {
	return &Snapshot{reqs: make(map[uint64]*RequestState), stale: true}
}

// Get returns the state of one request. The slices are views valid until the
// next Poll; Clone them to keep them.
func (s *Snapshot) Get(key uint64) (RequestState, bool) {
	r, ok := s.reqs[key]
	if !ok {
		return RequestState{}, false
	}
	return *r, true
}

// Len is the number of live requests.
func (s *Snapshot) Len() int { return len(s.reqs) }

// Stale reports whether the table may be behind the writer's state: after a
// resync (or before the first FULL record) until a FULL record arrives.
func (s *Snapshot) Stale() bool { return s.stale }

// Seq is the seq of the last record applied (0 if none).
func (s *Snapshot) Seq() uint64 { return s.lastSeq }

// Step is the engine step of the last record applied.
func (s *Snapshot) Step() uint64 { return s.step }

// Epoch is the writer epoch of the last record applied.
func (s *Snapshot) Epoch() uint64 { return s.epoch }

// Range calls fn for every live request (in no particular order) until fn
// returns false. The slices are views valid until the next Poll.
func (s *Snapshot) Range(fn func(RequestState) bool) {
	for _, r := range s.reqs {
		if !fn(*r) {
			return
		}
	}
}
