package leftover

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/procfs"
)

func TestOwnerGone(t *testing.T) {
	owner := Identity{PID: 42, StartTicks: 1000, BootID: "boot-a"}
	for _, tc := range []struct {
		name     string
		owner    Identity
		boot     string
		start    uint64
		startErr error
		gone     bool
	}{
		{"alive", owner, "boot-a", 1000, nil, false},
		{"exited", owner, "boot-a", 0, errNoProcess, true},
		{"zombie", owner, "boot-a", 1000, errZombie, true},
		{"zombie, pid reused", owner, "boot-a", 2000, errZombie, true},
		{"pid reused", owner, "boot-a", 2000, nil, true},
		{"earlier boot", owner, "boot-b", 1000, nil, true},
		{"earlier boot, pid free", owner, "boot-b", 0, errNoProcess, true},
		{"cannot inspect", owner, "boot-a", 0, os.ErrPermission, false},
		{"no pid", Identity{StartTicks: 1, BootID: "boot-a"}, "boot-a", 0, errNoProcess, false},
		{"no start time", Identity{PID: 42, BootID: "boot-a"}, "boot-a", 0, errNoProcess, false},
		{"no boot id", Identity{PID: 42, StartTicks: 1}, "boot-a", 0, errNoProcess, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			gone, why := ownerGone(tc.owner, tc.boot, tc.start, tc.startErr)
			if gone != tc.gone || why == "" {
				t.Fatalf("gone %v (%s), want %v", gone, why, tc.gone)
			}
		})
	}
}

