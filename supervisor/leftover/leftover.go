// Package leftover cleans up after a supervisor that died without running
// its own cleanup (SIGKILL, the OOM killer). Each running supervisor keeps a
// launch record in a private state directory: who it is (pid, the process's
// start time, the boot) and what it created outside its process (the ring
// in /dev/shm, the run directory, a private MPS daemon). A supervisor that
// starts reads the records there and removes what the dead ones left; a
// record whose process is still the one that wrote it is left alone.
//
// The records are trusted as far as the directory is: it must be a real
// directory owned by this user, mode 0700 (OpenDir refuses anything else),
// since whoever can write a record can make a supervisor delete the paths
// it names.
package leftover

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/google/renameio/v2"
	"github.com/prometheus/procfs"
)

const recordVersion = 1

// Record is one supervisor's launch record.
type Record struct {
	Version int `json:"version"`
	// Owner is the process that wrote the record.
	Owner   Identity  `json:"owner"`
	Written time.Time `json:"written"`
	// Ring is the forward-state ring file; removed by Clean.
	Ring string `json:"ring,omitempty"`
	// RunDir is the run directory the supervisor created; removed by Clean.
	RunDir string `json:"run_dir,omitempty"`
	// PrivateMPS: the supervisor runs its own MPS daemon with its pipe
	// directory inside RunDir; it is stopped before RunDir goes. A daemon
	// that frmps joined but does not own is not recorded.
	PrivateMPS bool `json:"private_mps,omitempty"`
	// MPSControl is the nvidia-cuda-mps-control binary it used.
	MPSControl string `json:"mps_control,omitempty"`
}

// Identity names a process across pid reuse: the pid, its start time in
// clock ticks after boot (field 22 of /proc/<pid>/stat) and the boot.
type Identity struct {
	PID        int    `json:"pid"`
	StartTicks uint64 `json:"start_ticks"`
	BootID     string `json:"boot_id"`
}

// Self is the calling process's identity.
func Self() (Identity, error) {
	boot, err := BootID()
	if err != nil {
		return Identity{}, err
	}
	pid := os.Getpid()
	start, err := startTicks(pid)
	if err != nil {
		return Identity{}, fmt.Errorf("own start time: %w", err)
	}
	return Identity{PID: pid, StartTicks: start, BootID: boot}, nil
}

// BootID is this boot's random id (/proc/sys/kernel/random/boot_id).
func BootID() (string, error) {
	b, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil {
		return "", fmt.Errorf("read boot id: %w", err)
	}
	return strings.TrimSpace(string(b)), nil
}

// errNoProcess: no process has the pid.
var errNoProcess = errors.New("no such process")

// errZombie: the pid is a zombie, a process that has exited and waits for
// its parent to reap it. It holds nothing (no memory, no fds, no maps): its
// ring and run dir are as much left behind as those of a reaped one.
var errZombie = errors.New("zombie: exited, not yet reaped by its parent")

// startTicks reads a live process's start time; errNoProcess when the pid is
// free, errZombie when it has exited but not yet been reaped.
func startTicks(pid int) (uint64, error) {
	p, err := procfs.NewProc(pid)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return 0, errNoProcess
		}
		return 0, err
	}
	st, err := p.Stat()
	if err != nil {
		if errors.Is(err, os.ErrNotExist) || errors.Is(err, syscall.ESRCH) {
			return 0, errNoProcess // exited between the two reads
		}
		return 0, err
	}
	if st.State == "Z" {
		return st.Starttime, errZombie
	}
	return st.Starttime, nil
}

// ownerGone decides whether a record's owner is gone, given this boot's id
// and the start time of whatever process now has the owner's pid
// (errNoProcess when none). A process that cannot be inspected counts as
// alive: removing a live supervisor's ring would break it.
func ownerGone(owner Identity, bootID string, start uint64, startErr error) (gone bool, why string) {
	switch {
	case owner.PID <= 0 || owner.BootID == "" || owner.StartTicks == 0:
		return false, "record names no process"
	case owner.BootID != bootID:
		return true, "written before the last reboot"
	case errors.Is(startErr, errNoProcess):
		return true, "process gone"
	case errors.Is(startErr, errZombie) && start == owner.StartTicks:
		return true, "process exited (a zombie its parent has not reaped)"
	case errors.Is(startErr, errZombie):
		return true, "pid reused by another process"
	case startErr != nil:
		return false, "cannot inspect pid " + strconv.Itoa(owner.PID) + ": " + startErr.Error()
	case start != owner.StartTicks:
		return true, "pid reused by another process"
	}
	return false, "process alive"
}

// Dir is a state directory holding launch records.
type Dir struct{ path string }

// DefaultDir is where records go unless configured: $XDG_RUNTIME_DIR/frmps
// (per user, on a tmpfs), else /run/frmps for root, else
// <temp dir>/frmps-<uid>.
func DefaultDir() string {
	if d := os.Getenv("XDG_RUNTIME_DIR"); d != "" && filepath.IsAbs(d) {
		return filepath.Join(d, "frmps")
	}
	if os.Geteuid() == 0 {
		return "/run/frmps"
	}
	return filepath.Join(os.TempDir(), "frmps-"+strconv.Itoa(os.Geteuid()))
}

