package main

import (
	"testing"
	"time"
)

// The systemd unit's example config is one frmps serve accepts.
func TestSystemdExampleConfig(t *testing.T) {
	opts := parseServe(t, "--config", "../../deploy/systemd/frmps.json")
	if err := opts.validate(); err != nil {
		t.Fatal(err)
	}
	if opts.Device != "cuda" || opts.Memory != "cuda-vmm" || opts.ShutdownGrace != 30*time.Second || opts.RunDir == "" {
		t.Fatalf("%+v", opts)
	}
}
