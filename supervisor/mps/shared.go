package mps

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"time"

	"github.com/hashicorp/go-hclog"
)

// DefaultWaitTimeout bounds Shared.Recover when SharedConfig.WaitTimeout is zero.
const DefaultWaitTimeout = 30 * time.Second

// ErrBadPipeDir: the operator's pipe directory fails the safety checks.
var ErrBadPipeDir = errors.New("unsafe or missing mps pipe directory")

// SharedConfig names the operator's MPS control daemon.
type SharedConfig struct {
	ControlBinary string // nvidia-cuda-mps-control (name in PATH or a path)
	// PipeDir is the daemon's CUDA_MPS_PIPE_DIRECTORY (an absolute path).
	PipeDir string
	// LogDir is its CUDA_MPS_LOG_DIRECTORY, given to the active when set.
	LogDir string
	// WaitTimeout bounds Recover; 0 = DefaultWaitTimeout.
	WaitTimeout time.Duration
}

// Shared is an MPS control daemon that belongs to the operator (e.g.
// Kubernetes MPS sharing). frmps joins it, places the active in it and checks
// that it answers; it never starts, stops or restarts it. After a fault the
// control daemon starts a new MPS server for the next client by itself.
type Shared struct {
	client
	pipeDir string
	logDir  string
	wait    time.Duration
	log     hclog.Logger
}

// Join checks the operator's daemon at cfg.PipeDir: the directory is safe to
// trust (a directory, not a symlink, owned by root or by us, not writable by
// others; its control socket likewise owned), and the daemon answers
// `get_server_list`.
func Join(ctx context.Context, cfg SharedConfig, log hclog.Logger) (*Shared, error) {
	if log == nil {
		log = hclog.NewNullLogger()
	}
	if err := checkPipeDir(cfg.PipeDir); err != nil {
		return nil, fmt.Errorf("join mps daemon: %w", err)
	}
	name := cfg.ControlBinary
	if name == "" {
		name = DefaultControlBinary
	}
	bin, err := exec.LookPath(name)
	if err != nil {
		return nil, fmt.Errorf("join mps daemon: %w: %q: %w", ErrBinaryMissing, name, err)
	}
	s := &Shared{client: client{bin: bin}, pipeDir: cfg.PipeDir, logDir: cfg.LogDir,
		wait: cfg.WaitTimeout, log: log.Named("mps")}
	if s.wait <= 0 {
		s.wait = DefaultWaitTimeout
	}
	s.env = append(withoutMPSEnv(os.Environ()), s.ClientEnv()...)
	if err := s.check(ctx); err != nil {
		return nil, fmt.Errorf("join mps daemon at %s: %w: %w (start it with CUDA_MPS_PIPE_DIRECTORY=%s nvidia-cuda-mps-control -d, or drop --mps-pipe-dir)",
			cfg.PipeDir, ErrNotAnswering, err, cfg.PipeDir)
	}
	s.log.Info("joined the operator's mps daemon", "pipe_dir", s.pipeDir)
	return s, nil
}

// checkPipeDir refuses a pipe directory another user could have planted a
// control socket in.
func checkPipeDir(dir string) error {
	if dir == "" || !filepath.IsAbs(dir) {
		return fmt.Errorf("%w: %q is not an absolute path", ErrBadPipeDir, dir)
	}
	fi, err := os.Lstat(dir)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrBadPipeDir, err)
	}
	if !fi.IsDir() {
		return fmt.Errorf("%w: %s is not a directory (a symlink is not followed)", ErrBadPipeDir, dir)
	}
	if err := trustedOwner(dir, fi); err != nil {
		return err
	}
	if fi.Mode().Perm()&0o002 != 0 {
		return fmt.Errorf("%w: %s is writable by every user (mode %v)", ErrBadPipeDir, dir, fi.Mode().Perm())
	}
	ctl := filepath.Join(dir, "control")
	cfi, err := os.Lstat(ctl)
	if err != nil {
		return fmt.Errorf("%w: no control socket (is a daemon running there?): %w", ErrBadPipeDir, err)
	}
	return trustedOwner(ctl, cfi)
}

// trustedOwner: root or the user frmps runs as.
func trustedOwner(path string, fi os.FileInfo) error {
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return fmt.Errorf("%w: %s: no owner information", ErrBadPipeDir, path)
	}
	if st.Uid != 0 && int(st.Uid) != os.Getuid() {
		return fmt.Errorf("%w: %s is owned by uid %d, neither root nor us (uid %d)", ErrBadPipeDir, path, st.Uid, os.Getuid())
	}
	return nil
}

// Check verifies that the daemon answers `get_server_list`.
func (s *Shared) Check(ctx context.Context) error {
	if err := s.check(ctx); err != nil {
		return fmt.Errorf("check the operator's mps daemon at %s: %w: %w", s.pipeDir, ErrNotAnswering, err)
	}
	return nil
}

// Recover waits, up to the wait timeout, for the daemon to answer again. It
// never restarts it: that is the operator's (or its service manager's) job.
func (s *Shared) Recover(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, s.wait)
	defer cancel()
	delay := 50 * time.Millisecond
	for {
		err := s.check(ctx)
		if err == nil {
			s.log.Info("the operator's mps daemon answers", "pipe_dir", s.pipeDir)
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%w: the operator's mps daemon at %s did not answer within %s; frmps does not restart it, restart it (or its service): %w",
				ErrNotAnswering, s.pipeDir, s.wait, err)
		case <-time.After(delay):
		}
		delay = min(2*delay, time.Second)
	}
}

// Stop leaves the operator's daemon running.
func (s *Shared) Stop(context.Context) error {
	s.log.Info("leaving the operator's mps daemon running", "pipe_dir", s.pipeDir)
	return nil
}

// Owned: the daemon is the operator's.
func (s *Shared) Owned() bool { return false }

// ClientEnv is the environment that puts a CUDA process under this daemon.
func (s *Shared) ClientEnv() []string {
	env := []string{"CUDA_MPS_PIPE_DIRECTORY=" + s.pipeDir}
	if s.logDir != "" {
		env = append(env, "CUDA_MPS_LOG_DIRECTORY="+s.logDir)
	}
	return env
}

// PipeDir is the operator's pipe directory.
func (s *Shared) PipeDir() string { return s.pipeDir }

// LogDir is the operator's log directory ("" when frmps was not told it).
func (s *Shared) LogDir() string { return s.logDir }
