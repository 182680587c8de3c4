package mps

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os/exec"
	"strconv"
	"strings"
	"time"
)

// DefaultNvidiaSMI is the program CheckComputeMode asks. frmps is built
// without cgo, so NVML is reached through nvidia-smi rather than linked.
const DefaultNvidiaSMI = "nvidia-smi"

// smiTimeout bounds one nvidia-smi query (it answers in well under a second;
// a wedged driver must not hang the start).
const smiTimeout = 20 * time.Second

var (
	// ErrComputeModeUnknown: the mode could not be read (no nvidia-smi, it
	// failed, or its output was not understood). Callers warn and go on.
	ErrComputeModeUnknown = errors.New("gpu compute mode unknown")
	// ErrNoSecondContext: the GPU's compute mode leaves no room for the
	// standby's own CUDA context beside the active (or the MPS server).
	ErrNoSecondContext = errors.New("gpu compute mode allows no standby context")
)

// GPU is one GPU's compute mode as nvidia-smi reports it.
type GPU struct {
	Index int
	UUID  string
	Mode  string // Default, Exclusive_Process, Prohibited, …
}

// CheckComputeMode refuses the GPUs on which the standby could not hold a
// CUDA context of its own outside MPS: Exclusive_Process (one context per
// GPU: the MPS server's, or the active's), Exclusive_Thread (older drivers)
// and Prohibited (none). visible is the engines' CUDA_VISIBLE_DEVICES: when it
// names GPUs by index or UUID, only those are checked, else every GPU is.
func CheckComputeMode(ctx context.Context, smi, visible string) error {
	gpus, err := QueryComputeModes(ctx, smi)
	if err != nil {
		return err
	}
	for _, g := range selectVisible(gpus, visible) {
		switch g.Mode {
		case "Exclusive_Process", "Exclusive_Thread", "Prohibited":
			return fmt.Errorf("%w: GPU %d (%s) is in %s compute mode: the standby must hold its own CUDA context outside MPS beside the active; "+
				"set the GPU to Default (as root: nvidia-smi -i %d -c DEFAULT), or choose another GPU with CUDA_VISIBLE_DEVICES",
				ErrNoSecondContext, g.Index, g.UUID, g.Mode, g.Index)
		}
	}
	return nil
}

// QueryComputeModes runs `nvidia-smi --query-gpu=index,uuid,compute_mode`.
// Its errors wrap ErrComputeModeUnknown.
func QueryComputeModes(ctx context.Context, smi string) ([]GPU, error) {
	if smi == "" {
		smi = DefaultNvidiaSMI
	}
	bin, err := exec.LookPath(smi)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrComputeModeUnknown, err)
	}
	ctx, cancel := context.WithTimeout(ctx, smiTimeout)
	defer cancel()
	var out, stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, bin, "--query-gpu=index,uuid,compute_mode", "--format=csv,noheader")
	cmd.Stdout, cmd.Stderr = &out, &stderr
	cmd.WaitDelay = time.Second
	if err := cmd.Run(); err != nil {
		return nil, fmt.Errorf("%w: %s: %w: %s", ErrComputeModeUnknown, bin, err, lastLines(append(stderr.Bytes(), out.Bytes()...)))
	}
	var gpus []GPU
	for line := range strings.Lines(out.String()) {
		line = strings.TrimSpace(line)
		if line == "" {
			continue
		}
		f := strings.Split(line, ",")
		if len(f) != 3 {
			return nil, fmt.Errorf("%w: unexpected nvidia-smi line %q", ErrComputeModeUnknown, line)
		}
		idx, err := strconv.Atoi(strings.TrimSpace(f[0]))
		if err != nil {
			return nil, fmt.Errorf("%w: unexpected nvidia-smi line %q", ErrComputeModeUnknown, line)
		}
		gpus = append(gpus, GPU{Index: idx, UUID: strings.TrimSpace(f[1]), Mode: strings.TrimSpace(f[2])})
	}
	if len(gpus) == 0 {
		return nil, fmt.Errorf("%w: nvidia-smi listed no GPU", ErrComputeModeUnknown)
	}
	return gpus, nil
}

// selectVisible keeps the GPUs CUDA_VISIBLE_DEVICES names (an index, or a
// UUID or its prefix, as CUDA accepts); all of them when it is empty or
// names none of them (MIG instances, say).
func selectVisible(gpus []GPU, visible string) []GPU {
	var out []GPU
	for _, e := range strings.Split(visible, ",") {
		e = strings.TrimSpace(e)
		if e == "" {
			continue
		}
		for _, g := range gpus {
			if strconv.Itoa(g.Index) == e || (strings.HasPrefix(e, "GPU-") && strings.HasPrefix(g.UUID, e)) {
				out = append(out, g)
			}
		}
	}
	if len(out) == 0 {
		return gpus
	}
	return out
}

// VisibleByUUID rewrites the GPU indices of CUDA_VISIBLE_DEVICES (visible) as
// the GPUs' UUIDs, in the same order. Under MPS an index is ambiguous: a
// daemon started with CUDA_VISIBLE_DEVICES=2 remaps that GPU to index 0 for
// its clients, so an active inside MPS given "2" finds no GPU (NVIDIA's MPS
// guide: keeping the daemon's indices in a client's CUDA_VISIBLE_DEVICES
// "would lead to an error"), while the standby outside MPS needs "2". A UUID names the same GPU to the daemon, its
// clients and the standby (NVIDIA's MPS guide recommends UUIDs for this).
// Entries that are already UUIDs (GPU-…, MIG-…) stay as they are; visible
// comes back unchanged, with no nvidia-smi query, when it names no index.
// An index nvidia-smi does not list is an error (CUDA would stop enumerating
// there); so is a failed query (ErrComputeModeUnknown).
func VisibleByUUID(ctx context.Context, smi, visible string) (string, error) {
	entries := strings.Split(visible, ",")
	hasIndex := false
	for i, e := range entries {
		entries[i] = strings.TrimSpace(e)
		if _, err := strconv.Atoi(entries[i]); err == nil {
			hasIndex = true
		}
	}
	if !hasIndex {
		return visible, nil
	}
	gpus, err := QueryComputeModes(ctx, smi)
	if err != nil {
		return visible, err
	}
	byIndex := make(map[int]string, len(gpus))
	for _, g := range gpus {
		byIndex[g.Index] = g.UUID
	}
	for i, e := range entries {
		idx, err := strconv.Atoi(e)
		if err != nil {
			continue
		}
		uuid, ok := byIndex[idx]
		if !ok || uuid == "" {
			return visible, fmt.Errorf("CUDA_VISIBLE_DEVICES=%s names GPU %d, which nvidia-smi does not list (%d GPUs)", visible, idx, len(gpus))
		}
		entries[i] = uuid
	}
	return strings.Join(entries, ","), nil
}
