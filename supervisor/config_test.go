package supervisor

import (
	"errors"
	"math"
	"reflect"
	"strings"
	"testing"

	"github.com/frmps/frmps/ringbuf"
)

func TestDefaultConfigIsValid(t *testing.T) {
	d := DefaultConfig()
	if err := d.Validate(); err != nil {
		t.Fatalf("DefaultConfig: %v", err)
	}
	// Auto and the empty model are serve's to resolve: New refuses them.
	if err := d.validate(); err == nil {
		t.Fatal("an unresolved config would run")
	}
	d.Device, d.Memory, d.Engine, d.Model = "cpu", "host-shm", "ref", "tiny"
	if err := d.validate(); err != nil {
		t.Fatalf("resolved: %v", err)
	}
}

// A Config built in code gets DefaultConfig's value for every field it leaves
// at zero where zero means the default: New and frmps serve run the same
// defaults.
func TestSetDefaultsAreDefaultConfigs(t *testing.T) {
	var c Config
	c.setDefaults()
	d := DefaultConfig()
	// Fields whose zero value is a choice of its own, or which serve resolves.
	own := map[string]bool{"Engine": true, "Device": true, "Memory": true, "StateDir": true, "MPSControlBinary": true, "Spare": true, "BaseEnv": true}
	cv, dv := reflect.ValueOf(c), reflect.ValueOf(d)
	for i := range cv.NumField() {
		name := cv.Type().Field(i).Name
		if own[name] {
			continue
		}
		if !reflect.DeepEqual(cv.Field(i).Interface(), dv.Field(i).Interface()) {
			t.Errorf("%s: New's default %v, DefaultConfig's %v", name, cv.Field(i).Interface(), dv.Field(i).Interface())
		}
	}
	if c.Device != "cpu" || c.Memory != "host-shm" || c.BaseEnv == nil {
		t.Errorf("device %q memory %q env %v", c.Device, c.Memory, c.BaseEnv != nil)
	}
	c = Config{Device: "cuda"}
	if c.setDefaults(); c.Memory != "cuda-vmm" {
		t.Errorf("memory %q on cuda", c.Memory)
	}
	// A value given is kept.
	c = Config{SyncEvery: 4, RingCapacity: 1 << 16, Spares: 2}
	if c.setDefaults(); c.SyncEvery != 4 || c.RingCapacity != 1<<16 || c.Spares != 2 {
		t.Errorf("%+v", c)
	}
}

// The ring capacity has one rule, the ring's own: what Validate accepts,
// ringbuf.Create accepts.
func TestValidateRingCapacity(t *testing.T) {
	for _, capacity := range []uint64{0, 4095, 5000000, 6144, 1 << 35} {
		c := DefaultConfig()
		c.RingCapacity = capacity
		err := c.Validate()
		if !errors.Is(err, ringbuf.ErrCapacity) || !strings.Contains(err.Error(), "--ring-capacity") {
			t.Errorf("capacity %d: %v", capacity, err)
		}
	}
	for _, capacity := range []uint64{4096, 8 << 20, 1 << 34} {
		c := DefaultConfig()
		c.RingCapacity = capacity
		if err := c.Validate(); err != nil {
			t.Errorf("capacity %d: %v", capacity, err)
		}
	}
}

func TestValidateRejects(t *testing.T) {
	for _, tc := range []struct {
		mod  func(*Config)
		want string
	}{
		{func(c *Config) { c.Engine = "" }, "--engine"},
		{func(c *Config) { c.SyncEvery = 0 }, "--sync-every"},
		{func(c *Config) { c.GPUMemoryUtilization = 0 }, "--gpu-memory-utilization"},
		{func(c *Config) { c.GPUMemoryUtilization = math.NaN() }, "--gpu-memory-utilization"},
		{func(c *Config) { c.GPUMemoryUtilization = 1.01 }, "--gpu-memory-utilization"},
		{func(c *Config) { c.Spare = "maybe" }, "--spare"},
		{func(c *Config) { c.Spares = 0 }, "--spares"},
		{func(c *Config) { c.Spares = MaxSpares + 1 }, "--spares"},
		{func(c *Config) { c.TensorParallelSize = 0 }, "--tensor-parallel-size"},
		{func(c *Config) { c.PrimeFaultPath, c.NoMPS = true, true }, "--prime-fault-path"},
		{func(c *Config) { c.FailbackDelay = -1 }, "--failback-delay"},
		{func(c *Config) { c.MPSPipeDir, c.NoMPS = "/op/mps", true }, "choose one"},
		{func(c *Config) { c.MPSPipeDir = "op/mps" }, "absolute"},
		{func(c *Config) { c.MPSLogDir = "/op/log" }, "--mps-pipe-dir"},
		{func(c *Config) { c.HeartbeatTimeout = 0 }, "--heartbeat-timeout"},
		{func(c *Config) { c.StepTimeoutFactor = math.NaN() }, "--step-timeout-factor"},
		{func(c *Config) { c.StepTimeoutMin = 0 }, "--step-timeout-min"},
		{func(c *Config) { c.Breaker.Window = 0 }, "--restart-window"},
		{func(c *Config) { c.Device = "" }, "--device"},
		{func(c *Config) { c.Device = "cuda:0" }, "--device"},
		{func(c *Config) { c.Memory = "vram" }, "--memory"},
		{func(c *Config) { c.Device, c.Memory = "cpu", "cuda-vmm" }, "--memory cuda-vmm"},
		{func(c *Config) { c.Device, c.Memory = "cuda", "host-shm" }, "--memory host-shm"},
	} {
		c := DefaultConfig()
		tc.mod(&c)
		if err := c.Validate(); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: %v, want %q", c, err, tc.want)
		}
	}
}
