package supervisor

// Bindings to the real collaborators: control, ringbuf, mps, deathcause.

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/hashicorp/go-hclog"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
	"github.com/frmps/frmps/ringbuf"
	"github.com/frmps/frmps/supervisor/control"
	"github.com/frmps/frmps/supervisor/deathcause"
	"github.com/frmps/frmps/supervisor/engine"
	"github.com/frmps/frmps/supervisor/mps"
)

func defaultDeps(cfg Config, log hclog.Logger) (Deps, error) {
	if log == nil {
		log = hclog.NewNullLogger()
	}
	adapter, err := engine.NewAdapter(cfg.Engine, cfg.Python)
	if err != nil {
		return Deps{}, err
	}
	launcher := ProcessLauncher{Adapter: adapter, Log: log.Named("engine")}
	var spares SpareLauncher
	if _, ok := adapter.(engine.SpareAdapter); ok {
		spares = launcher
	}
	return Deps{
		Launcher: launcher,
		Spares:   spares,
		Listen: func(path string) (ControlListener, error) {
			l, err := control.Listen(path)
			if err != nil {
				return nil, err
			}
			return controlListener{l}, nil
		},
		ValidateHello: func(h *frmpsv1.Hello, want HelloExpect) error {
			return control.ValidateHello(h, control.HelloExpect{Role: want.Role, PID: want.PID, Model: want.Model, Pools: want.Pools})
		},
		NewBroker: func() Broker { return control.NewBroker() },
		OpenRing:  openRing,
		StartMPS: func(ctx context.Context, runDir string, log hclog.Logger) (MPS, error) {
			if cfg.MPSPipeDir != "" {
				sh, err := mps.Join(ctx, mps.SharedConfig{ControlBinary: cfg.MPSControlBinary, PipeDir: cfg.MPSPipeDir, LogDir: cfg.MPSLogDir}, log)
				if err != nil {
					return nil, err
				}
				return sh, nil
			}
			d, err := mps.Start(ctx, mps.Config{ControlBinary: cfg.MPSControlBinary, RunDir: runDir}, log)
			if err != nil {
				return nil, err
			}
			return d, nil
		},
		OutsideEnv: mps.OutsideEnv,
		CheckComputeMode: func(ctx context.Context, visible string) error {
			err := mps.CheckComputeMode(ctx, cfg.NvidiaSMI, visible)
			if errors.Is(err, mps.ErrComputeModeUnknown) {
				// A GPU without nvidia-smi still serves; only the refusal is lost.
				log.Warn("cannot check the GPU's compute mode; in Exclusive_Process mode the standby will fail to start", "error", err)
				return nil
			}
			return err
		},
		StopLeftoverMPS: func(ctx context.Context, controlBinary, runDir string) error {
			return mps.StopLeftover(ctx, mps.Config{ControlBinary: controlBinary, RunDir: runDir}, log)
		},
		Classify: func(ws syscall.WaitStatus, lines []string, f *frmpsv1.Fault) (string, string) {
			c := deathcause.Classify(ws, lines, f)
			return c.Class, c.Detail
		},
		DialGeneration: DialGenerationUnix,
		PrimeFault: func(ctx context.Context, env []string, device int) (string, error) {
			return primeFault(ctx, cfg.Python, env, device)
		},
		RunWait: runWait,
	}, nil
}

// runWait reads the second field of /proc/<pid>/task/<tid>/schedstat (ns
// spent runnable but not running) of every thread of pid. A thread that
// ends while it is read is skipped.
func runWait(pid int) (map[int]time.Duration, bool) {
	dir := fmt.Sprintf("/proc/%d/task", pid)
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, false
	}
	out := make(map[int]time.Duration, len(ents))
	for _, e := range ents {
		tid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(dir + "/" + e.Name() + "/schedstat")
		if err != nil {
			continue
		}
		f := strings.Fields(string(b))
		if len(f) < 2 {
			return nil, false
		}
		ns, err := strconv.ParseInt(f[1], 10, 64)
		if err != nil {
			return nil, false
		}
		out[tid] = time.Duration(ns)
	}
	return out, len(out) > 0
}

type controlListener struct{ *control.Listener }

func (l controlListener) Accept(ctx context.Context, pid int) (ControlConn, error) {
	c, err := l.Listener.Accept(ctx, pid)
	if err != nil {
		return nil, err
	}
	return c, nil
}

// ringReader pairs the ring reader with its compacted snapshot.
type ringReader struct {
	r    *ringbuf.Reader
	snap *ringbuf.Snapshot
}

func openRing(path string, capacity uint64) (Ring, error) {
	if err := ringbuf.Create(path, capacity); err != nil {
		return nil, fmt.Errorf("create ring: %w", err)
	}
	r, err := ringbuf.OpenReader(path)
	if err != nil {
		_ = os.Remove(path)
		return nil, fmt.Errorf("open ring reader: %w", err)
	}
	return &ringReader{r: r, snap: ringbuf.NewSnapshot()}, nil
}

func (rr *ringReader) Poll() (int, error) { return rr.r.Poll(rr.snap) }
func (rr *ringReader) Lag() uint64        { return rr.r.Lag() }
func (rr *ringReader) Resyncs() uint64    { return rr.r.Resyncs() }
func (rr *ringReader) Len() int           { return rr.snap.Len() }
func (rr *ringReader) Close() error       { return rr.r.Close() }

// Snapshot of one request; none while the snapshot is stale (after a resync,
// before the next FULL record): the engine then recomputes rather than trust it.
func (rr *ringReader) Snapshot(key uint64) (*frmpsv1.RequestSnapshot, bool) {
	if rr.snap.Stale() {
		return nil, false
	}
	st, ok := rr.snap.Get(key)
	if !ok {
		return nil, false
	}
	return &frmpsv1.RequestSnapshot{
		BlockIds: st.BlockIDs, TokenIds: st.TokenIDs, NumPromptTokens: st.NumPrompt,
		NumComputedTokens: st.NumComputed, Seed: st.Seed, Step: st.Step,
	}, true
}

// primeTimeout bounds one prime-fault run (the driver's PTX JIT, joining MPS,
// the fault and the server's teardown take about a second).
const primeTimeout = 60 * time.Second

// primeFault runs `python -m frmps_engine.cli prime-fault --device N` with env
// (vllmpatch/src/frmps_engine/sdk/primefault.py): exit 0 means the fault
// happened. The process is killed at the timeout and always reaped.
func primeFault(ctx context.Context, python string, env []string, device int) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, primeTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, python, "-m", "frmps_engine.cli", "prime-fault", "--device", strconv.Itoa(device))
	cmd.Env = env
	cmd.WaitDelay = 5 * time.Second
	out, err := cmd.CombinedOutput()
	text := strings.TrimSpace(string(out))
	if err != nil {
		return text, fmt.Errorf("prime-fault on device %d: %w", device, err)
	}
	return text, nil
}
