// Command frontdoor benchmarks the OpenAI front door against a FAKE
// generation engine (supervisor/openai/fakegen, a labelled test
// double that runs no model): added latency per streamed chunk, and chunks
// per second with many concurrent streams. With -serve it instead serves the
// front door over the fake on an address, for trying clients by hand.
package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
	"github.com/frmps/frmps/supervisor/openai"
	"github.com/frmps/frmps/supervisor/openai/fakegen"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "frontdoor:", err)
		os.Exit(1)
	}
}

type options struct {
	procs       int
	latStreams  int
	latInterval time.Duration
	tputStreams int
	tokens      int
	serve       string
	killAfter   int
	apiKey      string
	cpuProfile  string
	// split: the front door runs in a child process pinned to fdCPUs.
	split      bool
	fdCPUs     string
	role       string
	engineSock string
}

func run() error {
	var o options
	flag.IntVar(&o.procs, "procs", 2, "GOMAXPROCS for the whole process (fake engine, front door and clients share it)")
	flag.IntVar(&o.latStreams, "lat-streams", 64, "concurrent streams in the latency phase")
	flag.DurationVar(&o.latInterval, "lat-interval", 10*time.Millisecond, "fake engine's time between chunks in the latency phase")
	flag.IntVar(&o.tputStreams, "tput-streams", 256, "concurrent streams in the throughput phase (engine emits as fast as it can)")
	flag.IntVar(&o.tokens, "tokens", 400, "chunks (one token each) per stream")
	flag.StringVar(&o.serve, "serve", "", "serve the front door over a fake engine on this address instead of benchmarking")
	flag.IntVar(&o.killAfter, "kill-after", 0, "with -serve: the first engine dies after this many tokens and a second takes over")
	flag.StringVar(&o.apiKey, "api-key", "", "with -serve: require this API key")
	flag.StringVar(&o.cpuProfile, "cpuprofile", "", "write a CPU profile of the benchmark here")
	flag.BoolVar(&o.split, "split", false, "run the front door in a child process pinned with taskset to -fd-cpus (GOMAXPROCS = -procs); engine and clients stay here")
	flag.StringVar(&o.fdCPUs, "fd-cpus", "0,1", "with -split: CPUs of the front door process")
	flag.StringVar(&o.role, "role", "", "internal: 'frontdoor' runs only the front door over -engine-sock")
	flag.StringVar(&o.engineSock, "engine-sock", "", "internal: the fake engine's socket for -role frontdoor")
	flag.Parse()
	if o.role == "frontdoor" {
		runtime.GOMAXPROCS(o.procs)
		if o.cpuProfile != "" {
			f, err := os.Create(o.cpuProfile)
			if err != nil {
				return err
			}
			defer f.Close()
			if err := pprof.StartCPUProfile(f); err != nil {
				return err
			}
			defer pprof.StopCPUProfile()
		}
		return frontdoorChild(o.engineSock)
	}
	if !o.split {
		runtime.GOMAXPROCS(o.procs)
	}
	dir, err := os.MkdirTemp("", "fdbench")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	if o.serve != "" {
		return serve(dir, o)
	}
	if o.cpuProfile != "" && !o.split {
		f, err := os.Create(o.cpuProfile)
		if err != nil {
			return err
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return err
		}
		defer pprof.StopCPUProfile()
	}
	where := fmt.Sprintf("everything in one process, GOMAXPROCS=%d", o.procs)
	if o.split {
		where = fmt.Sprintf("front door alone in a process on CPUs %s with GOMAXPROCS=%d; engine and clients elsewhere (GOMAXPROCS=%d)", o.fdCPUs, o.procs, runtime.GOMAXPROCS(0))
	}
	fmt.Printf("front door benchmark — FAKE engine (no model); %s; %d chunks/stream, 1 token/chunk\n", where, o.tokens)
	fmt.Println("latency = client receive time - fake engine emit time (same clock); added = SSE through the front door - direct gRPC;")
	fmt.Println("in front door = its own time per chunk, engine chunk received -> written to the client socket (frmps_stream_chunk_overhead_seconds)")
	fmt.Println()
	fmt.Printf("%-22s %8s %9s %11s %9s %9s\n", "phase / path", "streams", "chunks", "chunks/s", "p50 µs", "p99 µs")
	for _, ph := range []struct {
		name     string
		streams  int
		interval time.Duration
	}{
		{fmt.Sprintf("paced %v", o.latInterval), o.latStreams, o.latInterval},
		{"flat out", o.tputStreams, 0},
	} {
		direct, fd, err := phase(dir, o, ph.streams, ph.interval)
		if err != nil {
			return err
		}
		fmt.Printf("%-22s %8d %9d %11.0f %9.1f %9.1f\n", ph.name+" gRPC", ph.streams, direct.chunks, direct.rate(), direct.pct(50), direct.pct(99))
		fmt.Printf("%-22s %8d %9d %11.0f %9.1f %9.1f\n", ph.name+" SSE", ph.streams, fd.chunks, fd.rate(), fd.pct(50), fd.pct(99))
		fmt.Printf("%-22s %8s %9s %11s %9.1f %9.1f\n", ph.name+" added", "", "", "", fd.pct(50)-direct.pct(50), fd.pct(99)-direct.pct(99))
		fmt.Printf("%-22s %8s %9s %11s %9.1f %9.1f\n", ph.name+" in front door", "", "", "", fd.overhead50, fd.overhead99)
		if o.split {
			perChunk := lastChildCPU.Seconds() / float64(fd.chunks)
			fmt.Printf("%-22s front door process CPU %.1f µs/chunk (user+sys, whole process incl. startup) → %.0f chunks/s per %d cores at full load\n",
				ph.name+" cost", perChunk*1e6, float64(o.procs)/perChunk, o.procs)
		}
	}
	return nil
}

