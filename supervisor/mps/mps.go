// Package mps runs a private NVIDIA MPS control daemon for the active
// engine, or joins the operator's (Join, shared.go), and gives the standby
// an environment in which CUDA runs outside MPS. It also reads the GPU's
// compute mode (computemode.go).
//
// The daemon is private to the deployment: its pipe and log directories
// live under the supervisor's run directory (mode 0700), so it shares the
// GPU with other tenants' contexts only through the MPS server it starts,
// and never collides with a system-wide daemon in /tmp/nvidia-mps. Every
// command runs under a timeout: a wedged daemon yields an error, never a
// hang.
package mps

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/hashicorp/go-hclog"
)

// DefaultControlBinary is the MPS control program looked up in PATH.
const DefaultControlBinary = "nvidia-cuda-mps-control"

// DefaultStartTimeout bounds Start when Config.StartTimeout is zero.
const DefaultStartTimeout = 10 * time.Second

// checkTimeout bounds one `get_server_list` exchange: the control client
// answers in milliseconds when the daemon is healthy.
const checkTimeout = 2 * time.Second

// pidFile is where the control daemon records its pid in its pipe
// directory (removed when it quits; its `control` socket file stays). Used
// to wait for a quit to finish and to kill a daemon that ignores `quit`.
const pidFile = "nvidia-cuda-mps-control.pid"

// Errors wrapped by Start, Check and Stop, for callers that pick a state
// (degraded, no MPS) from the kind of failure.
var (
	ErrBinaryMissing = errors.New("mps control binary not found")
	ErrStartFailed   = errors.New("mps daemon failed to start")
	ErrNotAnswering  = errors.New("mps daemon not answering")
	ErrStopFailed    = errors.New("mps daemon did not stop")
)

// Config configures the private MPS daemon.
type Config struct {
	ControlBinary string        // nvidia-cuda-mps-control (name in PATH or a path)
	RunDir        string        // the supervisor's run directory; must exist
	StartTimeout  time.Duration // bounds Start, Restart and Stop; 0 = DefaultStartTimeout
}

// client runs nvidia-cuda-mps-control commands against one daemon.
type client struct {
	bin string
	env []string // environment of every control command (names the daemon's pipe dir)
}

// Daemon is a running private MPS control daemon.
type Daemon struct {
	client
	pipeDir string
	logDir  string
	timeout time.Duration
	log     hclog.Logger

	mu      sync.Mutex // serialises Start/Stop/Restart
	running bool
}

// Start starts `nvidia-cuda-mps-control -d` with private pipe and log
// directories under cfg.RunDir, then waits until it answers
// `get_server_list`, all within cfg.StartTimeout. A daemon left in the same
// directories by a supervisor that died is asked to quit first.
func Start(ctx context.Context, cfg Config, log hclog.Logger) (*Daemon, error) {
	if log == nil {
		log = hclog.NewNullLogger()
	}
	if cfg.RunDir == "" {
		return nil, errors.New("start mps daemon: run directory not set")
	}
	name := cfg.ControlBinary
	if name == "" {
		name = DefaultControlBinary
	}
	bin, err := exec.LookPath(name)
	if err != nil {
		return nil, fmt.Errorf("start mps daemon: %w: %q: %w", ErrBinaryMissing, name, err)
	}
	timeout := cfg.StartTimeout
	if timeout <= 0 {
		timeout = DefaultStartTimeout
	}
	base := filepath.Join(cfg.RunDir, "mps")
	pipeDir, logDir := filepath.Join(base, "pipe"), filepath.Join(base, "log")
	for _, dir := range []string{base, pipeDir, logDir} {
		if err := makePrivateDir(dir); err != nil {
			return nil, fmt.Errorf("start mps daemon: %w", err)
		}
	}
	d := &Daemon{
		client:  client{bin: bin},
		pipeDir: pipeDir,
		logDir:  logDir,
		timeout: timeout,
		log:     log.Named("mps"),
	}
	d.env = append(withoutMPSEnv(os.Environ()), d.ClientEnv()...)

	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.stopStale(ctx); err != nil {
		return nil, fmt.Errorf("start mps daemon: %w", err)
	}
	if err := d.start(ctx); err != nil {
		return nil, fmt.Errorf("start mps daemon: %w", err)
	}
	return d, nil
}

