// Package engine launches engine processes: each in its own process group
// with a parent-death signal, its output in a log file created before the
// launch and re-logged through hclog with the engine's levels kept. One
// goroutine owns the child's exit (go-plugin style): it reaps the child,
// fences the group, drains the output and then closes Done.
package engine

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/hashicorp/go-hclog"
	"golang.org/x/sys/unix"
)

// Spec describes one launch.
type Spec struct {
	Name string   // for logs, e.g. "active-3"
	Path string   // executable
	Args []string // arguments, without argv[0]
	// Env is the complete environment of the child (nothing is inherited).
	Env []string
	Dir string
	// LogPath receives the child's stdout and stderr; created (0600, append)
	// before the launch.
	LogPath string
	// StderrLines is how many last stderr lines to keep for the death
	// classifier; 0 means 50.
	StderrLines int
	// Stdin: give the child a pipe as stdin, written through the Process
	// (a spare's activation); otherwise stdin is /dev/null.
	Stdin bool
	// OnStdout, when set, sees every stdout line (on the pump goroutine).
	OnStdout func(line string)
}

// Process is a launched engine. Safe for concurrent use.
type Process struct {
	pid   int
	done  chan struct{}
	stdin *os.File // Spec.Stdin: the write end, until closed

	mu       sync.Mutex
	name     string
	logPath  string
	elog     hclog.Logger
	ws       syscall.WaitStatus
	waitErr  error
	tail     []string // ring of the last stderr lines
	tailNext int
	tailCap  int
	start    time.Time
	base     hclog.Logger // the logger Start was given (elog = base named after the process)
}

// Start launches spec. On error no process is left behind, and the log file
// holds the reason (when it could be created at all).
func Start(spec Spec, log hclog.Logger) (_ *Process, retErr error) {
	if spec.Path == "" {
		return nil, errors.New("start engine: empty executable path")
	}
	if spec.LogPath == "" {
		return nil, errors.New("start engine: empty log path")
	}
	logFile, err := os.OpenFile(spec.LogPath, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return nil, fmt.Errorf("open engine log: %w", err)
	}
	fmt.Fprintf(logFile, "frmps: %s launching %s %s\n", time.Now().UTC().Format(time.RFC3339Nano), spec.Path, strings.Join(spec.Args, " "))
	defer func() {
		if retErr != nil {
			fmt.Fprintf(logFile, "frmps: launch failed: %v\n", retErr)
			logFile.Close()
		}
	}()

	outR, outW, err := os.Pipe()
	if err != nil {
		return nil, fmt.Errorf("engine stdout pipe: %w", err)
	}
	errR, errW, err := os.Pipe()
	if err != nil {
		outR.Close()
		outW.Close()
		return nil, fmt.Errorf("engine stderr pipe: %w", err)
	}
	var inR, inW *os.File
	if spec.Stdin {
		if inR, inW, err = os.Pipe(); err != nil {
			outR.Close()
			outW.Close()
			errR.Close()
			errW.Close()
			return nil, fmt.Errorf("engine stdin pipe: %w", err)
		}
	}

	cmd := exec.Command(spec.Path, spec.Args...)
	cmd.Env = spec.Env
	if cmd.Env == nil {
		cmd.Env = []string{}
	}
	cmd.Dir = spec.Dir
	cmd.Stdout, cmd.Stderr = outW, errW
	if inR != nil {
		cmd.Stdin = inR
	}
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Setpgid: true, // Kill fences the whole group, grandchildren included
		// The kernel kills the engine if the supervisor dies, even by SIGKILL.
		Pdeathsig: syscall.SIGKILL,
	}
	startErr := cmd.Start()
	// The child holds its own copies; ours must go so the readers see EOF.
	outW.Close()
	errW.Close()
	if inR != nil {
		inR.Close()
	}
	if startErr != nil {
		outR.Close()
		errR.Close()
		if inW != nil {
			inW.Close()
		}
		return nil, fmt.Errorf("start engine %s: %w", spec.Name, startErr)
	}

	n := spec.StderrLines
	if n <= 0 {
		n = 50
	}
	p := &Process{name: spec.Name, pid: cmd.Process.Pid, logPath: spec.LogPath, done: make(chan struct{}), tailCap: n, start: time.Now(), stdin: inW}
	p.base = log
	p.elog = log.Named(spec.Name).With("pid", p.pid)

	var logMu sync.Mutex // the two streams share the file
	var readers sync.WaitGroup
	readers.Add(2)
	go func() { defer readers.Done(); p.pump(outR, logFile, &logMu, hclog.Info, false, spec.OnStdout) }()
	go func() { defer readers.Done(); p.pump(errR, logFile, &logMu, hclog.Warn, true, nil) }()

	// The one goroutine that owns the exit.
	go func() {
		// Wait without reaping, so the pid (= pgid) cannot be reused while we
		// fence the group; then reap.
		var info unix.Siginfo
		for {
			err := unix.Waitid(unix.P_PID, p.pid, &info, unix.WEXITED|unix.WNOWAIT, nil)
			if err != unix.EINTR {
				break
			}
		}
		_ = syscall.Kill(-p.pid, syscall.SIGKILL) // leftovers of the group die with their leader
		werr := cmd.Wait()
		readers.Wait()
		outR.Close()
		errR.Close()
		var ws syscall.WaitStatus
		if cmd.ProcessState != nil {
			ws = cmd.ProcessState.Sys().(syscall.WaitStatus)
		}
		var exitErr *exec.ExitError
		if errors.As(werr, &exitErr) {
			werr = nil // a non-zero exit is reported through the status
		}
		fmt.Fprintf(logFile, "frmps: %s exited: %s\n", time.Now().UTC().Format(time.RFC3339Nano), describe(ws))
		logFile.Close()
		p.mu.Lock()
		p.ws, p.waitErr = ws, werr
		p.mu.Unlock()
		if w := p.takeStdin(); w != nil {
			w.Close()
		}
		close(p.done)
	}()
	return p, nil
}

