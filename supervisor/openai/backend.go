// Package openai is frmps's OpenAI-compatible front door: /v1/chat/completions,
// /v1/completions, /v1/models, /health, /livez, /readyz, /version and /metrics, served over the
// generation API of whichever engine is active. It remembers, per open request,
// every token it has delivered, so a stream survives an engine failover with no
// token lost or repeated.
package openai

import (
	"context"
	"errors"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
)

// Backend is implemented by the supervisor; the front door only consumes it.
type Backend interface {
	// Current blocks until an engine is serving (or ctx ends) and returns it.
	// Generation increments on every failover. ErrUnavailable (wrapped) when no
	// engine can serve now (degraded, crash-loop, stopped).
	Current(ctx context.Context, minGeneration uint64) (Engine, error)
	// Model is read once at New for the name, and per request for
	// MaxModelLen (0 while unknown), which may be learned later.
	Model() ModelInfo
}

// ReadinessReporter is optional: a Backend that implements it answers /health
// without blocking. Without it /health asks Current with Config.HealthTimeout.
type ReadinessReporter interface {
	// Serving reports whether an engine can take a request right now.
	Serving() bool
}

// LivenessReporter is optional: a Backend that implements it answers /livez.
// Without it /livez reports only that the HTTP server answers.
type LivenessReporter interface {
	// Alive returns nil when the backend's control loop answers before ctx ends.
	Alive(ctx context.Context) error
}

// Engine is one serving engine as seen through its generation API.
type Engine struct {
	Client     frmpsv1.GenerationClient
	Generation uint64
}

// ModelInfo describes the served model.
type ModelInfo struct {
	Name        string
	MaxModelLen int
}

// ErrUnavailable is returned (wrapped) by Backend.Current when no engine can serve.
var ErrUnavailable = errors.New("no engine can serve")
