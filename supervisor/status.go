package supervisor

import (
	"strings"

	"github.com/prometheus/procfs"
	"google.golang.org/protobuf/proto"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
	"github.com/frmps/frmps/supervisor/buildinfo"
	"github.com/frmps/frmps/supervisor/failover"
)

// Status is the deployment's state for the admin API. Safe to call any time.
func (s *Supervisor) Status() *frmpsv1.Status {
	s.mu.Lock()
	st := &frmpsv1.Status{
		State: s.state.String(), StateCause: s.stateCause, Model: s.cfg.Model, Engine: s.cfg.Engine,
		SyncEvery: s.cfg.SyncEvery, Mps: !s.cfg.NoMPS, MpsState: s.mps.shownState(),
		RingLagRecords: s.ring.lag.Load(), RingResyncs: s.ring.resyncs.Load(),
		Version:            buildinfo.Get().Version,
		CrashLoopOpen:      s.state == failover.CrashLoop,
		TensorParallelSize: uint32(s.cfg.TensorParallelSize),
	}
	if s.cfg.Resolved != nil {
		st.Resolved = proto.Clone(s.cfg.Resolved).(*frmpsv1.Resolved)
	}
	s.mu.Unlock()
	if recs := s.failovers.shownRecords(); len(recs) > 0 {
		st.Failovers = recs
	}
	st.Failback = s.failback.shown()
	var sparePIDs []int
	st.Spare, sparePIDs = s.spares.shown()
	if st.Spare != nil {
		st.Spare.RssBytes = residentBytes(sparePIDs)
	}
	st.CrashLoopOpen = st.CrashLoopOpen || s.crashLoopOpen.Load()
	for _, sl := range s.pair.shownSlots() {
		died := s.pair.lastDeathCause(sl)
		sl.mu.Lock()
		if sl.deathCause != "" {
			died = sl.deathCause
		}
		es := &frmpsv1.EngineStatus{Role: sl.role.String(), Pid: int32(sl.proc.PID()), State: sl.state, InMps: sl.inMPS,
			Restarts: sl.restartNo, StartedUnixNanos: sl.started.UnixNano(), LastDeathCause: died, LogPath: sl.proc.LogPath(),
			InitSeconds: sl.initTook.Seconds(), Steps: sl.beats.step, Running: sl.beats.running, Waiting: sl.waiting,
			FromSpare: sl.fromSpare}
		if h := sl.hello; h != nil {
			es.Engine = strings.TrimSpace(h.GetEngine() + " " + h.GetEngineVersion())
			es.Device, es.BlockSize, es.NumBlocks = h.GetDevice(), h.GetBlockSize(), h.GetNumBlocks()
			es.KvBudget = h.GetKvBudget()
			es.Weights = h.GetWeights()
		}
		sl.mu.Unlock()
		st.Engines = append(st.Engines, es)
	}
	if n := s.ring.size(); n >= 0 {
		st.LiveRequests = uint32(n)
	}
	if fs, ok := s.frontDoor.(FrontendStatuser); ok {
		st.Frontend = fs.FrontendStatus()
	}
	return st
}

// residentBytes sums the resident memory of the processes (procfs, as the
// Prometheus process collector reads it); a process that is gone, or no /proc,
// counts 0.
func residentBytes(pids []int) uint64 {
	var total uint64
	for _, pid := range pids {
		p, err := procfs.NewProc(pid)
		if err != nil {
			continue
		}
		st, err := p.Stat()
		if err != nil {
			continue
		}
		total += uint64(max(st.ResidentMemory(), 0))
	}
	return total
}