func TestOpenDir(t *testing.T) {
	base := t.TempDir()
	d, err := OpenDir(filepath.Join(base, "a", "state"))
	if err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(d.Path()); err != nil || fi.Mode().Perm() != 0o700 {
		t.Fatalf("mode %v %v", fi.Mode(), err)
	}
	if _, err := OpenDir(d.Path()); err != nil {
		t.Fatalf("reopen: %v", err)
	}
	open := filepath.Join(base, "open")
	if err := os.Mkdir(open, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(open, 0o755); err != nil {
		t.Fatal(err)
	}
	if _, err := OpenDir(open); err == nil || !strings.Contains(err.Error(), "0700") {
		t.Fatalf("a directory others can read: %v", err)
	}
	link := filepath.Join(base, "link")
	if err := os.Symlink(d.Path(), link); err != nil {
		t.Fatal(err)
	}
	if _, err := OpenDir(link); err == nil {
		t.Fatal("a symlink was accepted")
	}
	if _, err := OpenDir("relative/state"); err == nil {
		t.Fatal("a relative path was accepted")
	}
}

// deadPID returns the pid of a process that has exited and been reaped.
func deadPID(t *testing.T) int {
	t.Helper()
	cmd := exec.Command("true")
	if err := cmd.Run(); err != nil {
		t.Fatal(err)
	}
	return cmd.Process.Pid
}

func TestStaleRecords(t *testing.T) {
	d, err := OpenDir(filepath.Join(t.TempDir(), "state"))
	if err != nil {
		t.Fatal(err)
	}
	self, err := Self()
	if err != nil {
		t.Fatal(err)
	}
	records := map[string]Identity{
		"self":       self,
		"exited":     {PID: deadPID(t), StartTicks: self.StartTicks, BootID: self.BootID},
		"reused":     {PID: self.PID, StartTicks: self.StartTicks + 1, BootID: self.BootID},
		"other-boot": {PID: self.PID, StartTicks: self.StartTicks, BootID: "not-this-boot"},
	}
	for name, id := range records {
		if err := d.Write(name, Record{Owner: id, Ring: "/dev/shm/frmps-" + name + ".ring"}); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(d.Path(), "garbage.json"), []byte("{"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(d.Path(), ".tmp123"), []byte("{"), 0o600); err != nil {
		t.Fatal(err)
	}
	stale, err := d.Stale()
	if err == nil || !strings.Contains(err.Error(), "garbage.json") {
		t.Fatalf("an unreadable record must be reported: %v", err)
	}
	got := map[string]string{}
	for _, s := range stale {
		got[s.Name] = s.Why
		if s.Record.Ring != "/dev/shm/frmps-"+s.Name+".ring" {
			t.Errorf("%s: record %+v", s.Name, s.Record)
		}
	}
	want := map[string]string{"exited": "process gone", "reused": "pid reused by another process", "other-boot": "written before the last reboot"}
	if len(got) != len(want) {
		t.Fatalf("stale %v, want %v", got, want)
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s: %q, want %q", k, got[k], v)
		}
	}
	for _, s := range stale {
		if err := d.Remove(s.Name); err != nil {
			t.Fatal(err)
		}
	}
	if err := d.Remove("exited"); err != nil {
		t.Fatalf("removing a removed record: %v", err)
	}
	if err := d.Write("../escape", Record{}); err == nil {
		t.Fatal("a record name with a path was accepted")
	}
}

func TestClean(t *testing.T) {
	base := t.TempDir()
	mk := func() Record {
		run := filepath.Join(base, "run")
		if err := os.MkdirAll(filepath.Join(run, "mps", "pipe"), 0o700); err != nil {
			t.Fatal(err)
		}
		ring := filepath.Join(base, "frmps-1.ring")
		if err := os.WriteFile(ring, []byte("ring"), 0o600); err != nil {
			t.Fatal(err)
		}
		return Record{Ring: ring, RunDir: run, MPSControl: "mps-control"}
	}
	exists := func(p string) bool { _, err := os.Lstat(p); return err == nil }

	r := mk()
	if err := Clean(context.Background(), r, nil); err != nil || exists(r.Ring) || exists(r.RunDir) {
		t.Fatalf("clean: %v; ring left %v, run dir left %v", err, exists(r.Ring), exists(r.RunDir))
	}
	if err := Clean(context.Background(), r, nil); err != nil {
		t.Fatalf("cleaning what is gone: %v", err)
	}

	r = mk()
	r.PrivateMPS = true
	if err := Clean(context.Background(), r, nil); err == nil || !exists(r.RunDir) || exists(r.Ring) {
		t.Fatalf("a private MPS and no way to stop it: %v; the run dir must stay, the ring go", err)
	}
	var stopped []string
	stop := func(_ context.Context, bin, runDir string) error {
		if !exists(filepath.Join(runDir, "mps", "pipe")) {
			t.Error("the run dir went before the daemon was stopped")
		}
		stopped = append(stopped, bin, runDir)
		return nil
	}
	if err := Clean(context.Background(), r, stop); err != nil || exists(r.RunDir) {
		t.Fatalf("clean: %v", err)
	}
	if len(stopped) != 2 || stopped[0] != "mps-control" || stopped[1] != r.RunDir {
		t.Fatalf("stopMPS called with %v", stopped)
	}
	r = mk()
	r.PrivateMPS = true
	if err := Clean(context.Background(), r, func(context.Context, string, string) error { return errors.New("still running") }); err == nil || !exists(r.RunDir) {
		t.Fatalf("a daemon that did not stop: %v; the run dir must stay", err)
	}

	for _, bad := range []Record{{RunDir: "/"}, {RunDir: "relative"}, {Ring: "/dev/shm/../etc/x"}} {
		if err := Clean(context.Background(), bad, nil); err == nil {
			t.Errorf("%+v accepted", bad)
		}
	}
}

// A supervisor SIGKILLed whose parent has not reaped it yet is a zombie: it
// holds nothing, so its record is stale and what it names is removed.
func TestStaleZombieOwner(t *testing.T) {
	d, err := OpenDir(filepath.Join(t.TempDir(), "state"))
	if err != nil {
		t.Fatal(err)
	}
	boot, err := BootID()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("sleep", "60")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	reaped := false
	defer func() {
		if !reaped {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
	}()
	pid := cmd.Process.Pid
	start, err := startTicks(pid)
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Write("child", Record{Owner: Identity{PID: pid, StartTicks: start, BootID: boot}}); err != nil {
		t.Fatal(err)
	}
	if stale, err := d.Stale(); err != nil || len(stale) != 0 {
		t.Fatalf("a live owner's record is stale: %v %v", stale, err)
	}
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	// Not reaped: wait until the kernel shows it as a zombie (os/exec never
	// reaps on its own).
	for i := 0; ; i++ {
		p, err := procfs.NewProc(pid)
		if err != nil {
			t.Fatal(err)
		}
		st, err := p.Stat()
		if err != nil {
			t.Fatal(err)
		}
		if st.State == "Z" {
			break
		}
		if i == 5000 {
			t.Fatalf("child %d never became a zombie (state %s)", pid, st.State)
		}
		time.Sleep(time.Millisecond)
	}
	stale, err := d.Stale()
	if err != nil {
		t.Fatal(err)
	}
	if len(stale) != 1 || stale[0].Name != "child" || !strings.Contains(stale[0].Why, "zombie") {
		t.Fatalf("a zombie owner's record: stale %+v, want it stale as a zombie", stale)
	}
	reaped = true
	_ = cmd.Wait()
	if stale, err := d.Stale(); err != nil || len(stale) != 1 || stale[0].Why != "process gone" {
		t.Fatalf("after reaping: %+v %v", stale, err)
	}
}