// start launches the daemon and waits for it to answer. Caller holds mu.
func (d *Daemon) start(ctx context.Context) (retErr error) {
	ctx, cancel := context.WithTimeout(ctx, d.timeout)
	defer cancel()

	out, err := os.OpenFile(filepath.Join(d.logDir, "control-start.out"), os.O_CREATE|os.O_WRONLY|os.O_TRUNC|os.O_APPEND, 0o600)
	if err != nil {
		return fmt.Errorf("open start log: %w", err)
	}
	defer out.Close()
	// The daemon inherits stdout/stderr: a file, not a pipe, so that
	// waiting for `-d` to return never waits for the daemon to exit.
	cmd := d.command(ctx, "-d")
	cmd.Stdout, cmd.Stderr = out, out
	err = cmd.Run()
	switch {
	case ctx.Err() != nil:
		return fmt.Errorf("%w: %s -d did not return within %s (%s)", ErrStartFailed, d.bin, d.timeout, d.startOutput())
	case err != nil:
		return fmt.Errorf("%w: %s -d: %w: %s", ErrStartFailed, d.bin, err, d.startOutput())
	}
	d.running = true
	defer func() {
		if retErr != nil {
			// Do not leave a daemon we cannot talk to behind us.
			d.killFromPIDFile()
			d.running = false
		}
	}()

	delay := 10 * time.Millisecond
	for {
		err := d.check(ctx)
		if err == nil {
			d.log.Info("mps daemon started", "pipe_dir", d.pipeDir, "log_dir", d.logDir)
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%w within %s of starting: %w", ErrNotAnswering, d.timeout, err)
		case <-time.After(delay):
		}
		delay = min(2*delay, 200*time.Millisecond)
	}
}

func (d *Daemon) startOutput() string {
	b, err := os.ReadFile(filepath.Join(d.logDir, "control-start.out"))
	if err != nil {
		return "no output"
	}
	return lastLines(b)
}

// command builds a control command in its own process group, so a timeout
// kills it together with anything it spawned.
func (d client) command(ctx context.Context, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, d.bin, args...)
	cmd.Env = d.env
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	cmd.WaitDelay = time.Second
	return cmd
}

// control sends one command line to the daemon through the control client
// and returns its output.
func (d client) control(ctx context.Context, line string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, checkTimeout)
	defer cancel()
	cmd := d.command(ctx)
	cmd.Stdin = strings.NewReader(line + "\n")
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	if ctx.Err() != nil {
		return out.String(), fmt.Errorf("%q got no answer within %s", line, checkTimeout)
	}
	if err != nil {
		return out.String(), fmt.Errorf("%q: %w: %s", line, err, lastLines(out.Bytes()))
	}
	return out.String(), nil
}

func (d client) check(ctx context.Context) error {
	_, err := d.control(ctx, "get_server_list")
	return err
}

// Check verifies that the daemon answers `get_server_list`.
func (d *Daemon) Check(ctx context.Context) error {
	if err := d.check(ctx); err != nil {
		return fmt.Errorf("check mps daemon: %w: %w", ErrNotAnswering, err)
	}
	return nil
}

// Stop asks the daemon to quit and waits until it no longer answers; a
// daemon that ignores `quit` is killed through its pid file. Idempotent.
func (d *Daemon) Stop(ctx context.Context) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if !d.running {
		return nil
	}
	if err := d.stop(ctx); err != nil {
		return fmt.Errorf("stop mps daemon: %w", err)
	}
	d.log.Info("mps daemon stopped", "pipe_dir", d.pipeDir)
	return nil
}

// stop quits the daemon. Caller holds mu.
func (d *Daemon) stop(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, d.timeout)
	defer cancel()
	pid := d.daemonPID()
	_, quitErr := d.control(ctx, "quit")
	if d.waitGone(ctx, pid, d.timeout/2) {
		d.running = false
		return nil
	}
	if pid <= 0 {
		return fmt.Errorf("%w: no pid file to kill it by (quit: %v)", ErrStopFailed, quitErr)
	}
	// Its MPS servers are its children: read them before the kill, which
	// re-parents them. Left running, a server keeps its GPU memory and the
	// GPU's MPS state after the daemon is gone.
	servers := childrenOf(pid)
	d.log.Warn("mps daemon ignored quit, killing it and its servers", "pid", pid, "servers", servers, "quit_error", quitErr)
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil && !errors.Is(err, syscall.ESRCH) {
		return fmt.Errorf("%w: kill pid %d: %w", ErrStopFailed, pid, err)
	}
	if !d.waitGone(ctx, pid, d.timeout/2) {
		return fmt.Errorf("%w: pid %d still alive after SIGKILL", ErrStopFailed, pid)
	}
	if left := killAll(servers, d.timeout/2); len(left) > 0 {
		return fmt.Errorf("%w: mps server pids %v still alive after SIGKILL", ErrStopFailed, left)
	}
	d.running = false
	return nil
}

