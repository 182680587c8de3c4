package main

import (
	"bytes"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/frmps/frmps/supervisor"
)

// A bad option stops frmps serve at once: exit 1 with the reason in one line,
// before the GPU probe, the engine interpreter or anything else (the
// interpreter given does not exist: a later check would name it instead). The
// test binary re-executed as frmps.
func TestServeBadOptionExitsAtOnce(t *testing.T) {
	if os.Getenv("FRMPS_TEST_MAIN") == "1" {
		os.Args = append([]string{"frmps"}, strings.Fields(os.Getenv("FRMPS_TEST_ARGS"))...)
		main()
		return
	}
	noPython := filepath.Join(t.TempDir(), "no-such-python")
	ring := "--ring-capacity: ring: bad capacity: 5000000 is not a power of two in [4096, 17179869184]"
	for _, tc := range []struct{ args, want string }{
		// The ring wants a power of two; the supervisor's config once let this through to ring creation.
		{"serve --ring-capacity 5000000", ring},
		{"serve --config " + writeConfig(t, `{"ring_capacity": 5000000}`), ring},
		{"serve --device cuda:0", `--device "cuda:0": want auto, cpu or cuda`},
		{"serve --sync-every 0", "--sync-every must be at least 1"},
		{"serve --memory host-shm --device cuda", "--memory host-shm keeps the pools in host memory"},
		{"serve --enable-auto-tool-choice --tool-call-parser llama3_json", `--tool-call-parser "llama3_json": frmps's front door implements hermes`},
		{"serve --enable-auto-tool-choice", "--enable-auto-tool-choice requires --tool-call-parser"},
	} {
		cmd := exec.Command(os.Args[0], "-test.run=^TestServeBadOptionExitsAtOnce$")
		cmd.Env = append(os.Environ(), "FRMPS_TEST_MAIN=1", "FRMPS_TEST_ARGS="+tc.args+" --no-mps --python "+noPython)
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		start := time.Now()
		err := cmd.Run()
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.ExitCode() != 1 {
			t.Fatalf("%s: exit %v, want status 1; stderr %s", tc.args, err, stderr.String())
		}
		out := strings.TrimSpace(stderr.String())
		if strings.Count(out, "\n") != 0 || !strings.HasPrefix(out, "frmps: "+tc.want) {
			t.Errorf("%s: want one line starting %q, got:\n%s", tc.args, "frmps: "+tc.want, out)
		}
		if d := time.Since(start); d > 30*time.Second {
			t.Errorf("%s: refused after %s", tc.args, d)
		}
	}
}

// Every flag's default is the deployment's default (supervisor.DefaultConfig):
// serve keeps no defaults of its own for what the supervisor runs.
func TestServeFlagDefaultsAreTheConfigs(t *testing.T) {
	got := parseServe(t).supervisorConfig(pythonEnv{})
	want := supervisor.DefaultConfig()
	got.BaseEnv, got.EngineArgs = nil, nil // serve's: the interpreter's environment, --engine-arg with --vllm-arg
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("serve's defaults\n%+v\nthe config's\n%+v", got, want)
	}
}

// The --config file's values go through the flags: each key is its flag's
// name (lists for the repeatable flags), checked for its flag's type.
func TestConfigFileKeys(t *testing.T) {
	o := parseServe(t, "--config", writeConfig(t, `{"engine_args":["--a","--b"],"vllm_args":["--c"],"frontend":"vllm","frontend_args":["--d"],
		"max_restarts":3,"gpu_memory_utilization":0.5,"ring_capacity":65536,"mps_control":"/opt/mps","engine_log_dir":"/logs","no_failback":true,"failback_delay":"2s","model":null}`))
	if !slices.Equal(o.EngineArgs, []string{"--a", "--b"}) || !slices.Equal(o.VllmArgs, []string{"--c"}) || !slices.Equal(o.FrontendArgs, []string{"--d"}) ||
		o.Frontend != "vllm" || o.Breaker.MaxRestarts != 3 || o.GPUMemoryUtilization != 0.5 || o.RingCapacity != 65536 ||
		o.MPSControlBinary != "/opt/mps" || o.LogDir != "/logs" || !o.NoFailback || o.FailbackDelay != 2*time.Second || o.Model != "" {
		t.Fatalf("%+v", o)
	}
	// A flag given wins over its key, lists included.
	o = parseServe(t, "--config", writeConfig(t, `{"engine_args":["--a"],"port":9000}`), "--engine-arg", "--z")
	if !slices.Equal(o.EngineArgs, []string{"--z"}) || o.Port != 9000 {
		t.Fatalf("engine args %q port %d", o.EngineArgs, o.Port)
	}
	// Under either of its names.
	o = parseServe(t, "--config", writeConfig(t, `{"stall_timeout":"9s"}`), "--heartbeat-timeout", "3s")
	if o.HeartbeatTimeout != 3*time.Second {
		t.Fatalf("heartbeat timeout %s, want the flag's 3s", o.HeartbeatTimeout)
	}
	for _, body := range []string{`{"sync_every":"8"}`, `{"model":5}`, `{"no_mps":"yes"}`, `{"engine_args":"--a"}`, `{"engine_arg":["--a"]}`,
		`{"sync-every":8}`, `{"config":"other.json"}`, `{"restart_window":60}`, `[]`} {
		if err := applyConfigFile(newServeCmd().Flags(), writeConfig(t, body)); err == nil {
			t.Errorf("%s accepted", body)
		}
	}
}