// pump copies one stream line by line into the log file and hclog.
func (p *Process) pump(r io.Reader, file io.Writer, fileMu *sync.Mutex, def hclog.Level, keep bool, hook func(string)) {
	br := bufio.NewReaderSize(r, 64<<10)
	for {
		line, err := br.ReadString('\n')
		if line != "" {
			fileMu.Lock()
			_, _ = io.WriteString(file, line)
			if !strings.HasSuffix(line, "\n") {
				_, _ = io.WriteString(file, "\n")
			}
			fileMu.Unlock()
			line = strings.TrimRight(line, "\r\n")
			if keep {
				p.keep(line)
			}
			if hook != nil {
				hook(line)
			}
			if line != "" {
				lvl, msg := ParseLevel(line, def)
				p.logger().Log(lvl, msg)
			}
		}
		if err != nil {
			return
		}
	}
}

func (p *Process) keep(line string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.tail) < p.tailCap {
		p.tail = append(p.tail, line)
		return
	}
	p.tail[p.tailNext] = line
	p.tailNext = (p.tailNext + 1) % p.tailCap
}

// PID of the engine (also its process group id).
func (p *Process) PID() int { return p.pid }

// LogPath is the engine's log file.
func (p *Process) LogPath() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.logPath
}

// takeStdin hands over the write end of a Spec.Stdin pipe, once (nil after).
func (p *Process) takeStdin() *os.File {
	p.mu.Lock()
	defer p.mu.Unlock()
	w := p.stdin
	p.stdin = nil
	return w
}

func (p *Process) logger() hclog.Logger {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.elog
}

// Done is closed once the engine has exited, its group is fenced, and its
// output is drained.
func (p *Process) Done() <-chan struct{} { return p.done }

// WaitStatus is the exit status; valid after Done.
func (p *Process) WaitStatus() syscall.WaitStatus {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.ws
}

