// Package admin serves the supervisor's admin API: the gRPC Admin service,
// the same over REST through grpc-gateway (GET /v1/admin/status, POST
// /v1/admin/failover), gRPC health, and /metrics — all on one listener,
// loopback only unless explicitly allowed.
package admin

import (
	"context"
	"errors"
	"fmt"
	"google.golang.org/protobuf/encoding/protojson"
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/grpc-ecosystem/grpc-gateway/v2/runtime"
	"github.com/hashicorp/go-hclog"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
)

// Source is what the admin API exposes; *supervisor.Supervisor implements it.
type Source interface {
	Status() *frmpsv1.Status
	TriggerFailover(ctx context.Context, reason string) error
}

// Config of the admin server.
type Config struct {
	Addr string // host:port; default 127.0.0.1:8001
	// AllowNonLoopback permits binding a non-loopback address. The admin
	// API can kill engines: exposing it is a deliberate choice.
	AllowNonLoopback bool
	// Gatherer for /metrics; nil serves no /metrics.
	Gatherer prometheus.Gatherer
}

// Server is the admin API.
type Server struct {
	frmpsv1.UnimplementedAdminServer
	cfg    Config
	src    Source
	log    hclog.Logger
	grpc   *grpc.Server
	health *health.Server
	http   *http.Server
}

// New builds the server; Serve starts it.
func New(cfg Config, src Source, log hclog.Logger) (*Server, error) {
	if cfg.Addr == "" {
		cfg.Addr = "127.0.0.1:8001"
	}
	if err := CheckAddr(cfg.Addr, cfg.AllowNonLoopback); err != nil {
		return nil, err
	}
	if src == nil {
		return nil, errors.New("admin: nil source")
	}
	if log == nil {
		log = hclog.NewNullLogger()
	}
	s := &Server{cfg: cfg, src: src, log: log, grpc: grpc.NewServer(), health: health.NewServer()}
	frmpsv1.RegisterAdminServer(s.grpc, s)
	healthpb.RegisterHealthServer(s.grpc, s.health)

	// snake_case field names, as in the .proto and in `frmps status --json`,
	// and every field present, so scripts need no defaults for zero values.
	gw := runtime.NewServeMux(runtime.WithMarshalerOption(runtime.MIMEWildcard, &runtime.JSONPb{
		MarshalOptions: protojson.MarshalOptions{UseProtoNames: true, EmitUnpopulated: true},
	}))
	if err := frmpsv1.RegisterAdminHandlerServer(context.Background(), gw, s); err != nil {
		return nil, fmt.Errorf("register admin gateway: %w", err)
	}
	mux := http.NewServeMux()
	mux.Handle("/v1/", gw)
	if cfg.Gatherer != nil {
		mux.Handle("/metrics", promhttp.HandlerFor(cfg.Gatherer, promhttp.HandlerOpts{}))
	}
	// One listener: gRPC (HTTP/2, prior knowledge) and REST (HTTP/1.1 or 2).
	root := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.ProtoMajor == 2 && strings.HasPrefix(r.Header.Get("Content-Type"), "application/grpc") {
			s.grpc.ServeHTTP(w, r)
			return
		}
		mux.ServeHTTP(w, r)
	})
	var protocols http.Protocols
	protocols.SetHTTP1(true)
	protocols.SetUnencryptedHTTP2(true)
	s.http = &http.Server{Handler: root, Protocols: &protocols, ReadHeaderTimeout: 10 * time.Second}
	return s, nil
}

// CheckAddr refuses a non-loopback admin address unless allowed.
func CheckAddr(addr string, allowNonLoopback bool) error {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("admin address %q: %w", addr, err)
	}
	if allowNonLoopback {
		return nil
	}
	if host == "localhost" {
		return nil
	}
	ip := net.ParseIP(host)
	if ip == nil || !ip.IsLoopback() {
		return fmt.Errorf("admin address %q is not loopback; the admin API can kill engines, pass --admin-allow-remote to expose it", addr)
	}
	return nil
}

// Listen binds the configured address.
func (s *Server) Listen() (net.Listener, error) {
	l, err := net.Listen("tcp", s.cfg.Addr)
	if err != nil {
		return nil, fmt.Errorf("admin listen: %w", err)
	}
	return l, nil
}

// Serve serves on l until ctx ends, then shuts down gracefully.
func (s *Server) Serve(ctx context.Context, l net.Listener) error {
	s.health.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
	s.health.SetServingStatus("frmps.v1.Admin", healthpb.HealthCheckResponse_SERVING)
	errc := make(chan error, 1)
	go func() { errc <- s.http.Serve(l) }()
	select {
	case err := <-errc:
		return fmt.Errorf("admin serve: %w", err)
	case <-ctx.Done():
	}
	s.health.Shutdown()
	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	err := s.http.Shutdown(sctx)
	s.grpc.Stop() // streams handed over by ServeHTTP are not tracked by http.Server
	<-errc
	if err != nil {
		return fmt.Errorf("admin shutdown: %w", err)
	}
	return nil
}

// GetStatus implements frmpsv1.AdminServer.
func (s *Server) GetStatus(context.Context, *frmpsv1.GetStatusRequest) (*frmpsv1.Status, error) {
	return s.src.Status(), nil
}

// TriggerFailover implements frmpsv1.AdminServer: a failover drill.
func (s *Server) TriggerFailover(ctx context.Context, req *frmpsv1.TriggerFailoverRequest) (*frmpsv1.TriggerFailoverResponse, error) {
	if len(req.GetReason()) > 256 {
		return nil, status.Error(codes.InvalidArgument, "reason longer than 256 bytes")
	}
	if err := s.src.TriggerFailover(ctx, req.GetReason()); err != nil {
		s.log.Info("failover drill refused", "error", err)
		return &frmpsv1.TriggerFailoverResponse{Accepted: false, Error: err.Error()}, nil
	}
	s.log.Info("failover drill accepted", "reason", req.GetReason())
	return &frmpsv1.TriggerFailoverResponse{Accepted: true}, nil
}
