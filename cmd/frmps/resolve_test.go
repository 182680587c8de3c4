package main

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// noGPU makes runServe's GPU probe say there is none, for the test.
func noGPU(t *testing.T) {
	t.Helper()
	serveGPUProbe = func() (bool, string) { return false, "test: no GPU" }
	t.Cleanup(func() { serveGPUProbe = nil })
}

func TestResolveChoices(t *testing.T) {
	gpu := func() (bool, string) { return true, "fake: 1 GPU" }
	none := func() (bool, string) { return false, "fake: none" }
	v026 := vllmInfo{Version: "0.26.0"}
	noVLLM := vllmInfo{Why: "vLLM is not installed in this interpreter"}
	for _, tc := range []struct {
		name                          string
		gpu                           gpuProbe
		device, memory, engine, model string
		vllm                          vllmInfo
		want                          choices // Why: a substring
		err                           string
	}{
		{"GPU and vLLM: the issue's command", gpu, auto, auto, auto, "qwen2.5-14b", v026,
			choices{"cuda", "cuda-vmm", "vllm", "qwen2.5-14b", "vLLM 0.26.0 installed"}, ""},
		{"GPU and vLLM, bare", gpu, auto, auto, auto, "", v026,
			choices{"cuda", "cuda-vmm", "vllm", "qwen2.5-0.5b", "model qwen2.5-0.5b is the vllm engine's default"}, ""},
		{"GPU without vLLM: the reference engine, said", gpu, auto, auto, auto, "", noVLLM,
			choices{"cuda", "cuda-vmm", "ref", "tiny", "vLLM not usable (vLLM is not installed in this interpreter): the reference engine"}, ""},
		{"no GPU: the CPU path as before", none, auto, auto, auto, "", v026,
			choices{"cpu", "host-shm", "ref", "tiny", "no GPU visible (fake: none)"}, ""},
		{"no GPU, a model given", none, auto, auto, auto, "qwen2.5-0.5b", noVLLM,
			choices{"cpu", "host-shm", "ref", "qwen2.5-0.5b", "the reference engine on the CPU"}, ""},
		{"explicit flags win over a GPU", gpu, "cpu", "host-shm", "ref", "", v026,
			choices{"cpu", "host-shm", "ref", "tiny", "--device cpu given"}, ""},
		{"explicit engine on an auto GPU", gpu, auto, auto, "ref", "tiny", v026,
			choices{"cuda", "cuda-vmm", "ref", "tiny", "GPU visible"}, ""},
		{"explicit vllm, auto memory", none, "cuda", auto, "vllm", "", noVLLM,
			choices{"cuda", "cuda-vmm", "vllm", "qwen2.5-0.5b", "--device cuda given"}, ""},
		{"an adapter factory needs --model", none, auto, auto, "pkg.mod:Factory", "", noVLLM, choices{}, "give --model"},
		{"an adapter factory with a model", none, auto, auto, "pkg.mod:Factory", "fake-tiny", noVLLM,
			choices{"cpu", "host-shm", "pkg.mod:Factory", "fake-tiny", "no GPU visible"}, ""},
		{"bad device", none, "tpu", auto, auto, "", noVLLM, choices{}, `--device "tpu"`},
		{"bad memory", none, auto, "vram", auto, "", noVLLM, choices{}, `--memory "vram"`},
		{"host-shm on a GPU", gpu, auto, "host-shm", auto, "", v026, choices{}, "--memory host-shm keeps the pools in host memory"},
		{"cuda-vmm on the CPU", none, auto, "cuda-vmm", auto, "", v026, choices{}, "--memory cuda-vmm maps the pools in GPU memory"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			probed := false
			probe := func() (bool, string) { probed = true; return tc.gpu() }
			device, why := resolveDevice(tc.device, probe)
			if probed != (tc.device == auto) {
				t.Fatalf("GPU probed %v with --device %s", probed, tc.device)
			}
			got, err := resolveChoices(device, why, tc.memory, tc.engine, tc.model, tc.vllm)
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("err %v, want %q", err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			w := tc.want
			if got.Device != w.Device || got.Memory != w.Memory || got.Engine != w.Engine || got.Model != w.Model || !strings.Contains(got.Why, w.Why) {
				t.Fatalf("got %s\nwant device=%s memory=%s engine=%s model=%s, why containing %q", got, w.Device, w.Memory, w.Engine, w.Model, w.Why)
			}
			if strings.Contains(got.String(), "\n") || !strings.HasPrefix(got.String(), "device=") {
				t.Fatalf("not one line: %q", got.String())
			}
		})
	}
}

// The host probe: CUDA_VISIBLE_DEVICES="" or "-1" hides every GPU; else
// nvidia-smi -L decides, and without nvidia-smi a /dev/nvidia<N> node.
func TestHostGPU(t *testing.T) {
	dir := t.TempDir()
	smi := func(body string) string {
		p := filepath.Join(dir, strings.ReplaceAll(body[:8], " ", "_")+"-smi")
		if err := os.WriteFile(p, []byte("#!/bin/sh\n"+body+"\n"), 0o755); err != nil {
			t.Fatal(err)
		}
		return p
	}
	lists := smi(`echo "GPU 0: NVIDIA H200 (UUID: GPU-1)"; echo "GPU 1: NVIDIA H200 (UUID: GPU-2)"`)
	empty := smi(`echo "No devices found"; exit 6`)
	devs := filepath.Join(dir, "dev")
	if err := os.Mkdir(devs, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(devs, "nvidia0"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	missing := filepath.Join(dir, "no-such-smi")
	env := func(kv ...string) func(string) (string, bool) {
		return func(k string) (string, bool) {
			for i := 0; i+1 < len(kv); i += 2 {
				if kv[i] == k {
					return kv[i+1], true
				}
			}
			return "", false
		}
	}
	for _, tc := range []struct {
		name    string
		lookup  func(string) (string, bool)
		smi     string
		glob    string
		visible bool
		how     string
	}{
		{"nvidia-smi lists two", env(), lists, filepath.Join(devs, "none*"), true, "lists 2"},
		{"CUDA_VISIBLE_DEVICES empty", env("CUDA_VISIBLE_DEVICES", ""), lists, "", false, "hides every GPU"},
		{"CUDA_VISIBLE_DEVICES -1", env("CUDA_VISIBLE_DEVICES", "-1"), lists, "", false, "hides every GPU"},
		{"CUDA_VISIBLE_DEVICES names one", env("CUDA_VISIBLE_DEVICES", "GPU-1"), lists, "", true, "lists 2"},
		{"nvidia-smi finds none", env(), empty, filepath.Join(devs, "nvidia[0-9]*"), false, "lists none"},
		{"no nvidia-smi, a device node", env(), missing, filepath.Join(devs, "nvidia[0-9]*"), true, "present"},
		{"no nvidia-smi, no device node", env(), missing, filepath.Join(devs, "none*"), false, "no nvidia-smi"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			visible, how := hostGPU(context.Background(), tc.lookup, tc.smi, tc.glob)()
			if visible != tc.visible || !strings.Contains(how, tc.how) {
				t.Fatalf("visible %v (%s), want %v (%q)", visible, how, tc.visible, tc.how)
			}
		})
	}
}
