package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/frmps/frmps/supervisor"
)

// `frmps serve`'s "auto" defaults. --device, --memory and --engine default to
// auto and --model to "" (the engine's default model; supervisor.DefaultConfig):
// on a host with a visible GPU, serve runs vLLM on it (the reference engine
// where vLLM is not installed), and on a host without one the reference engine
// on the CPU, as before. A flag given explicitly is taken as given. What
// depends on the host (a GPU, vLLM) is resolved here; the rest is the
// supervisor's (DefaultMemory, DefaultModel, CheckPlacement).

const auto = supervisor.Auto

// gpuProbe says whether a GPU is visible to the engines, and how it knows.
type gpuProbe func() (visible bool, how string)

// vllmInfo is what the engine interpreter's preflight found about vLLM:
// its installed version, "" when it is not usable, with why.
type vllmInfo struct {
	Version string
	Why     string
}

// choices is what serve resolved: the device, memory backend, engine and
// model, and one line saying why.
type choices struct {
	Device, Memory, Engine, Model string
	Why                           string
}

func (c choices) String() string {
	return fmt.Sprintf("device=%s memory=%s engine=%s model=%s (why: %s)", c.Device, c.Memory, c.Engine, c.Model, c.Why)
}

// resolveDevice resolves --device auto with the GPU probe (called only then).
func resolveDevice(device string, gpu gpuProbe) (string, string) {
	if device != auto {
		return device, "--device " + device + " given"
	}
	visible, how := gpu()
	if visible {
		return "cuda", "GPU visible (" + how + ")"
	}
	return "cpu", "no GPU visible (" + how + ")"
}

// resolveChoices is the whole resolution, a pure function of the options as
// given (device already through resolveDevice, with deviceWhy) and what the
// engine interpreter has (vllm). Explicit values win; auto follows the host:
//
//	memory auto: cuda-vmm on cuda, host-shm on the CPU (supervisor.DefaultMemory)
//	engine auto: vllm on cuda where vLLM is installed, else ref
//	model "":    the engine's default (supervisor.DefaultModel)
func resolveChoices(device, deviceWhy, memory, engine, model string, vllm vllmInfo) (choices, error) {
	c := choices{Device: device, Memory: memory, Engine: engine, Model: model}
	why := []string{deviceWhy}
	if c.Memory == auto {
		c.Memory = supervisor.DefaultMemory(c.Device)
	}
	if c.Engine == auto {
		switch {
		case !strings.HasPrefix(c.Device, "cuda"):
			c.Engine = "ref"
			why = append(why, "the reference engine on the CPU")
		case vllm.Version != "":
			c.Engine = "vllm"
			why = append(why, "vLLM "+vllm.Version+" installed")
		default:
			c.Engine = "ref"
			why = append(why, "vLLM not usable ("+vllm.Why+"): the reference engine; install vLLM or pass --engine")
		}
	}
	if c.Model == "" {
		m, ok := supervisor.DefaultModel(c.Engine)
		if !ok {
			ref, _ := supervisor.DefaultModel("ref")
			vllm, _ := supervisor.DefaultModel("vllm")
			return c, fmt.Errorf("--engine %s: give --model (the default models are for the built-in engines: %s for ref, %s for vllm)",
				c.Engine, ref, vllm)
		}
		c.Model = m
		why = append(why, "model "+c.Model+" is the "+c.Engine+" engine's default (pass --model to choose)")
	}
	c.Why = strings.Join(why, "; ")
	return c, supervisor.CheckPlacement(c.Device, c.Memory)
}

// hostGPU is the real GPU probe: no GPU when CUDA_VISIBLE_DEVICES hides them
// all ("" or "-1", as CUDA reads it); else one when `nvidia-smi -L` lists
// one, or, without nvidia-smi, when a /dev/nvidia<N> device node exists.
func hostGPU(ctx context.Context, lookup func(string) (string, bool), smi string, devGlob string) gpuProbe {
	return func() (bool, string) {
		if v, ok := lookup("CUDA_VISIBLE_DEVICES"); ok {
			if t := strings.TrimSpace(v); t == "" || t == "-1" {
				return false, fmt.Sprintf("CUDA_VISIBLE_DEVICES=%q hides every GPU", v)
			}
		}
		if smi == "" {
			smi = "nvidia-smi"
		}
		if path, err := exec.LookPath(smi); err == nil {
			ctx, cancel := context.WithTimeout(ctx, 20*time.Second)
			defer cancel()
			out, err := exec.CommandContext(ctx, path, "-L").Output()
			n := 0
			for _, l := range strings.Split(string(out), "\n") {
				if strings.HasPrefix(l, "GPU ") {
					n++
				}
			}
			var ee *exec.ExitError
			switch {
			case n > 0:
				return true, fmt.Sprintf("nvidia-smi -L lists %d", n)
			case err == nil || errors.As(err, &ee):
				return false, "nvidia-smi -L lists none"
			}
		}
		if devGlob == "" {
			devGlob = "/dev/nvidia[0-9]*"
		}
		if m, _ := filepath.Glob(devGlob); len(m) > 0 {
			return true, fmt.Sprintf("%s present, no nvidia-smi", m[0])
		}
		return false, "no nvidia-smi and no /dev/nvidia<N>"
	}
}

// realGPU probes this host.
func realGPU(ctx context.Context) gpuProbe { return hostGPU(ctx, os.LookupEnv, "", "") }
