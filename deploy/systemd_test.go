package deploy_test

import (
	"bufio"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

const unitFile = "systemd/frmps.service"

// unit reads a unit file into section → key → values (keys may repeat).
func unit(t *testing.T, path string) map[string]map[string][]string {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	out := map[string]map[string][]string{}
	section := ""
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		switch {
		case line == "" || strings.HasPrefix(line, "#"):
		case strings.HasPrefix(line, "["):
			section = strings.Trim(line, "[]")
			out[section] = map[string][]string{}
		default:
			k, v, ok := strings.Cut(line, "=")
			if !ok {
				t.Fatalf("%s: %q", path, line)
			}
			out[section][k] = append(out[section][k], v)
		}
	}
	return out
}

// systemdAnalyze runs systemd-analyze on a copy of the unit whose ExecStart
// names the frmps binary under test (verify checks that it exists).
func systemdAnalyze(t *testing.T, args ...string) (string, error) {
	t.Helper()
	sa, err := exec.LookPath("systemd-analyze")
	if err != nil {
		t.Skip("systemd-analyze is not installed: the unit file is not verified")
	}
	b, err := os.ReadFile(unitFile)
	if err != nil {
		t.Fatal(err)
	}
	const exec = "ExecStart=/usr/local/bin/frmps "
	if !strings.Contains(string(b), exec) {
		t.Fatalf("ExecStart does not run /usr/local/bin/frmps")
	}
	copyPath := filepath.Join(t.TempDir(), "frmps.service")
	if err := os.WriteFile(copyPath, []byte(strings.Replace(string(b), exec, "ExecStart="+frmpsBinary(t)+" ", 1)), 0o644); err != nil {
		t.Fatal(err)
	}
	out, err := runWithTimeout(sa, append(args, copyPath)...)
	return out, err
}

func runWithTimeout(name string, args ...string) (string, error) {
	cmd := exec.Command(name, args...)
	cmd.WaitDelay = time.Second
	done := make(chan struct{})
	defer close(done)
	go func() {
		select {
		case <-done:
		case <-time.After(time.Minute):
			_ = cmd.Process.Kill()
		}
	}()
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// systemd-analyze verify accepts the unit without a word (an unknown or
// misspelt directive is a warning there, so any output fails the test).
func TestSystemdUnitVerifies(t *testing.T) {
	out, err := systemdAnalyze(t, "verify")
	if err != nil || strings.TrimSpace(out) != "" {
		t.Fatalf("systemd-analyze verify: %v\n%s", err, out)
	}
}

// The hardening keeps systemd's exposure score at "OK" or better (≤ 4.0).
func TestSystemdUnitHardening(t *testing.T) {
	out, err := systemdAnalyze(t, "security", "--offline=yes", "--threshold=40")
	if err != nil {
		t.Fatalf("exposure above 4.0: %v\n%s", err, out)
	}
}

// What the unit promises: notify with a watchdog the event loop feeds,
// restarts on failure, a stop timeout covering frmps's drain, and hardening
// that leaves /dev/shm, the NVIDIA devices and the MPS pipe directory usable.
func TestSystemdUnitSettings(t *testing.T) {
	u := unit(t, unitFile)
	svc := u["Service"]
	one := func(k string) string {
		if len(svc[k]) != 1 {
			t.Fatalf("%s set %d times", k, len(svc[k]))
		}
		return svc[k][0]
	}
	for k, want := range map[string]string{"Type": "notify", "NotifyAccess": "main", "Restart": "on-failure", "KillMode": "mixed",
		"NoNewPrivileges": "yes", "ProtectSystem": "strict", "DevicePolicy": "closed"} {
		if got := one(k); got != want {
			t.Errorf("%s=%s, want %s", k, got, want)
		}
	}
	watchdog, err := time.ParseDuration(one("WatchdogSec"))
	if err != nil || watchdog < 10*time.Second {
		t.Errorf("WatchdogSec=%s: at least 10s, so GC pauses and a busy loop do not trip it", one("WatchdogSec"))
	}
	var cfg struct {
		ShutdownGrace string `json:"shutdown_grace"`
	}
	b, err := os.ReadFile("systemd/frmps.json")
	if err != nil || json.Unmarshal(b, &cfg) != nil {
		t.Fatalf("systemd/frmps.json: %v", err)
	}
	grace, err := time.ParseDuration(cfg.ShutdownGrace)
	if err != nil {
		t.Fatal(err)
	}
	stop, err := time.ParseDuration(one("TimeoutStopSec"))
	if err != nil || stop < 2*grace+25*time.Second {
		t.Errorf("TimeoutStopSec=%s < 2 x shutdown_grace (%s) + 25s: engines would be SIGKILLed mid-drain", one("TimeoutStopSec"), grace)
	}
	devices := strings.Join(svc["DeviceAllow"], " ")
	for _, d := range []string{"char-nvidia-frontend rw", "char-nvidia-uvm rw"} {
		if !strings.Contains(devices, d) {
			t.Errorf("DeviceAllow lacks %q", d)
		}
	}
	for _, k := range []string{"PrivateDevices", "PrivateIPC", "PrivateTmp", "DynamicUser"} {
		if v := svc[k]; len(v) > 0 && v[0] != "no" {
			t.Errorf("%s=%s would hide /dev/shm, the NVIDIA devices or the MPS daemon's shared memory", k, v[0])
		}
	}
	if !strings.Contains(strings.Join(svc["ReadWritePaths"], " "), "/run/nvidia-mps") {
		t.Error("the MPS pipe directory is not writable")
	}
}