// lastChildCPU is the CPU time the split-mode front door process used.
var lastChildCPU time.Duration

type result struct {
	// overhead50/99: the front door's own time per chunk, from its histogram (µs).
	overhead50, overhead99 float64
	chunks                 int
	wall                   time.Duration
	lat                    []int64 // ns
}

func (r *result) rate() float64 { return float64(r.chunks) / r.wall.Seconds() }

func (r *result) pct(p float64) float64 {
	if len(r.lat) == 0 {
		return 0
	}
	i := int(float64(len(r.lat)-1) * p / 100)
	return float64(r.lat[i]) / 1e3
}

func (r *result) merge(lats [][]int64) {
	for _, l := range lats {
		r.lat = append(r.lat, l...)
		r.chunks += len(l)
	}
	slices.Sort(r.lat)
}

// phase runs the same load first straight against the fake engine over gRPC,
// then through the front door over HTTP/SSE.
func phase(dir string, o options, streams int, interval time.Duration) (direct, fd *result, err error) {
	ecfg := fakegen.Config{Model: "fake", MaxModelLen: 1 << 20, OutputLen: o.tokens, Interval: interval, StampText: true}
	eng, err := fakegen.Start(filepath.Join(dir, fmt.Sprintf("e%d.sock", time.Now().UnixNano()%1e6)), ecfg)
	if err != nil {
		return nil, nil, err
	}
	defer eng.Close()

	// Direct gRPC.
	lats := make([][]int64, streams)
	errs := make([]error, streams)
	var wg sync.WaitGroup
	start := time.Now()
	for i := range streams {
		wg.Add(1)
		go func() {
			defer wg.Done()
			lats[i], errs[i] = directStream(eng.Client(), uint64(i+1), o.tokens)
		}()
	}
	wg.Wait()
	direct = &result{wall: time.Since(start)}
	if err := errors.Join(errs...); err != nil {
		return nil, nil, fmt.Errorf("direct stream: %w", err)
	}
	direct.merge(lats)

	// Through the front door.
	addr, stopFD, err := startFrontDoor(o, eng, ecfg, streams)
	if err != nil {
		return nil, nil, err
	}
	tr := &http.Transport{MaxIdleConnsPerHost: streams, MaxConnsPerHost: streams, DisableCompression: true}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr}
	url := "http://" + addr + "/v1/completions"
	body := []byte(`{"model":"fake","prompt":"bench","stream":true,"max_tokens":` + strconv.Itoa(o.tokens) + `}`)
	start = time.Now()
	for i := range streams {
		wg.Add(1)
		go func() {
			defer wg.Done()
			lats[i], errs[i] = sseStream(client, url, body)
		}()
	}
	wg.Wait()
	fd = &result{wall: time.Since(start)}
	if err := errors.Join(errs...); err != nil {
		return nil, nil, fmt.Errorf("sse stream: %w", err)
	}
	fd.merge(lats)
	fd.overhead50, fd.overhead99, err = scrapeOverhead(client, "http://"+addr+"/metrics")
	if err != nil {
		return nil, nil, err
	}
	return direct, fd, stopFD()
}

