package engine

import (
	"errors"
	"fmt"
	"strconv"
)

// Role of an engine process, as the engine CLI spells it.
type Role string

const (
	RoleActive  Role = "active"
	RoleStandby Role = "standby"
)

// Invocation is what the supervisor knows about one engine launch; the
// adapter turns it into a command line. Everything engine-specific stays in
// the adapter and the engine.
type Invocation struct {
	Role             Role
	Model            string
	ControlSocket    string
	GenerationSocket string
	// CoreInput/CoreOutput (both or neither): the engine serves vLLM's
	// engine-core protocol to vLLM's API server at these addresses instead of
	// the generation API at GenerationSocket (`frmps serve --frontend vllm`).
	CoreInput, CoreOutput string
	Memory                string // host-shm | cuda-vmm
	Device                string // cpu | cuda (empty: the engine's default)
	NumBlocks             int    // 0: the engine's default
	MaxModelLen           int    // 0: the engine's default
	// GPUMemoryUtilization (0: not passed): the engine CLI's --gpu-memory-utilization.
	GPUMemoryUtilization float64
	// TensorParallelSize > 1: the engine process is rank 0 of a group of this
	// many ranks (0 or 1: one process).
	TensorParallelSize int
	ExtraArgs          []string
}

// Adapter builds the command line of one engine kind.
type Adapter interface {
	Name() string
	Command(inv Invocation) (path string, args []string, err error)
}

// PythonCLI runs `python -m frmps_engine.cli serve --engine <Engine> …`,
// the engine CLI shared by every Python engine (the reference engine, the
// vLLM adapter, an adapter named package.module:Factory).
type PythonCLI struct {
	Engine string // the engine CLI's --engine: ref, vllm or package.module:Factory
	Python string // interpreter; "python3" when empty
}

var _ Adapter = PythonCLI{}

// NewAdapter returns the adapter for --engine. The engine CLI owns engine
// names (frmps_engine.sdk.adapters; frmps serve asks it once before it
// starts), so any name is passed through.
func NewAdapter(engine, python string) (Adapter, error) {
	if engine == "" {
		return nil, errors.New("no engine named")
	}
	return PythonCLI{Engine: engine, Python: python}, nil
}

func (a PythonCLI) Name() string { return a.Engine }

func (a PythonCLI) Command(inv Invocation) (string, []string, error) {
	if inv.Role != RoleActive && inv.Role != RoleStandby {
		return "", nil, fmt.Errorf("engine role %q is neither active nor standby", inv.Role)
	}
	if inv.Model == "" || inv.ControlSocket == "" || inv.GenerationSocket == "" {
		return "", nil, fmt.Errorf("engine invocation needs model, control and generation sockets")
	}
	py := a.Python
	if py == "" {
		py = "python3"
	}
	args := []string{"-m", "frmps_engine.cli", "serve",
		"--engine", a.Engine,
		"--role", string(inv.Role),
		"--model", inv.Model,
		"--control-socket", inv.ControlSocket,
	}
	switch {
	case inv.CoreInput != "" && inv.CoreOutput != "":
		args = append(args, "--core-input", inv.CoreInput, "--core-output", inv.CoreOutput)
	case inv.CoreInput != "" || inv.CoreOutput != "":
		return "", nil, fmt.Errorf("engine invocation needs both engine-core addresses or neither")
	default:
		args = append(args, "--generation-socket", inv.GenerationSocket)
	}
	if inv.Memory != "" {
		args = append(args, "--memory", inv.Memory)
	}
	if inv.Device != "" {
		args = append(args, "--device", inv.Device)
	}
	if inv.NumBlocks > 0 {
		args = append(args, "--num-blocks", strconv.Itoa(inv.NumBlocks))
	}
	if inv.MaxModelLen > 0 {
		args = append(args, "--max-model-len", strconv.Itoa(inv.MaxModelLen))
	}
	if inv.GPUMemoryUtilization > 0 {
		args = append(args, "--gpu-memory-utilization", strconv.FormatFloat(inv.GPUMemoryUtilization, 'g', -1, 64))
	}
	if inv.TensorParallelSize > 1 {
		args = append(args, "--tensor-parallel-size", strconv.Itoa(inv.TensorParallelSize))
	}
	return py, append(args, inv.ExtraArgs...), nil
}
