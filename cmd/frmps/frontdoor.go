package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"

	"github.com/hashicorp/go-hclog"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/frmps/frmps/supervisor"
	"github.com/frmps/frmps/supervisor/buildinfo"
	"github.com/frmps/frmps/supervisor/openai"
)

// backend adapts the supervisor to the front door's Backend.
type backend struct{ s *supervisor.Supervisor }

var (
	_ openai.Backend           = backend{}
	_ openai.ReadinessReporter = backend{}
	_ openai.LivenessReporter  = backend{}
)

func (b backend) Current(ctx context.Context, minGeneration uint64) (openai.Engine, error) {
	c, gen, err := b.s.Current(ctx, minGeneration)
	if err != nil {
		if errors.Is(err, supervisor.ErrUnavailable) {
			return openai.Engine{}, fmt.Errorf("%w: %w", openai.ErrUnavailable, err)
		}
		return openai.Engine{}, err
	}
	return openai.Engine{Client: c, Generation: gen}, nil
}

func (b backend) Model() openai.ModelInfo {
	name, maxLen := b.s.Model()
	return openai.ModelInfo{Name: name, MaxModelLen: maxLen}
}

func (b backend) Serving() bool { return b.s.Serving() }

func (b backend) Alive(ctx context.Context) error { return b.s.Alive(ctx) }

type openaiDoor struct {
	*openai.Server
	http *http.Server
}

func newFrontDoor(o serveOptions, sup *supervisor.Supervisor, log hclog.Logger, reg prometheus.Registerer) (frontDoor, error) {
	key, err := openai.LoadAPIKey(o.APIKeyFile, "FRMPS_API_KEY")
	if err != nil {
		return nil, err
	}
	gath, _ := reg.(prometheus.Gatherer)
	srv, err := openai.New(openai.Config{
		APIKey: key, Gatherer: gath, Version: buildinfo.Get().Version, OnResumedToken: sup.NoteResumedToken,
		MaxConcurrent: o.MaxConcurrent, MaxChoices: o.MaxChoices, MaxQueue: o.MaxQueue, MaxBodyBytes: o.MaxBodyBytes, MaxConnections: o.MaxConnections,
		EnableAutoToolChoice: o.EnableAutoToolChoice, ToolCallParser: o.ToolCallParser,
	}, backend{sup}, log, reg)
	if err != nil {
		return nil, fmt.Errorf("OpenAI front door: %w", err)
	}
	return &openaiDoor{Server: srv, http: srv.HTTPServer()}, nil
}

func (d *openaiDoor) Serve(l net.Listener) error {
	if err := d.http.Serve(d.Server.Listener(l)); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("OpenAI endpoint: %w", err)
	}
	return nil
}

// Shutdown drains the open requests, then closes the listener.
func (d *openaiDoor) Shutdown(ctx context.Context) error {
	err := d.Server.Shutdown(ctx)
	if herr := d.http.Shutdown(ctx); herr != nil && err == nil {
		err = herr
	}
	return err
}