// childrenOf lists the live processes whose parent is pid (from /proc): a
// control daemon's MPS servers.
func childrenOf(pid int) []int {
	var kids []int
	parent := strconv.Itoa(pid)
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		n, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if f, ok := procStat(e.Name()); ok && len(f) >= 2 && !gone(f[0]) && f[1] == parent {
			kids = append(kids, n)
		}
	}
	return kids
}

// procStat is /proc/<pid>/stat's fields after the command name ("pid (comm)
// state ppid ...": the name may itself contain ") "), from the state on.
func procStat(pid string) ([]string, bool) {
	stat, err := os.ReadFile("/proc/" + pid + "/stat")
	if err != nil {
		return nil, false
	}
	i := bytes.LastIndexByte(stat, ')')
	if i < 0 {
		return nil, false
	}
	return strings.Fields(string(stat[i+1:])), true
}

// gone: a process state of one that has exited (zombie or dead).
func gone(state string) bool { return state == "Z" || state == "X" }

// killAll SIGKILLs pids and waits up to limit for them to go; returns those still alive.
func killAll(pids []int, limit time.Duration) []int {
	for _, p := range pids {
		_ = syscall.Kill(p, syscall.SIGKILL)
	}
	deadline := time.Now().Add(limit)
	for {
		var left []int
		for _, p := range pids {
			if alive(p) {
				left = append(left, p)
			}
		}
		if len(left) == 0 || time.Now().After(deadline) {
			return left
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// waitGone waits up to limit for the daemon to go away: its pid gone when
// known, else no answer to `get_server_list`.
func (d *Daemon) waitGone(ctx context.Context, pid int, limit time.Duration) bool {
	ctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	for {
		if pid > 0 {
			if !alive(pid) {
				return true
			}
		} else if d.check(ctx) != nil {
			return true
		}
		select {
		case <-ctx.Done():
			return false
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// Restart stops the daemon (if running) and starts it again with the same
// directories, e.g. after a fault broke the MPS server.
func (d *Daemon) Restart(ctx context.Context) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.running {
		if err := d.stop(ctx); err != nil {
			return fmt.Errorf("restart mps daemon: %w", err)
		}
	}
	if err := d.start(ctx); err != nil {
		return fmt.Errorf("restart mps daemon: %w", err)
	}
	return nil
}

// Recover brings a daemon that does not answer back: this one is restarted.
func (d *Daemon) Recover(ctx context.Context) error { return d.Restart(ctx) }

// Owned: frmps started this daemon and stops it.
func (d *Daemon) Owned() bool { return true }

// stopStale quits a daemon that a previous supervisor left in our pipe
// directory. Caller holds mu.
func (d *Daemon) stopStale(ctx context.Context) error {
	if _, err := os.Stat(filepath.Join(d.pipeDir, "control")); err != nil {
		return nil // no control socket: no daemon was ever started here
	}
	// The socket file outlives a clean quit; only an answer means a live daemon.
	if d.check(ctx) != nil {
		return nil
	}
	d.log.Warn("found a running mps daemon from an earlier run, stopping it", "pipe_dir", d.pipeDir)
	if err := d.stop(ctx); err != nil {
		return fmt.Errorf("stop stale daemon: %w", err)
	}
	return nil
}

// daemonPID reads the daemon's pid file; 0 when absent or unreadable.
func (d *Daemon) daemonPID() int {
	b, err := os.ReadFile(filepath.Join(d.pipeDir, pidFile))
	if err != nil {
		return 0
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || pid <= 1 {
		return 0
	}
	return pid
}

// killFromPIDFile kills the daemon and its servers and waits (briefly) until
// they are gone, so a failed Start leaves no process behind.
func (d *Daemon) killFromPIDFile() {
	pid := d.daemonPID()
	if pid <= 0 {
		return
	}
	servers := childrenOf(pid)
	killAll([]int{pid}, 2*time.Second)
	killAll(servers, 2*time.Second)
}

// ClientEnv is the environment that puts a CUDA process under this daemon.
func (d *Daemon) ClientEnv() []string {
	return []string{"CUDA_MPS_PIPE_DIRECTORY=" + d.pipeDir, "CUDA_MPS_LOG_DIRECTORY=" + d.logDir}
}

// PipeDir is the daemon's private pipe directory.
func (d *Daemon) PipeDir() string { return d.pipeDir }

// LogDir is the daemon's private log directory (its server.log: serverlog.go).
func (d *Daemon) LogDir() string { return d.logDir }

// OutsideEnv is the environment for a CUDA process that must run outside
// MPS (the standby): its pipe directory is private and empty, so the CUDA
// driver finds no daemon there and runs the process on its own context.
// Setting it explicitly also keeps the process away from a system-wide
// daemon in the default /tmp/nvidia-mps.
func OutsideEnv(runDir string) ([]string, error) {
	if runDir == "" {
		return nil, errors.New("mps outside env: run directory not set")
	}
	base := filepath.Join(runDir, "mps-outside")
	pipeDir, logDir := filepath.Join(base, "pipe"), filepath.Join(base, "log")
	for _, dir := range []string{base, pipeDir, logDir} {
		if err := makePrivateDir(dir); err != nil {
			return nil, fmt.Errorf("mps outside env: %w", err)
		}
	}
	if _, err := os.Stat(filepath.Join(pipeDir, "control")); err == nil {
		return nil, fmt.Errorf("mps outside env: %s has a control pipe: a daemon was started there", pipeDir)
	}
	return []string{"CUDA_MPS_PIPE_DIRECTORY=" + pipeDir, "CUDA_MPS_LOG_DIRECTORY=" + logDir}, nil
}

// makePrivateDir creates dir (mode 0700) or tightens an existing one, and
// checks that we own it.
func makePrivateDir(dir string) error {
	if err := os.Mkdir(dir, 0o700); err != nil && !errors.Is(err, os.ErrExist) {
		return fmt.Errorf("create %s: %w", dir, err)
	}
	fi, err := os.Lstat(dir)
	if err != nil {
		return fmt.Errorf("check %s: %w", dir, err)
	}
	if !fi.IsDir() {
		return fmt.Errorf("%s is not a directory", dir)
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok && int(st.Uid) != os.Getuid() {
		return fmt.Errorf("%s is owned by uid %d, we are uid %d", dir, st.Uid, os.Getuid())
	}
	if fi.Mode().Perm() != 0o700 {
		if err := os.Chmod(dir, 0o700); err != nil {
			return fmt.Errorf("chmod %s: %w", dir, err)
		}
	}
	return nil
}

// withoutMPSEnv drops MPS variables inherited from our own environment.
func withoutMPSEnv(env []string) []string {
	out := make([]string, 0, len(env))
	for _, kv := range env {
		if strings.HasPrefix(kv, "CUDA_MPS_PIPE_DIRECTORY=") || strings.HasPrefix(kv, "CUDA_MPS_LOG_DIRECTORY=") {
			continue
		}
		out = append(out, kv)
	}
	return out
}

// alive reports whether pid is a live process. A zombie counts as gone: the
// daemon is not our child, and whoever inherited it may reap it late.
func alive(pid int) bool {
	f, ok := procStat(strconv.Itoa(pid))
	if !ok {
		err := syscall.Kill(pid, 0)
		return err == nil || errors.Is(err, syscall.EPERM)
	}
	return len(f) == 0 || !gone(f[0])
}

// lastLines keeps the end of a command's output for an error message.
func lastLines(b []byte) string {
	s := strings.TrimSpace(string(b))
	if s == "" {
		return "no output"
	}
	lines := strings.Split(s, "\n")
	if len(lines) > 3 {
		lines = lines[len(lines)-3:]
	}
	s = strings.Join(lines, " | ")
	if len(s) > 400 {
		s = s[len(s)-400:]
	}
	return s
}

// StopLeftover stops the daemon that Start ran under cfg.RunDir for a
// supervisor that died without stopping it, if one still answers there
// (the leftover package's cleanup of a dead supervisor). Nothing is created.
func StopLeftover(ctx context.Context, cfg Config, log hclog.Logger) error {
	if log == nil {
		log = hclog.NewNullLogger()
	}
	base := filepath.Join(cfg.RunDir, "mps")
	d := &Daemon{pipeDir: filepath.Join(base, "pipe"), logDir: filepath.Join(base, "log"), timeout: cfg.StartTimeout, log: log.Named("mps")}
	if d.timeout <= 0 {
		d.timeout = DefaultStartTimeout
	}
	if _, err := os.Stat(filepath.Join(d.pipeDir, "control")); err != nil {
		return nil // no daemon was ever started there
	}
	name := cfg.ControlBinary
	if name == "" {
		name = DefaultControlBinary
	}
	bin, err := exec.LookPath(name)
	if err != nil {
		if d.daemonPID() <= 0 || !alive(d.daemonPID()) {
			return nil // it quit (the pid file goes) or its process is gone
		}
		return fmt.Errorf("stop leftover mps daemon in %s: %w: %q: %w", d.pipeDir, ErrBinaryMissing, name, err)
	}
	d.bin = bin
	d.env = append(withoutMPSEnv(os.Environ()), d.ClientEnv()...)
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.stopStale(ctx); err != nil {
		return fmt.Errorf("stop leftover mps daemon: %w", err)
	}
	return nil
}