// OpenDir creates dir (mode 0700) when missing and checks that it is a
// directory, not a link, owned by this user and closed to others.
func OpenDir(dir string) (*Dir, error) {
	if !filepath.IsAbs(dir) {
		return nil, fmt.Errorf("state dir %q: not an absolute path", dir)
	}
	if err := os.MkdirAll(filepath.Dir(dir), 0o755); err != nil {
		return nil, fmt.Errorf("state dir: %w", err)
	}
	if err := os.Mkdir(dir, 0o700); err != nil && !errors.Is(err, os.ErrExist) {
		return nil, fmt.Errorf("state dir: %w", err)
	}
	fi, err := os.Lstat(dir)
	if err != nil {
		return nil, fmt.Errorf("state dir: %w", err)
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	switch {
	case !fi.IsDir():
		return nil, fmt.Errorf("state dir %s: not a directory (a link or a file)", dir)
	case !ok || int(st.Uid) != os.Geteuid():
		return nil, fmt.Errorf("state dir %s: not owned by uid %d", dir, os.Geteuid())
	case fi.Mode().Perm()&0o077 != 0:
		return nil, fmt.Errorf("state dir %s: mode %#o, want 0700 (others could plant records naming paths to delete)", dir, fi.Mode().Perm())
	}
	return &Dir{path: dir}, nil
}

// Path is the directory.
func (d *Dir) Path() string { return d.path }

const suffix = ".json"

func (d *Dir) file(name string) string { return filepath.Join(d.path, name+suffix) }

// Write stores r under name atomically (a reader sees the old record or the
// new one, never a part).
func (d *Dir) Write(name string, r Record) error {
	if name == "" || strings.ContainsAny(name, `/\`) || strings.HasPrefix(name, ".") {
		return fmt.Errorf("launch record name %q", name)
	}
	r.Version = recordVersion
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return fmt.Errorf("encode launch record: %w", err)
	}
	if err := renameio.WriteFile(d.file(name), append(b, '\n'), 0o600); err != nil {
		return fmt.Errorf("write launch record: %w", err)
	}
	return nil
}

// Remove deletes the record name; a missing one is not an error.
func (d *Dir) Remove(name string) error {
	if err := os.Remove(d.file(name)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove launch record: %w", err)
	}
	return nil
}

// Stale is a record whose owner is gone.
type Stale struct {
	Name   string
	Record Record
	Why    string
}

// Stale lists the records whose owner is gone. Records it cannot read are
// reported in the error and left in place.
func (d *Dir) Stale() ([]Stale, error) {
	boot, err := BootID()
	if err != nil {
		return nil, err
	}
	ents, err := os.ReadDir(d.path)
	if err != nil {
		return nil, fmt.Errorf("read state dir: %w", err)
	}
	var out []Stale
	var errs []error
	for _, e := range ents {
		name, ok := strings.CutSuffix(e.Name(), suffix)
		if !ok || strings.HasPrefix(name, ".") || !e.Type().IsRegular() {
			continue // renameio's temporary files start with a dot
		}
		b, err := os.ReadFile(d.file(name))
		if err != nil {
			errs = append(errs, fmt.Errorf("launch record %s: %w", e.Name(), err))
			continue
		}
		var r Record
		if err := json.Unmarshal(b, &r); err != nil || r.Version != recordVersion {
			errs = append(errs, fmt.Errorf("launch record %s: unreadable (version %d): %v", e.Name(), r.Version, err))
			continue
		}
		start, serr := startTicks(r.Owner.PID)
		if gone, why := ownerGone(r.Owner, boot, start, serr); gone {
			out = append(out, Stale{Name: name, Record: r, Why: why})
		}
	}
	return out, errors.Join(errs...)
}

// StopMPS stops the private MPS daemon a dead supervisor left running with
// its pipe directory inside runDir (no-op when none answers there).
type StopMPS func(ctx context.Context, controlBinary, runDir string) error

// Clean removes what r names: it stops r's private MPS daemon (stopMPS;
// nil refuses to remove a run dir that may hold a live daemon's pipes), then
// removes the ring and the run directory. What is already gone is not an
// error.
func Clean(ctx context.Context, r Record, stopMPS StopMPS) error {
	for _, p := range []string{r.Ring, r.RunDir} {
		if p != "" && (!filepath.IsAbs(p) || filepath.Clean(p) != p || p == "/") {
			return fmt.Errorf("launch record names %q: not a clean absolute path, left alone", p)
		}
	}
	var errs []error
	if r.Ring != "" {
		if err := os.Remove(r.Ring); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, fmt.Errorf("remove ring: %w", err))
		}
	}
	if r.RunDir != "" {
		if r.PrivateMPS {
			if stopMPS == nil {
				return errors.Join(append(errs, fmt.Errorf("run dir %s may hold a running MPS daemon and no way to stop it was given: left in place", r.RunDir))...)
			}
			if err := stopMPS(ctx, r.MPSControl, r.RunDir); err != nil {
				return errors.Join(append(errs, fmt.Errorf("stop the dead supervisor's MPS daemon (run dir left in place): %w", err))...)
			}
		}
		if err := os.RemoveAll(r.RunDir); err != nil {
			errs = append(errs, fmt.Errorf("remove run dir: %w", err))
		}
	}
	return errors.Join(errs...)
}
