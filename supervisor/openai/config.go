package openai

import (
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Config tunes the front door. Zero values take the defaults listed per field.
type Config struct {
	// OnResumedToken, if set, is called once per resumed stream when its first
	// token after a failover reaches the client, with the generation of the
	// engine that produced it. It must not block.
	OnResumedToken func(generation uint64, at time.Time)
	// APIKey, when set, is required as "Authorization: Bearer <key>" on /v1/*.
	// See LoadAPIKey for reading it from a file or an environment variable.
	APIKey string
	// MaxConcurrent bounds requests running against the engine (default 512).
	MaxConcurrent int
	// MaxChoices bounds the choices one request may ask for: n times the
	// prompts of a batch, each an engine request of its own (default 128).
	MaxChoices int
	// MaxQueue bounds requests waiting for a slot; beyond it: 429 (default 1024).
	// Negative means no queue at all.
	MaxQueue int
	// QueueTimeout bounds the wait for a slot; then 429 (default 30s).
	QueueTimeout time.Duration
	// MaxBodyBytes bounds a request body; beyond it: 413 (default 4 MiB).
	MaxBodyBytes int64
	// BodyReadTimeout bounds reading one request body; a client that sends
	// it slower gets 408 and the connection is closed (default 30s).
	BodyReadTimeout time.Duration
	// ReadHeaderTimeout bounds reading a request's headers (HTTPServer;
	// default 10s). A client that sends them slower is disconnected.
	ReadHeaderTimeout time.Duration
	// IdleTimeout closes a keep-alive connection idle between requests for
	// this long (HTTPServer; default 2m).
	IdleTimeout time.Duration
	// MaxConnections bounds the connections open at once (Listener; default
	// 4096, negative: no bound); beyond it new connections wait to be
	// accepted. It keeps the supervisor's own descriptors (engine sockets,
	// pools, the ring) available whatever the clients do.
	MaxConnections int
	// EngineWaitTimeout bounds the wait for a serving engine before a request
	// has started; then 503 with Retry-After (default 30s).
	EngineWaitTimeout time.Duration
	// ResumeTimeout bounds one failover gap as seen by an open request: waiting
	// for the next engine and re-attaching (default 60s). Past it a stream
	// ends with an in-stream error event.
	ResumeTimeout time.Duration
	// MaxResumes bounds the failovers one request rides through (default 8).
	MaxResumes int
	// KeepAliveInterval is the period of SSE comment keep-alives during a
	// failover gap (default 1s).
	KeepAliveInterval time.Duration
	// HealthTimeout bounds /health's Current call when the Backend does not
	// implement ReadinessReporter (default 100ms).
	HealthTimeout time.Duration
	// LivenessTimeout bounds /livez's Alive call (default 1s).
	LivenessTimeout time.Duration
	// AbortTimeout bounds the Abort RPC sent when a client goes away (default 2s).
	AbortTimeout time.Duration
	// FinalWriteTimeout bounds writes once a request's context has ended
	// (client gone, Shutdown past its deadline), so a client that stopped
	// reading cannot hold a handler (default 1s).
	FinalWriteTimeout time.Duration
	// RetryAfter is the Retry-After value in seconds on 429 and 503 (default 1).
	RetryAfter int
	// DefaultMaxTokens is sent when the client gives no max_tokens. 0 sends 0,
	// which the generation API reads as "until the context length".
	DefaultMaxTokens int
	// IdempotencyTTL is how long a finished response stays replayable under its
	// Idempotency-Key (default 10m; negative disables idempotency).
	IdempotencyTTL time.Duration
	// IdempotencyMaxEntries bounds the idempotency cache (default 4096).
	IdempotencyMaxEntries int
	// IdempotencyMaxBytes bounds one recorded response; a bigger one is not
	// kept for replay once finished (default 1 MiB).
	IdempotencyMaxBytes int
	// IdempotencyMaxTotalBytes bounds all finished responses kept for replay;
	// the oldest are evicted first (default 64 MiB).
	IdempotencyMaxTotalBytes int
	// IdempotencyDetachGrace is how long a keyed request keeps generating after
	// its last client went away, so that a retry can attach (default 10s).
	IdempotencyDetachGrace time.Duration
	// Gatherer serves /metrics. Nil: the registerer given to New when it is a
	// prometheus.Gatherer (e.g. *prometheus.Registry), else /metrics is 404.
	Gatherer prometheus.Gatherer
	// Version is reported by /version.
	Version string
	// EnableAutoToolChoice with ToolCallParser: chat's tool_choice "auto" reads
	// tool calls out of the output with that parser, and "required" and named
	// functions are served (vLLM's --enable-auto-tool-choice and
	// --tool-call-parser; without them those are refused with vLLM's 400s).
	EnableAutoToolChoice bool
	// ToolCallParser names the parser: "hermes" (ToolCallParsers), or "" for none.
	ToolCallParser string
}

func (c Config) withDefaults() Config {
	setInt := func(v *int, d int) {
		if *v == 0 {
			*v = d
		}
	}
	setDur := func(v *time.Duration, d time.Duration) {
		if *v == 0 {
			*v = d
		}
	}
	setInt(&c.MaxConcurrent, 512)
	setInt(&c.MaxChoices, 128)
	setInt(&c.MaxQueue, 1024)
	if c.MaxQueue < 0 {
		c.MaxQueue = 0
	}
	setDur(&c.QueueTimeout, 30*time.Second)
	if c.MaxBodyBytes == 0 {
		c.MaxBodyBytes = 4 << 20
	}
	setDur(&c.BodyReadTimeout, 30*time.Second)
	setDur(&c.ReadHeaderTimeout, 10*time.Second)
	setDur(&c.IdleTimeout, 2*time.Minute)
	setInt(&c.MaxConnections, 4096)
	setDur(&c.EngineWaitTimeout, 30*time.Second)
	setDur(&c.ResumeTimeout, 60*time.Second)
	setInt(&c.MaxResumes, 8)
	setDur(&c.KeepAliveInterval, time.Second)
	setDur(&c.HealthTimeout, 100*time.Millisecond)
	setDur(&c.LivenessTimeout, time.Second)
	setDur(&c.AbortTimeout, 2*time.Second)
	setDur(&c.FinalWriteTimeout, time.Second)
	setInt(&c.RetryAfter, 1)
	setDur(&c.IdempotencyTTL, 10*time.Minute)
	setInt(&c.IdempotencyMaxEntries, 4096)
	setInt(&c.IdempotencyMaxBytes, 1<<20)
	setInt(&c.IdempotencyMaxTotalBytes, 64<<20)
	setDur(&c.IdempotencyDetachGrace, 10*time.Second)
	return c
}

func (c Config) validate() error {
	switch {
	case c.MaxConcurrent < 0:
		return errors.New("max concurrent requests must not be negative")
	case c.MaxChoices < 0:
		return errors.New("max choices must not be negative")
	case c.MaxBodyBytes < 0:
		return errors.New("max body bytes must not be negative")
	case c.KeepAliveInterval < 0, c.ResumeTimeout < 0, c.EngineWaitTimeout < 0, c.QueueTimeout < 0,
		c.BodyReadTimeout < 0, c.ReadHeaderTimeout < 0, c.IdleTimeout < 0, c.LivenessTimeout < 0:
		return errors.New("timeouts and intervals must not be negative")
	case c.DefaultMaxTokens < 0:
		return errors.New("default max tokens must not be negative")
	case c.ToolCallParser != "" && !slices.Contains(ToolCallParsers, c.ToolCallParser):
		return fmt.Errorf("tool call parser %q is not implemented; this front door has %s", c.ToolCallParser, strings.Join(ToolCallParsers, ", "))
	case c.EnableAutoToolChoice && c.ToolCallParser == "":
		return errors.New("auto tool choice needs a tool call parser")
	}
	return nil
}

// LoadAPIKey reads the API key from file (when non-empty) or else from the
// environment variable env (when non-empty). Surrounding whitespace is
// trimmed. It returns "" (no key required) when neither is given; an empty or
// unreadable key file is an error, so a misconfiguration never opens the door.
func LoadAPIKey(file, env string) (string, error) {
	if file != "" {
		b, err := os.ReadFile(file)
		if err != nil {
			return "", fmt.Errorf("read api key file: %w", err)
		}
		k := strings.TrimSpace(string(b))
		if k == "" {
			return "", fmt.Errorf("api key file %s is empty", file)
		}
		return k, nil
	}
	if env != "" {
		if k, ok := os.LookupEnv(env); ok {
			k = strings.TrimSpace(k)
			if k == "" {
				return "", fmt.Errorf("api key variable %s is empty", env)
			}
			return k, nil
		}
	}
	return "", nil
}
