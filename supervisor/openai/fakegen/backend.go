package fakegen

import (
	"context"
	"fmt"
	"sync"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
	"github.com/frmps/frmps/supervisor/openai"
)

// Backend is a TEST DOUBLE of the supervisor's side of the front door: it
// hands out the current engine and lets a test stage a failover.
type Backend struct {
	mu          sync.Mutex
	model       openai.ModelInfo
	aliveErr    error
	client      frmpsv1.GenerationClient
	gen         uint64
	unavailable bool
	changed     chan struct{}
}

var (
	_ openai.Backend          = (*Backend)(nil)
	_ openai.LivenessReporter = (*Backend)(nil)
)

// NewBackend starts with no engine; call Set.
func NewBackend(model openai.ModelInfo) *Backend {
	return &Backend{model: model, changed: make(chan struct{})}
}

func (b *Backend) Model() openai.ModelInfo {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.model
}

// SetMaxModelLen changes the context limit Model reports, as a supervisor
// does once its first engine told it.
func (b *Backend) SetMaxModelLen(n int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.model.MaxModelLen = n
}

// Alive implements openai.LivenessReporter: the error SetAliveErr staged.
func (b *Backend) Alive(context.Context) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.aliveErr
}

// SetAliveErr makes Alive fail with err (nil: alive).
func (b *Backend) SetAliveErr(err error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.aliveErr = err
}

// Current implements openai.Backend.
func (b *Backend) Current(ctx context.Context, minGeneration uint64) (openai.Engine, error) {
	for {
		b.mu.Lock()
		if b.unavailable {
			b.mu.Unlock()
			return openai.Engine{}, fmt.Errorf("fake backend: %w", openai.ErrUnavailable)
		}
		if b.client != nil && b.gen >= minGeneration {
			e := openai.Engine{Client: b.client, Generation: b.gen}
			b.mu.Unlock()
			return e, nil
		}
		ch := b.changed
		b.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			return openai.Engine{}, fmt.Errorf("wait for engine: %w", ctx.Err())
		}
	}
}

// Set makes c the serving engine with the next generation.
func (b *Backend) Set(c frmpsv1.GenerationClient) uint64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.client = c
	b.gen++
	b.wakeLocked()
	return b.gen
}

// Clear leaves no engine serving (a failover in progress): Current blocks.
func (b *Backend) Clear() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.client = nil
	b.wakeLocked()
}

// SetUnavailable makes Current fail fast with ErrUnavailable (degraded).
func (b *Backend) SetUnavailable(v bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.unavailable = v
	b.wakeLocked()
}

func (b *Backend) wakeLocked() {
	close(b.changed)
	b.changed = make(chan struct{})
}