// LastStderr returns the last stderr lines, oldest first.
func (p *Process) LastStderr() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make([]string, 0, len(p.tail))
	if len(p.tail) < p.tailCap {
		return append(out, p.tail...)
	}
	out = append(out, p.tail[p.tailNext:]...)
	return append(out, p.tail[:p.tailNext]...)
}

// Kill fences the engine: SIGKILL to its whole process group. Idempotent;
// returns at once (wait on Done).
func (p *Process) Kill() error {
	select {
	case <-p.done:
		return nil
	default:
	}
	// Until Done the leader is not reaped, so the group id is still ours.
	if err := syscall.Kill(-p.pid, syscall.SIGKILL); err != nil && !errors.Is(err, syscall.ESRCH) {
		return fmt.Errorf("kill engine group %d: %w", p.pid, err)
	}
	return nil
}

// KillLeader fences the engine's leader only: SIGKILL to its pid. A signal
// costs the sender a wake-up of every thread it reaches (3-4 µs each in the
// GPU host's VM, measured), so a whole group of an engine's helper processes
// (compile workers, say) costs far more than its leader; once the leader has
// exited, the exit goroutine above fences what is left of the group before
// Done. Idempotent; returns at once.
func (p *Process) KillLeader() error {
	select {
	case <-p.done:
		return nil
	default:
	}
	if err := syscall.Kill(p.pid, syscall.SIGKILL); err != nil && !errors.Is(err, syscall.ESRCH) {
		return fmt.Errorf("kill engine %d: %w", p.pid, err)
	}
	return nil
}

// Signal sends sig to the engine's leader only (e.g. SIGTERM for a polite stop).
func (p *Process) Signal(sig syscall.Signal) error {
	select {
	case <-p.done:
		return nil
	default:
	}
	if err := syscall.Kill(p.pid, sig); err != nil && !errors.Is(err, syscall.ESRCH) {
		return fmt.Errorf("signal engine %d: %w", p.pid, err)
	}
	return nil
}

func describe(ws syscall.WaitStatus) string {
	switch {
	case ws.Signaled():
		return fmt.Sprintf("killed by signal %d (%s)", int(ws.Signal()), ws.Signal())
	case ws.Exited():
		return fmt.Sprintf("exit code %d", ws.ExitStatus())
	}
	return fmt.Sprintf("status %#x", uint32(ws))
}

// ParseLevel finds the log level an engine wrote at the start of a line:
// hclog ("2026-… [WARN]  msg"), Python logging ("WARNING:name:msg",
// "ERROR 2026-… msg", "… - ERROR - msg") or vLLM ("INFO 01-02 …"). The level
// word must appear in the first 48 bytes; otherwise def is used.
func ParseLevel(line string, def hclog.Level) (hclog.Level, string) {
	head := line
	if len(head) > 48 {
		head = head[:48]
	}
	best, bestAt := hclog.NoLevel, len(head)
	for _, c := range levelWords {
		i := indexWord(head, c.word)
		if i >= 0 && i < bestAt {
			best, bestAt = c.lvl, i
		}
	}
	if best == hclog.NoLevel {
		return def, line
	}
	return best, line
}

var levelWords = []struct {
	word string
	lvl  hclog.Level
}{
	{"TRACE", hclog.Trace}, {"DEBUG", hclog.Debug}, {"INFO", hclog.Info},
	{"WARNING", hclog.Warn}, {"WARN", hclog.Warn}, {"ERROR", hclog.Error},
	{"CRITICAL", hclog.Error}, {"FATAL", hclog.Error},
}

// indexWord finds w in s delimited by non-letters (so "INFORMATION" is not INFO).
func indexWord(s, w string) int {
	for off := 0; ; {
		i := strings.Index(s[off:], w)
		if i < 0 {
			return -1
		}
		i += off
		end := i + len(w)
		if (i == 0 || !isLetter(s[i-1])) && (end == len(s) || !isLetter(s[end])) {
			return i
		}
		off = i + 1
	}
}

func isLetter(b byte) bool { return b >= 'A' && b <= 'Z' || b >= 'a' && b <= 'z' }
