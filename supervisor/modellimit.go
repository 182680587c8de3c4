package supervisor

import (
	"context"
	"sync/atomic"
	"time"

	"github.com/hashicorp/go-hclog"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
)

// modelLimit is the served model's context limit: --max-model-len when
// given, else what an engine reported through its Health call (0 until one
// did). Safe from any goroutine.
type modelLimit struct {
	configured int
	learned    atomic.Uint32
}

// get is the limit Model reports (0: not known yet).
func (m *modelLimit) get() int {
	if m.configured > 0 {
		return m.configured
	}
	return int(m.learned.Load())
}

// known: the limit was given or an engine reported it; nobody need ask.
func (m *modelLimit) known() bool { return m.configured > 0 || m.learned.Load() != 0 }

// modelLimitTimeout bounds the Health call that asks an engine for its limit.
const modelLimitTimeout = 10 * time.Second

// learn asks an engine's generation API for its context limit (best effort:
// a failure is logged and the limit stays unknown).
func (m *modelLimit) learn(ctx context.Context, c frmpsv1.GenerationClient, log hclog.Logger) {
	hctx, cancel := context.WithTimeout(ctx, modelLimitTimeout)
	defer cancel()
	h, err := c.Health(hctx, &frmpsv1.HealthRequest{})
	if err != nil {
		log.Warn("engine did not report its context limit", "error", err)
		return
	}
	m.learned.Store(h.GetMaxModelLen())
}
