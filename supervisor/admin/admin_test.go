package admin

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
)

// fakeSource is a test double of the supervisor.
type fakeSource struct {
	mu      sync.Mutex
	drills  []string
	refuse  error
	version string
}

func (f *fakeSource) Status() *frmpsv1.Status {
	return &frmpsv1.Status{State: "serving_ready", Model: "tiny", Version: f.version,
		Engines: []*frmpsv1.EngineStatus{{Role: "active", Pid: 42, State: "serving"}}}
}

func (f *fakeSource) TriggerFailover(_ context.Context, reason string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.refuse != nil {
		return f.refuse
	}
	f.drills = append(f.drills, reason)
	return nil
}

func serve(t *testing.T, src Source) (addr string, stop func()) {
	t.Helper()
	reg := prometheus.NewRegistry()
	c := prometheus.NewCounter(prometheus.CounterOpts{Name: "frmps_test_total", Help: "x"})
	reg.MustRegister(c)
	s, err := New(Config{Addr: "127.0.0.1:0", Gatherer: reg}, src, nil)
	if err != nil {
		t.Fatal(err)
	}
	l, err := s.Listen()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Serve(ctx, l) }()
	return l.Addr().String(), func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Serve: %v", err)
		}
	}
}

func TestGRPCAndRESTOnOneListener(t *testing.T) {
	defer goleak.VerifyNone(t)
	src := &fakeSource{version: "v9"}
	addr, stop := serve(t, src)
	defer stop()

	cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	ctx := context.Background()
	st, err := frmpsv1.NewAdminClient(cc).GetStatus(ctx, &frmpsv1.GetStatusRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if st.GetState() != "serving_ready" || st.GetVersion() != "v9" || st.GetEngines()[0].GetPid() != 42 {
		t.Fatalf("status %v", st)
	}
	resp, err := frmpsv1.NewAdminClient(cc).TriggerFailover(ctx, &frmpsv1.TriggerFailoverRequest{Reason: "grpc drill"})
	if err != nil || !resp.GetAccepted() {
		t.Fatalf("drill: %v %v", resp, err)
	}
	h, err := healthpb.NewHealthClient(cc).Check(ctx, &healthpb.HealthCheckRequest{})
	if err != nil || h.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("health %v %v", h, err)
	}

	r, err := http.Get("http://" + addr + "/v1/admin/status")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(r.Body)
	r.Body.Close()
	var js map[string]any
	if err := json.Unmarshal(body, &js); err != nil || js["state"] != "serving_ready" || js["model"] != "tiny" {
		t.Fatalf("REST status %d %s", r.StatusCode, body)
	}
	r, err = http.Post("http://"+addr+"/v1/admin/failover", "application/json", strings.NewReader(`{"reason":"rest drill"}`))
	if err != nil {
		t.Fatal(err)
	}
	body, _ = io.ReadAll(r.Body)
	r.Body.Close()
	if r.StatusCode != 200 || !strings.Contains(string(body), `"accepted":true`) {
		t.Fatalf("REST failover %d %s", r.StatusCode, body)
	}
	src.mu.Lock()
	if strings.Join(src.drills, ",") != "grpc drill,rest drill" {
		t.Fatalf("drills %v", src.drills)
	}
	src.refuse = errors.New("no standby ready")
	src.mu.Unlock()
	resp, err = frmpsv1.NewAdminClient(cc).TriggerFailover(ctx, &frmpsv1.TriggerFailoverRequest{})
	if err != nil || resp.GetAccepted() || resp.GetError() != "no standby ready" {
		t.Fatalf("refused drill: %v %v", resp, err)
	}
	if _, err := frmpsv1.NewAdminClient(cc).TriggerFailover(ctx, &frmpsv1.TriggerFailoverRequest{Reason: strings.Repeat("x", 300)}); err == nil {
		t.Fatal("overlong reason accepted")
	}

	r, err = http.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ = io.ReadAll(r.Body)
	r.Body.Close()
	if !strings.Contains(string(body), "frmps_test_total 0") {
		t.Fatalf("metrics: %s", body)
	}
	http.DefaultClient.CloseIdleConnections()
}

func TestCheckAddr(t *testing.T) {
	for _, tc := range []struct {
		addr  string
		allow bool
		ok    bool
	}{
		{"127.0.0.1:8001", false, true},
		{"[::1]:8001", false, true},
		{"localhost:8001", false, true},
		{"0.0.0.0:8001", false, false},
		{":8001", false, false},
		{"10.1.2.3:8001", false, false},
		{"10.1.2.3:8001", true, true},
		{"nonsense", true, false},
	} {
		if err := CheckAddr(tc.addr, tc.allow); (err == nil) != tc.ok {
			t.Errorf("CheckAddr(%q, %v) = %v", tc.addr, tc.allow, err)
		}
	}
	if _, err := New(Config{Addr: "0.0.0.0:1"}, &fakeSource{}, nil); err == nil {
		t.Error("New accepted a public address")
	}
	if _, err := New(Config{}, nil, nil); err == nil {
		t.Error("New accepted a nil source")
	}
}
