package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"
)

// modelDirTimeout bounds writing a preset's model directory (its tokenizer is
// built from scratch: about a second).
const modelDirTimeout = 2 * time.Minute

// seededDirTimeout bounds writing a directory with a seeded checkpoint: 30 GB
// for qwen2.5-14b, generated on the GPU when there is one, else on the CPU.
const seededDirTimeout = 2 * time.Hour

// modelDirOptions are model init's flags beyond the preset.
type modelDirOptions struct {
	Out     string
	Force   bool
	Weights string // "" or "none": config and tokenizer only; "seeded": also a seeded checkpoint
	Seed    int64
}

func newModelCmd() *cobra.Command {
	python := os.Getenv("FRMPS_PYTHON")
	if python == "" {
		python = "python3"
	}
	var opts modelDirOptions
	cmd := &cobra.Command{
		Use:   "model",
		Short: "Model directories: dummy-weight runs, or a seeded checkpoint (--weights seeded)",
	}
	initCmd := &cobra.Command{
		Use:   "init PRESET",
		Short: "Write a Hugging Face model directory for a Qwen2.5 preset (config, tokenizer; seeded weights with --weights seeded)",
		Long: `Write the model directory of a preset (qwen2.5-0.5b, -1.5b, -3b, -7b, -14b;
and, with --weights seeded, the test preset tiny): Qwen2.5's config.json of that size and a
byte-level BPE tokenizer built locally that covers the whole vocabulary.
vLLM and the reference engine both read it; with no weights in it they
initialise random ("dummy") weights.

--weights seeded also writes a seeded checkpoint (model.safetensors, or 5 GB
shards with model.safetensors.index.json; bfloat16; Qwen2ForCausalLM's tensor
names) whose weights are scaled like a trained model's, and frmps_weights.json
naming the generator and its seed. Its next-token distribution is peaked and
depends on the context, so greedy and seeded outputs show whether a KV cache
was carried over right: exactness checks, proofs and benchmarks use it, not
vLLM's dummy weights (uniform +-1e-3, whose output ignores the context).
vllm serve DIR and the reference engine load it with their own loaders. The
same (preset, seed) gives the same bytes on any device; it is generated on the
GPU when torch sees one (qwen2.5-14b: 30 GB), else on the CPU.

Prints the directory. Default place: $FRMPS_MODEL_CACHE, else
$XDG_CACHE_HOME/frmps/models, else ~/.cache/frmps/models; in it PRESET, or
PRESET-seeded-SEED with --weights seeded. An existing directory is kept unless
--force (with --weights seeded only if it holds that seed's checkpoint).

frmps serve --engine vllm --model PRESET writes the directory without weights itself.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			timeout := modelDirTimeout
			if opts.Weights == "seeded" {
				timeout = seededDirTimeout
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), timeout)
			defer cancel()
			dir, err := modelDir(ctx, pythonEnv{Python: python}, args[0], opts, cmd.ErrOrStderr())
			if err != nil {
				return err
			}
			_, err = fmt.Fprintln(cmd.OutOrStdout(), dir)
			return err
		},
	}
	initCmd.Flags().StringVar(&opts.Out, "out", "", "directory to write (default: the model cache)")
	initCmd.Flags().BoolVar(&opts.Force, "force", false, "rewrite the directory if it exists")
	initCmd.Flags().StringVar(&opts.Weights, "weights", "none",
		"none: config and tokenizer only; seeded: also a seeded checkpoint scaled like a trained model's")
	initCmd.Flags().Int64Var(&opts.Seed, "seed", 0, "seed of --weights seeded")
	initCmd.Flags().StringVar(&python, "python", python, "Python interpreter with frmps_engine (and tokenizers)")
	cmd.AddCommand(initCmd)
	return cmd
}

// modelDir runs the engine package's model-dir writer and returns the
// directory it printed. progress, if not nil, also gets the writer's stderr as
// it comes (the seeded checkpoint's progress lines).
func modelDir(ctx context.Context, py pythonEnv, preset string, opts modelDirOptions, progress io.Writer) (string, error) {
	if ctx == nil {
		ctx = context.Background()
	}
	switch opts.Weights {
	case "", "none", "seeded":
	default:
		return "", fmt.Errorf("--weights %q: want none or seeded", opts.Weights)
	}
	if opts.Seed < 0 {
		return "", fmt.Errorf("--seed %d: must be >= 0", opts.Seed)
	}
	argv := []string{"-m", "frmps_engine.cli", "model-dir", preset}
	if opts.Out != "" {
		argv = append(argv, "--out", opts.Out)
	}
	if opts.Force {
		argv = append(argv, "--force")
	}
	if opts.Weights == "seeded" {
		argv = append(argv, "--weights", "seeded", "--seed", strconv.FormatInt(opts.Seed, 10))
	}
	var stdout, stderr bytes.Buffer
	c := exec.CommandContext(ctx, py.Python, argv...)
	c.Env = py.Env // nil: this process's
	c.Stdout, c.Stderr = &stdout, &stderr
	if progress != nil {
		c.Stderr = io.MultiWriter(&stderr, progress)
	}
	if err := c.Run(); err != nil {
		msg := strings.TrimSpace(stderr.String())
		if progress != nil { // the whole stderr went there already: keep its last line
			msg = msg[strings.LastIndexByte(msg, '\n')+1:]
		}
		if msg == "" {
			msg = err.Error()
		}
		return "", fmt.Errorf("model directory for %q: %s", preset, msg)
	}
	dir := strings.TrimSpace(stdout.String())
	if dir == "" {
		return "", fmt.Errorf("model directory for %q: the writer printed no path", preset)
	}
	return dir, nil
}

// resolveVLLMModel turns a preset name into its model directory for vLLM,
// which reads only Hugging Face directories; an existing path is used as is.
func resolveVLLMModel(ctx context.Context, py pythonEnv, model string) (string, error) {
	if fi, err := os.Stat(model); err == nil {
		if !fi.IsDir() {
			return "", fmt.Errorf("--model %s: not a directory", model)
		}
		return model, nil
	}
	if strings.ContainsRune(model, os.PathSeparator) {
		return "", fmt.Errorf("--model %s: no such directory", model)
	}
	ctx, cancel := context.WithTimeout(ctx, modelDirTimeout)
	defer cancel()
	return modelDir(ctx, py, model, modelDirOptions{}, nil)
}
