package openai_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/goleak"

	"github.com/frmps/frmps/internal/testenv"
	"github.com/frmps/frmps/supervisor/openai"
	"github.com/frmps/frmps/supervisor/openai/fakegen"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const modelName = "test-model"

// harness wires the front door to fake engines (test doubles) over unix sockets.
type harness struct {
	t       *testing.T
	dir     string
	backend *fakegen.Backend
	fd      *openai.Server
	reg     *prometheus.Registry
	srv     *httptest.Server
	tr      *http.Transport
	client  *http.Client
	ecfg    fakegen.Config
	engines []*fakegen.Engine
	logs    testenv.LogBuffer // the front door's log
}

// newHarness serves the front door over real TCP with the http.Server and
// listener it is deployed with (Server.HTTPServer, Server.Listener); tune,
// if given, adjusts that http.Server before it starts.
func newHarness(t *testing.T, cfg openai.Config, ecfg fakegen.Config, tune ...func(*http.Server)) (*harness, *fakegen.Engine) {
	t.Helper()
	return newHarnessWrapped(t, cfg, ecfg, nil, tune...)
}

// newHarnessWrapped is newHarness whose server accepts through
// wrap(the front door's listener) when wrap is not nil.
func newHarnessWrapped(t *testing.T, cfg openai.Config, ecfg fakegen.Config, wrap func(net.Listener) net.Listener, tune ...func(*http.Server)) (*harness, *fakegen.Engine) {
	t.Helper()
	// Short path: unix socket paths are limited to 108 bytes.
	dir, err := os.MkdirTemp("", "fd")
	if err != nil {
		t.Fatal(err)
	}
	if ecfg.Model == "" {
		ecfg.Model = modelName
	}
	if ecfg.MaxModelLen == 0 {
		ecfg.MaxModelLen = 64
	}
	h := &harness{t: t, dir: dir, ecfg: ecfg, reg: prometheus.NewRegistry()}
	h.backend = fakegen.NewBackend(openai.ModelInfo{Name: ecfg.Model, MaxModelLen: ecfg.MaxModelLen})
	eng := h.addEngine(ecfg)
	h.backend.Set(eng.Client())
	h.fd, err = openai.New(cfg, h.backend, hclog.New(&hclog.LoggerOptions{Output: &h.logs, Level: hclog.Info}), h.reg)
	if err != nil {
		t.Fatal(err)
	}
	h.srv = httptest.NewUnstartedServer(nil)
	h.srv.Config = h.fd.HTTPServer()
	for _, f := range tune {
		f(h.srv.Config)
	}
	h.srv.Listener = h.fd.Listener(h.srv.Listener)
	if wrap != nil {
		h.srv.Listener = wrap(h.srv.Listener)
	}
	h.srv.Start()
	h.tr = &http.Transport{}
	h.client = &http.Client{Transport: h.tr, Timeout: 20 * time.Second}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := h.fd.Shutdown(ctx); err != nil {
			t.Errorf("shutdown: %v", err)
		}
		h.tr.CloseIdleConnections()
		h.srv.Close()
		for _, e := range h.engines {
			e.Close()
		}
		os.RemoveAll(dir)
	})
	return h, eng
}

func (h *harness) addEngine(cfg fakegen.Config) *fakegen.Engine {
	h.t.Helper()
	if cfg.Model == "" {
		cfg.Model = modelName
	}
	if cfg.MaxModelLen == 0 {
		cfg.MaxModelLen = 64
	}
	e, err := fakegen.Start(filepath.Join(h.dir, fmt.Sprintf("e%d.sock", len(h.engines))), cfg)
	if err != nil {
		h.t.Fatal(err)
	}
	h.engines = append(h.engines, e)
	return e
}

func (h *harness) do(ctx context.Context, method, path, body string, hdr ...string) *http.Response {
	h.t.Helper()
	req, err := http.NewRequestWithContext(ctx, method, h.srv.URL+path, strings.NewReader(body))
	if err != nil {
		h.t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := h.client.Do(req)
	if err != nil {
		h.t.Fatal(err)
	}
	return resp
}

func (h *harness) post(path, body string, hdr ...string) *http.Response {
	h.t.Helper()
	return h.do(context.Background(), http.MethodPost, path, body, hdr...)
}

// readJSON reads a whole JSON body into a generic map.
func readJSON(t *testing.T, resp *http.Response) map[string]any {
	t.Helper()
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatalf("body is not a JSON object: %v: %q", err, b)
	}
	return m
}

// stream is a parsed SSE response.
type stream struct {
	events     []map[string]any // data payloads, in order, [DONE] excluded
	raw        []string
	keepAlives int
	done       bool // saw data: [DONE]
}

// readStream parses an SSE body. onLine, if set, sees every line as it comes.
func readStream(t *testing.T, body io.Reader, onLine func(string)) stream {
	t.Helper()
	var s stream
	sc := bufio.NewScanner(body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if onLine != nil {
			onLine(line)
		}
		switch {
		case line == "":
		case strings.HasPrefix(line, ":"):
			s.keepAlives++
		case line == "data: [DONE]":
			if s.done {
				t.Fatalf("second [DONE]")
			}
			s.done = true
		case strings.HasPrefix(line, "data: "):
			if s.done {
				t.Fatalf("data after [DONE]: %q", line)
			}
			var m map[string]any
			if err := json.Unmarshal([]byte(line[6:]), &m); err != nil {
				t.Fatalf("event is not JSON: %v: %q", err, line)
			}
			s.events = append(s.events, m)
			s.raw = append(s.raw, line[6:])
		default:
			t.Fatalf("unexpected SSE line %q", line)
		}
	}
	return s
}

// text concatenates the content of a stream's chunks.
func (s stream) text() string {
	var sb strings.Builder
	for _, ev := range s.events {
		ch, _ := ev["choices"].([]any)
		for _, c := range ch {
			cm := c.(map[string]any)
			if d, ok := cm["delta"].(map[string]any); ok {
				if v, ok := d["content"].(string); ok {
					sb.WriteString(v)
				}
			}
			if v, ok := cm["text"].(string); ok {
				sb.WriteString(v)
			}
		}
	}
	return sb.String()
}

func keys(m map[string]any) string {
	ks := make([]string, 0, len(m))
	for k := range m {
		ks = append(ks, k)
	}
	return strings.Join(sortStrings(ks), ",")
}

func sortStrings(s []string) []string {
	for i := 1; i < len(s); i++ {
		for j := i; j > 0 && s[j] < s[j-1]; j-- {
			s[j], s[j-1] = s[j-1], s[j]
		}
	}
	return s
}

func metricValue(t *testing.T, reg *prometheus.Registry, name string, labels map[string]string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	total := 0.0
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	next:
		for _, m := range mf.GetMetric() {
			got := map[string]string{}
			for _, lp := range m.GetLabel() {
				got[lp.GetName()] = lp.GetValue()
			}
			for k, v := range labels {
				if got[k] != v {
					continue next
				}
			}
			switch {
			case m.Counter != nil:
				total += m.Counter.GetValue()
			case m.Gauge != nil:
				total += m.Gauge.GetValue()
			case m.Histogram != nil:
				total += float64(m.Histogram.GetSampleCount())
			}
		}
	}
	return total
}

func osWriteFile(path string, b []byte) error { return os.WriteFile(path, b, 0o600) }

func stringsReader(s string) io.Reader { return strings.NewReader(s) }
