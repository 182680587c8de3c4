package supervisor

import (
	"testing"
	"testing/synctest"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
	"github.com/frmps/frmps/supervisor/engine"
	"github.com/frmps/frmps/supervisor/failover"
)

// An engine launched without --num-blocks that sizes its own KV cache (the vLLM
// adapter) reports its count in its Hello: the first active's count reaches the
// command line of every engine launched after it (its standby, the standby
// after a failover), so all map the same pool layout. Every engine here would
// size a different count if asked, so only the pin makes them agree.
func TestNumBlocksChosenByTheActiveReachEveryLaterEngine(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		w := newWorld()
		budget := &frmpsv1.KVBudget{NumBlocks: 4321, BlockBytes: 1 << 20, KvBytes: 4321 << 20, Source: "estimated",
			Utilization: 0.9, GpuTotalBytes: 100 << 30, BudgetBytes: 90 << 30, Reserved: map[string]uint64{"mps": 1 << 29}}
		w.behave = func(role failover.Role, nth int) behavior {
			if role == failover.Active && nth == 0 {
				return behavior{sizedBlocks: 4321, kvBudget: budget}
			}
			return behavior{sizedBlocks: uint64(900 + nth)}
		}
		h := start(t, w, func(c *Config) { c.NoFailback = true; c.GPUMemoryUtilization = 0.8 })
		h.wantState(failover.ServingReady)
		act, sb := w.liveRole(failover.Active), w.liveRole(failover.Standby)
		if act.inv.NumBlocks != 0 {
			t.Fatalf("the first active was launched with --num-blocks %d, want none (it sizes its cache)", act.inv.NumBlocks)
		}
		if sb.inv.NumBlocks != 4321 {
			t.Fatalf("the standby was launched with --num-blocks %d, want the active's 4321", sb.inv.NumBlocks)
		}
		for _, p := range []*fakeProc{act, sb} {
			if p.inv.GPUMemoryUtilization != 0.8 {
				t.Fatalf("%s launched with --gpu-memory-utilization %v, want 0.8", p.role, p.inv.GPUMemoryUtilization)
			}
		}
		_, args, err := engine.PythonCLI{Engine: "vllm"}.Command(sb.inv)
		if err != nil || !containsPair(args, "--num-blocks", "4321") || !containsPair(args, "--gpu-memory-utilization", "0.8") {
			t.Fatalf("standby command line %v (%v)", args, err)
		}
		var got *frmpsv1.KVBudget
		for _, e := range h.s.Status().GetEngines() {
			if e.GetRole() == "active" {
				got = e.GetKvBudget()
			}
		}
		if got.GetNumBlocks() != 4321 || got.GetSource() != "estimated" || got.GetReserved()["mps"] != 1<<29 {
			t.Fatalf("status shows the active's budget as %v", got)
		}
		act.Kill()
		synctest.Wait()
		h.wantState(failover.ServingReady)
		fresh := w.liveRole(failover.Standby)
		if fresh == nil || fresh == sb || fresh.inv.NumBlocks != 4321 {
			t.Fatalf("the standby after the failover: %+v", fresh)
		}
		h.stop()
	})
}

// A count given in the configuration is every engine's; an engine's own report
// does not replace it.
func TestGivenNumBlocksStay(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		w := newWorld()
		h := start(t, w, func(c *Config) { c.NumBlocks = 100 })
		h.wantState(failover.ServingReady)
		for _, r := range []failover.Role{failover.Active, failover.Standby} {
			if p := w.liveRole(r); p.inv.NumBlocks != 100 {
				t.Fatalf("%s launched with --num-blocks %d, want 100", r, p.inv.NumBlocks)
			}
		}
		h.stop()
	})
}

func containsPair(args []string, flag, value string) bool {
	for i := 0; i+1 < len(args); i++ {
		if args[i] == flag && args[i+1] == value {
			return true
		}
	}
	return false
}
