package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"time"

	"github.com/spf13/cobra"
)

// modelDirTimeout bounds writing a preset's model directory (its tokenizer is
// built from scratch: about a second).
const modelDirTimeout = 2 * time.Minute

func newModelCmd() *cobra.Command {
	python := os.Getenv("FRMPS_PYTHON")
	if python == "" {
		python = "python3"
	}
	var out string
	var force bool
	cmd := &cobra.Command{
		Use:   "model",
		Short: "Model directories for dummy-weight runs",
	}
	initCmd := &cobra.Command{
		Use:   "init PRESET",
		Short: "Write a Hugging Face model directory for a Qwen2.5 preset (config, tokenizer; no weights)",
		Long: `Write the model directory of a preset (qwen2.5-0.5b, -1.5b, -3b, -7b, -14b):
Qwen2.5's config.json of that size and a byte-level BPE tokenizer built
locally that covers the whole vocabulary. vLLM and the reference engine both
read it; with no weights in it they initialise random ("dummy") weights.
Prints the directory. Default place: $FRMPS_MODEL_CACHE, else
$XDG_CACHE_HOME/frmps/models/PRESET, else ~/.cache/frmps/models/PRESET; an
existing directory is kept unless --force.

frmps serve --engine vllm --model PRESET does this itself.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx, cancel := context.WithTimeout(cmd.Context(), modelDirTimeout)
			defer cancel()
			dir, err := modelDir(ctx, pythonEnv{Python: python}, args[0], out, force)
			if err != nil {
				return err
			}
			_, err = fmt.Fprintln(cmd.OutOrStdout(), dir)
			return err
		},
	}
	initCmd.Flags().StringVar(&out, "out", "", "directory to write (default: the model cache)")
	initCmd.Flags().BoolVar(&force, "force", false, "rewrite the directory if it exists")
	initCmd.Flags().StringVar(&python, "python", python, "Python interpreter with frmps_engine (and tokenizers)")
	cmd.AddCommand(initCmd)
	return cmd
}

// modelDir runs the engine package's model-dir writer and returns the
// directory it printed.
func modelDir(ctx context.Context, py pythonEnv, preset, out string, force bool) (string, error) {
	if ctx == nil {
		ctx = context.Background()
	}
	argv := []string{"-m", "frmps_engine.cli", "model-dir", preset}
	if out != "" {
		argv = append(argv, "--out", out)
	}
	if force {
		argv = append(argv, "--force")
	}
	var stdout, stderr bytes.Buffer
	c := exec.CommandContext(ctx, py.Python, argv...)
	c.Env = py.Env // nil: this process's
	c.Stdout, c.Stderr = &stdout, &stderr
	if err := c.Run(); err != nil {
		msg := strings.TrimSpace(stderr.String())
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
	return modelDir(ctx, py, model, "", false)
}
