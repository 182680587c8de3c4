package main

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/spf13/cobra"
)

// servingModule is the Python driver of `frmps bench serving`. It lives in the
// source checkout's bench/serving (beside the proofs it reuses), not in the
// engine package, so the checkout's root goes on PYTHONPATH.
const servingModule = "bench.serving"

// servingRootFor finds the checkout that holds bench/serving for the binary at
// exe (<checkout>/bin/frmps); a variable so that tests can point it elsewhere.
var servingRootFor = func(exe string) (string, error) {
	root := filepath.Dir(filepath.Dir(exe))
	if exe == "" || !isFile(filepath.Join(root, "bench", "serving", "__main__.py")) {
		return "", fmt.Errorf("frmps bench serving runs the source checkout's bench/serving: %s is not bin/frmps of a checkout "+
			"that has it (build it there with make go-build)", exe)
	}
	return root, nil
}

func newBenchServingCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "serving <sweep|faults|report> [flags]",
		Short: "Serving throughput, TTFT, TPOT and goodput beside vllm serve (vLLM's own bench client), with and without faults",
		Long: `Compare frmps serve with vllm serve under the same request stream, measured by
vLLM's own serving benchmark client (vllm bench serve): vllm serve alone, vllm
serve as an MPS client, frmps serve --model M, and frmps serve --frontend vllm,
at a sweep of Poisson request rates (sweep), or at one rate while a co-located
MPS client faults at a fixed spacing (faults). Every flag goes to the Python
driver (python -m ` + servingModule + ` in this binary's source checkout):

  frmps bench serving sweep --model DIR --out RESULTS [--rates 2,8,32,inf] [--dry-run]
  frmps bench serving faults --model DIR --out RESULTS [--spacing-s 60,15] [--dry-run]
  frmps bench serving report RESULTS
  frmps bench serving sweep --help

The driver's interpreter is --python (also the one that runs vllm serve and the
engines), else $FRMPS_PYTHON, else the checkout's .venv, else python3.`,
		DisableFlagParsing:    true,
		DisableFlagsInUseLine: true,
		RunE: func(cmd *cobra.Command, args []string) error {
			if len(args) == 0 {
				return errors.New("frmps bench serving: give sweep, faults or report (--help: the driver's help)")
			}
			if args[0] == "-h" || args[0] == "--help" {
				return cmd.Help()
			}
			self, err := os.Executable()
			if err != nil {
				return fmt.Errorf("find the frmps binary: %w", err)
			}
			root, err := servingRootFor(selfPath())
			if err != nil {
				return err
			}
			py := findPython(pythonArg(args), selfPath(), os.Environ())
			py.Env = prependPath(py.Env, "PYTHONPATH", root)
			return runBench(py, servingArgv(self, args), cmd.InOrStdin(), cmd.OutOrStdout(), cmd.ErrOrStderr())
		},
	}
}

// servingArgv is the driver's command line: the subcommand, this binary as
// --frmps for those that start servers (a later --frmps in args wins), then
// the user's arguments.
func servingArgv(self string, args []string) []string {
	argv := []string{"-m", servingModule, args[0]}
	if args[0] == "sweep" || args[0] == "faults" {
		argv = append(argv, "--frmps", self)
	}
	return append(argv, args[1:]...)
}

// pythonArg is the value of the last --python in args ("" if none): the
// interpreter the driver itself runs in as well.
func pythonArg(args []string) string {
	v := ""
	for i, a := range args {
		switch {
		case a == "--":
			return v
		case a == "--python" && i+1 < len(args):
			v = args[i+1]
		case strings.HasPrefix(a, "--python="):
			v = strings.TrimPrefix(a, "--python=")
		}
	}
	return v
}
