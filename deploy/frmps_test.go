package deploy_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// repoRoot is the checkout this module lives in.
var repoRoot = func() string {
	wd, err := os.Getwd()
	if err != nil {
		panic(err)
	}
	return filepath.Dir(wd)
}()

var (
	buildOnce sync.Once
	builtBin  string
	buildErr  error
)

// frmpsBinary is $FRMPS_BIN (`make deploy-test` passes bin/frmps), else a
// static build of ./cmd/frmps, as the container image builds it.
func frmpsBinary(t *testing.T) string {
	t.Helper()
	if bin := os.Getenv("FRMPS_BIN"); bin != "" {
		return bin
	}
	buildOnce.Do(func() {
		dir, err := os.MkdirTemp("", "frmps-deploy-test-")
		if err != nil {
			buildErr = err
			return
		}
		builtBin = filepath.Join(dir, "frmps")
		cmd := exec.Command("go", "build", "-trimpath", "-o", builtBin, "./cmd/frmps")
		cmd.Dir = repoRoot
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			buildErr = fmt.Errorf("build frmps: %w\n%s", err, out)
		}
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return builtBin
}

// inCheckout: bin is the checkout's bin/frmps, which finds the checkout's
// .venv and engine sources by itself, as after `make demo`.
func inCheckout(bin string) bool {
	abs, err := filepath.Abs(bin)
	return err == nil && abs == filepath.Join(repoRoot, "bin", "frmps")
}

// userEnv is this process's environment without what points frmps at an
// interpreter, as a new user's shell would be.
func userEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		if k != "FRMPS_PYTHON" && k != "PYTHONPATH" && k != "VIRTUAL_ENV" {
			env = append(env, kv)
		}
	}
	return env
}

func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// frmps is a running `frmps serve --no-mps` with the tiny reference model on
// the CPU: real engines, real supervisor, real front door.
type frmps struct {
	api, admin string
	cmd        *exec.Cmd
	log        *bytes.Buffer
	// firstScrape is the first /metrics page that answered, taken while
	// frmps started: before any request, failover or engine event.
	firstScrape []byte
}

func startFrmps(t *testing.T) *frmps {
	t.Helper()
	bin := frmpsBinary(t)
	port, adminPort := freePort(t), freePort(t)
	f := &frmps{api: "http://127.0.0.1:" + strconv.Itoa(port), admin: "http://127.0.0.1:" + strconv.Itoa(adminPort), log: &bytes.Buffer{}}
	f.cmd = exec.Command(bin, "serve", "--no-mps", "--model", "tiny", "--sync-every", "4",
		"--port", strconv.Itoa(port), "--admin-addr", "127.0.0.1:"+strconv.Itoa(adminPort),
		"--ring-dir", t.TempDir(), "--shutdown-grace", "5s")
	env := append(userEnv(), "FRMPS_TEST_STEP_DELAY_MS=10") // streams last long enough to fail over inside one
	if !inCheckout(bin) {
		env = append(env, "FRMPS_PYTHON="+filepath.Join(repoRoot, ".venv", "bin", "python"),
			"PYTHONPATH="+filepath.Join(repoRoot, "vllmpatch", "src"))
	}
	f.cmd.Env = env
	f.cmd.Stdout, f.cmd.Stderr = f.log, f.log
	if err := f.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- f.cmd.Wait() }()
	t.Cleanup(func() {
		_ = f.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case err := <-exited:
			if err != nil {
				t.Errorf("frmps exited with %v after SIGTERM\n%s", err, f.log.String())
			}
		case <-time.After(60 * time.Second):
			_ = f.cmd.Process.Kill()
			<-exited
			t.Errorf("frmps did not stop within 60s of SIGTERM\n%s", f.log.String())
		}
	})
	deadline := time.Now().Add(3 * time.Minute)
	for {
		select {
		case err := <-exited:
			exited <- err
			t.Fatalf("frmps exited before serving: %v\n%s", err, f.log.String())
		default:
		}
		if f.firstScrape == nil {
			f.firstScrape = f.tryScrape()
		}
		if st := f.status(); st["state"] == "serving_ready" {
			if f.firstScrape == nil {
				t.Fatalf("/metrics did not answer while frmps started\n%s", f.log.String())
			}
			return f
		}
		if time.Now().After(deadline) {
			t.Fatalf("frmps not serving_ready within 3 minutes\n%s", f.log.String())
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// status is GET /v1/admin/status, or nil while it does not answer.
func (f *frmps) status() map[string]any {
	resp, err := http.Get(f.admin + "/v1/admin/status")
	if err != nil {
		return nil
	}
	defer resp.Body.Close()
	var st map[string]any
	if json.NewDecoder(resp.Body).Decode(&st) != nil {
		return nil
	}
	return st
}

func (f *frmps) post(t *testing.T, url, body string) []byte {
	t.Helper()
	resp, err := http.Post(url, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("POST %s: %d %s %v", url, resp.StatusCode, b, err)
	}
	return b
}

// streamAcrossDrill streams a completion and, once a few chunks arrived,
// has the admin API kill the active (a drill): the stream must finish on
// the promoted standby with every token.
func (f *frmps) streamAcrossDrill(t *testing.T, maxTokens int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	body := fmt.Sprintf(`{"model":"tiny","prompt":"The quick brown fox","max_tokens":%d,"ignore_eos":true,"stream":true,"stream_options":{"include_usage":true}}`, maxTokens)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, f.api+"/v1/completions", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		b, _ := io.ReadAll(resp.Body)
		t.Fatalf("completion: %d %s", resp.StatusCode, b)
	}
	chunks, drilled, done := 0, false, false
	var usage struct {
		Usage struct {
			CompletionTokens int `json:"completion_tokens"`
		} `json:"usage"`
	}
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue
		}
		if data == "[DONE]" {
			done = true
			break
		}
		if strings.Contains(data, `"error"`) {
			t.Fatalf("error event in the stream: %s", data)
		}
		if strings.Contains(data, `"usage":{`) {
			_ = json.Unmarshal([]byte(data), &usage)
		}
		if chunks++; chunks == 5 && !drilled {
			drilled = true
			if b := f.post(t, f.admin+"/v1/admin/failover", `{"reason":"deploy test"}`); !bytes.Contains(b, []byte(`"accepted":true`)) {
				t.Fatalf("drill refused: %s", b)
			}
		}
	}
	if err := sc.Err(); err != nil || !done {
		t.Fatalf("stream ended early after %d chunks: %v", chunks, err)
	}
	if usage.Usage.CompletionTokens != maxTokens {
		t.Fatalf("%d tokens across the failover, want %d", usage.Usage.CompletionTokens, maxTokens)
	}
}

// tryScrape is the /metrics page, or nil while it does not answer.
func (f *frmps) tryScrape() []byte {
	resp, err := http.Get(f.api + "/metrics")
	if err != nil {
		return nil
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != 200 {
		return nil
	}
	return b
}

func (f *frmps) scrape(t *testing.T) []byte {
	t.Helper()
	resp, err := http.Get(f.api + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("/metrics: %d %v", resp.StatusCode, err)
	}
	return b
}
