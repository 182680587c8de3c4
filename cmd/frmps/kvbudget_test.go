package main

import (
	"bytes"
	"math"
	"strings"
	"testing"
	"time"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
)

func TestGPUMemoryUtilizationFlag(t *testing.T) {
	if o := parseServe(t); o.GPUMemoryUtilization != 0.9 || o.validate() != nil {
		t.Fatalf("default %v (%v)", o.GPUMemoryUtilization, o.validate())
	}
	o := parseServe(t, "--gpu-memory-utilization", "0.5")
	if o.validate() != nil || o.supervisorConfig(pythonEnv{}).GPUMemoryUtilization != 0.5 {
		t.Fatalf("0.5 did not reach the supervisor: %+v", o.supervisorConfig(pythonEnv{}).GPUMemoryUtilization)
	}
	for _, bad := range []float64{0, -0.1, 1.01, math.NaN()} {
		o := defaultServeOptions()
		o.GPUMemoryUtilization = bad
		err := o.validate()
		if err == nil || !strings.Contains(err.Error(), "--gpu-memory-utilization") {
			t.Errorf("%v accepted (%v)", bad, err)
		}
		if err := runServe(t.Context(), o, &bytes.Buffer{}); err == nil {
			t.Errorf("runServe accepted --gpu-memory-utilization %v", bad)
		}
	}
}

func TestPrintStatusShowsTheKVBudget(t *testing.T) {
	b := &frmpsv1.KVBudget{GpuTotalBytes: 140 << 30, Utilization: 0.9, BudgetBytes: 126 << 30, WeightsBytes: 15 << 30,
		KvBytes: 100 << 30, NumBlocks: 117194, BlockBytes: 917504, ReservedBytes: 11 << 30, Source: "estimated",
		Reserved: map[string]uint64{"mps": 1 << 29, "contexts": 2 << 30}}
	st := &frmpsv1.Status{State: "serving_ready", Engines: []*frmpsv1.EngineStatus{
		{Role: "standby", KvBudget: &frmpsv1.KVBudget{NumBlocks: 1, Source: "--num-blocks"}},
		{Role: "active", KvBudget: b}}}
	var out bytes.Buffer
	if err := printStatus(&out, st, time.Unix(0, 0)); err != nil {
		t.Fatal(err)
	}
	want := "117194 blocks of 917504 bytes = 100.00 GiB (estimated); budget 126.00 GiB = 0.9 x 140.00 GiB: weights 15.00 GiB, reserved 11.00 GiB (contexts 2.00 GiB, mps 0.50 GiB)"
	if !strings.Contains(out.String(), "kv cache:") || !strings.Contains(out.String(), want) {
		t.Fatalf("status output lacks %q:\n%s", want, out.String())
	}
	out.Reset()
	if err := printStatus(&out, &frmpsv1.Status{}, time.Unix(0, 0)); err != nil || strings.Contains(out.String(), "kv cache") {
		t.Fatalf("a status without a budget: %q %v", out.String(), err)
	}
}