// scrapeOverhead reads the front door's own per-chunk time histogram
// (engine chunk received → written to the client socket) and estimates its
// p50 and p99 in µs by interpolating within buckets.
func scrapeOverhead(c *http.Client, url string) (p50, p99 float64, err error) {
	resp, err := c.Get(url)
	if err != nil {
		return 0, 0, fmt.Errorf("scrape metrics: %w", err)
	}
	defer resp.Body.Close()
	type bucket struct{ le, n float64 }
	var bs []bucket
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, "frmps_stream_chunk_overhead_seconds_bucket{") {
			continue
		}
		i := strings.Index(line, `le="`)
		j := strings.LastIndexByte(line, ' ')
		if i < 0 || j < 0 {
			continue
		}
		leStr := line[i+4 : i+4+strings.IndexByte(line[i+4:], '"')]
		n, _ := strconv.ParseFloat(line[j+1:], 64)
		le, perr := strconv.ParseFloat(leStr, 64)
		if leStr == "+Inf" {
			le, perr = 1, nil
		}
		if perr == nil {
			bs = append(bs, bucket{le, n})
		}
	}
	if len(bs) == 0 || bs[len(bs)-1].n == 0 {
		return 0, 0, errors.New("no per-chunk overhead histogram in /metrics")
	}
	total := bs[len(bs)-1].n
	q := func(p float64) float64 {
		rank := p * total
		lo, prev := 0.0, 0.0
		for _, b := range bs {
			if b.n >= rank {
				return (lo + (b.le-lo)*(rank-prev)/max(b.n-prev, 1)) * 1e6
			}
			lo, prev = b.le, b.n
		}
		return lo * 1e6
	}
	return q(0.5), q(0.99), nil
}

// startFrontDoor serves the front door over eng, in this process or (split)
// in a pinned child, and returns its address and a stop function.
func startFrontDoor(o options, eng *fakegen.Engine, ecfg fakegen.Config, streams int) (string, func() error, error) {
	if o.split {
		args := []string{"-c", o.fdCPUs, os.Args[0], "-role", "frontdoor", "-procs", strconv.Itoa(o.procs), "-engine-sock", eng.Path()}
		if o.cpuProfile != "" { // in split mode the profile is the front door's alone
			args = append(args, "-cpuprofile", o.cpuProfile)
		}
		cmd := exec.Command("taskset", args...)
		cmd.Stderr = os.Stderr
		out, err := cmd.StdoutPipe()
		if err != nil {
			return "", nil, err
		}
		if err := cmd.Start(); err != nil {
			return "", nil, fmt.Errorf("start front door child: %w", err)
		}
		line, err := bufio.NewReader(out).ReadString('\n')
		if err != nil {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
			return "", nil, fmt.Errorf("read front door child address: %w", err)
		}
		return strings.TrimSpace(line), func() error {
			_ = cmd.Process.Signal(syscall.SIGTERM)
			err := cmd.Wait()
			lastChildCPU = cmd.ProcessState.UserTime() + cmd.ProcessState.SystemTime()
			return err
		}, nil
	}
	backend := fakegen.NewBackend(openai.ModelInfo{Name: ecfg.Model, MaxModelLen: ecfg.MaxModelLen})
	backend.Set(eng.Client())
	srv, err := openai.New(openai.Config{MaxConcurrent: streams + 16, IdempotencyTTL: -1}, backend, hclog.NewNullLogger(), prometheus.NewRegistry())
	if err != nil {
		return "", nil, err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", nil, err
	}
	hs := &http.Server{Handler: srv.Handler()}
	go func() { _ = hs.Serve(ln) }()
	return ln.Addr().String(), func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		err := srv.Shutdown(ctx)
		return errors.Join(err, hs.Close())
	}, nil
}

// frontdoorChild is the split mode's child: the front door alone, over the
// parent's fake engine; prints its address, serves until SIGTERM.
func frontdoorChild(sock string) error {
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()
	backend := fakegen.NewBackend(openai.ModelInfo{Name: "fake", MaxModelLen: 1 << 20})
	backend.Set(frmpsv1.NewGenerationClient(conn))
	srv, err := openai.New(openai.Config{MaxConcurrent: 4096, IdempotencyTTL: -1}, backend, hclog.NewNullLogger(), prometheus.NewRegistry())
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	hs := &http.Server{Handler: srv.Handler()}
	go func() { _ = hs.Serve(ln) }()
	fmt.Println(ln.Addr().String())
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	<-ctx.Done()
	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	return errors.Join(srv.Shutdown(sctx), hs.Close())
}

