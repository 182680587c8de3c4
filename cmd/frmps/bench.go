package main

import (
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"syscall"

	"github.com/spf13/cobra"
)

// benchModule is the Python driver `frmps bench` runs: the bench package at
// the root of the source checkout (bench/), which holds the experiments,
// baselines and reports, apart from the engine package they measure.
const benchModule = "bench"

func newBenchCmd() *cobra.Command {
	var python string
	cmd := &cobra.Command{
		Use:   "bench [--python PY] <experiment|list|report> [experiment flags]",
		Short: "Measure recovery, sync overhead, outage, standby memory and correctness against the baselines",
		Long: `Run one experiment of the evaluation (or "list" them, or "report" to rewrite
the tables from result files). Everything after the experiment name goes to the
Python driver (python -m ` + benchModule + `), which starts frmps serve (this
binary), the baselines and the fault triggers itself:

  frmps bench list
  frmps bench recovery --models qwen2.5-0.5b,qwen2.5-14b --budget 500
  frmps bench correctness --cpu          # a CPU check of the harness
  frmps bench recovery --help            # the experiment's own flags

The interpreter is --python, else $FRMPS_PYTHON, else the .venv of the source
checkout holding this binary, else python3; frmps_engine and the bench package
must be importable there. A binary inside a checkout puts the checkout's
vllmpatch/src and its root (the bench package, bench/) on PYTHONPATH; another
one finds the bench package when run from the checkout's root. Results are
appended to bench/results/<date>-<gpu>/ as they are measured; re-running a
command resumes.`,
		Args:                  cobra.MinimumNArgs(1),
		DisableFlagsInUseLine: true,
		RunE: func(cmd *cobra.Command, args []string) error {
			self, err := os.Executable()
			if err != nil {
				return fmt.Errorf("find the frmps binary: %w", err)
			}
			exe := selfPath()
			py := benchPython(findPython(python, exe, os.Environ()), exe)
			return runBench(py, benchArgv(self, args), cmd.InOrStdin(), cmd.OutOrStdout(), cmd.ErrOrStderr())
		},
	}
	// Flags after the experiment name belong to the driver.
	cmd.Flags().SetInterspersed(false)
	cmd.Flags().StringVar(&python, "python", "", "Python interpreter that runs the bench driver and the engines (default: $FRMPS_PYTHON, else the checkout's .venv, else python3)")
	cmd.AddCommand(newBenchMPSCmd(), newBenchServingCmd())
	return cmd
}

// benchPython adds the root of the source checkout holding this binary
// (<checkout>/bin/frmps) to PYTHONPATH when the bench package is there, so
// that `python -m bench` finds it from any working directory. exe is this
// binary's path with symlinks resolved.
func benchPython(py pythonEnv, exe string) pythonEnv {
	root := filepath.Dir(filepath.Dir(exe))
	if exe != "" && isFile(filepath.Join(root, "bench", "__main__.py")) {
		py.Env = prependPath(py.Env, "PYTHONPATH", root)
	}
	return py
}

// benchArgv is the driver's command line: the experiment, this binary as
// --frmps (a later --frmps in args wins), then the user's arguments.
func benchArgv(self string, args []string) []string {
	argv := []string{"-m", benchModule, args[0]}
	if args[0] != "list" {
		argv = append(argv, "--frmps", self)
	}
	return append(argv, args[1:]...)
}

// exitError carries the driver's exit status (0 done, 2 a point failed, 3
// stopped by --budget) back to main without another message.
type exitError struct{ code int }

func (e exitError) Error() string { return fmt.Sprintf("bench driver exited with status %d", e.code) }

// runBench runs the driver in the foreground, passing SIGINT and SIGTERM on so
// that it stops its deployments and engines before it exits.
func runBench(py pythonEnv, argv []string, stdin io.Reader, stdout, stderr io.Writer) error {
	path, err := exec.LookPath(py.Python)
	if err != nil {
		return fmt.Errorf("bench needs Python with frmps_engine (--python or FRMPS_PYTHON): %w", err)
	}
	c := exec.Command(path, argv...)
	c.Env = py.Env
	c.Stdin, c.Stdout, c.Stderr = stdin, stdout, stderr
	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
	defer signal.Stop(sigs)
	if err := c.Start(); err != nil {
		return fmt.Errorf("start the bench driver: %w", err)
	}
	done := make(chan struct{})
	defer close(done)
	go func() {
		for {
			select {
			case s := <-sigs:
				_ = c.Process.Signal(s)
			case <-done:
				return
			}
		}
	}()
	err = c.Wait()
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		code := ee.ExitCode()
		if code < 0 { // killed by a signal
			code = 128 + int(ee.Sys().(syscall.WaitStatus).Signal())
		}
		return exitError{code}
	}
	if err != nil {
		return fmt.Errorf("bench driver: %w", err)
	}
	return nil
}