func directStream(c frmpsv1.GenerationClient, key uint64, tokens int) ([]int64, error) {
	st, err := c.Generate(context.Background(), &frmpsv1.GenerateRequest{Key: key,
		Input: &frmpsv1.GenerateRequest_Prompt{Prompt: "bench"}, Params: &frmpsv1.SamplingParams{MaxTokens: uint32(tokens)}})
	if err != nil {
		return nil, err
	}
	lat := make([]int64, 0, tokens)
	for {
		r, err := st.Recv()
		if err == io.EOF {
			return lat, nil
		}
		if err != nil {
			return nil, err
		}
		now := time.Now().UnixNano()
		stamp, err := strconv.ParseInt(r.GetText(), 10, 64)
		if err != nil {
			return nil, fmt.Errorf("parse stamp %q: %w", r.GetText(), err)
		}
		lat = append(lat, now-stamp)
		if r.GetFinishReason() != frmpsv1.FinishReason_FINISH_REASON_UNSPECIFIED {
			return lat, nil
		}
	}
}

var textKey = []byte(`"text":"`)

func sseStream(c *http.Client, url string, body []byte) ([]int64, error) {
	resp, err := c.Post(url, "application/json", bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		b, _ := io.ReadAll(resp.Body)
		return nil, fmt.Errorf("status %d: %s", resp.StatusCode, b)
	}
	br := bufio.NewReaderSize(resp.Body, 64<<10)
	var lat []int64
	for {
		line, err := br.ReadSlice('\n')
		if err == io.EOF {
			return nil, errors.New("stream ended without [DONE]")
		}
		if err != nil {
			return nil, err
		}
		now := time.Now().UnixNano()
		if bytes.HasPrefix(line, []byte("data: [DONE]")) {
			return lat, nil
		}
		i := bytes.Index(line, textKey)
		if i < 0 {
			continue
		}
		rest := line[i+len(textKey):]
		j := bytes.IndexByte(rest, '"')
		if j <= 0 {
			continue // the final chunk has empty text
		}
		stamp, err := strconv.ParseInt(string(rest[:j]), 10, 64)
		if err != nil {
			return nil, fmt.Errorf("parse stamp %q: %w", rest[:j], err)
		}
		lat = append(lat, now-stamp)
	}
}

// serve runs the front door over fake engines until SIGINT/SIGTERM. With
// killAfter, the first engine dies mid-stream and a second one adopts the open
// requests, as the supervisor would arrange.
func serve(dir string, o options) error {
	log := hclog.New(&hclog.LoggerOptions{Name: "frontdoor", Level: hclog.Info})
	ecfg := fakegen.Config{Model: "fake", MaxModelLen: 2048, OutputLen: 32}
	first := ecfg
	first.KillAfter = o.killAfter
	a, err := fakegen.Start(filepath.Join(dir, "a.sock"), first)
	if err != nil {
		return err
	}
	defer a.Close()
	b, err := fakegen.Start(filepath.Join(dir, "b.sock"), ecfg)
	if err != nil {
		return err
	}
	defer b.Close()
	backend := fakegen.NewBackend(openai.ModelInfo{Name: "fake", MaxModelLen: 2048})
	backend.Set(a.Client())
	reg := prometheus.NewRegistry()
	srv, err := openai.New(openai.Config{APIKey: o.apiKey, KeepAliveInterval: 100 * time.Millisecond}, backend, log, reg)
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	go func() {
		select {
		case <-a.Dead():
		case <-ctx.Done():
			return
		}
		backend.Clear()
		reqs := srv.OpenRequests()
		log.Info("engine a died; engine b adopts the open requests", "open", len(reqs))
		time.Sleep(300 * time.Millisecond) // a visible gap: clients get keep-alives
		b.Adopt(reqs)
		backend.Set(b.Client())
	}()
	hs := &http.Server{Addr: o.serve, Handler: srv.Handler(), ReadHeaderTimeout: 10 * time.Second}
	errc := make(chan error, 1)
	go func() { errc <- hs.ListenAndServe() }()
	log.Info("serving", "addr", o.serve)
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	err = srv.Shutdown(sctx)
	return errors.Join(err, hs.Shutdown(sctx))
}
