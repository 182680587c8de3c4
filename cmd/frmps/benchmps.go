package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/spf13/cobra"

	"github.com/frmps/frmps/supervisor/mps"
)

// newBenchMPSCmd gives the bench driver the supervisor's own MPS handling for
// the daemons it needs besides frmps serve's: a private daemon per baseline
// victim, the outside-MPS environment of engines that must join no daemon, and
// the cleanup of a killed frmps serve's daemon. The checks are the
// supervisor's: private 0700 directories owned by us, a stale daemon in the
// same directories quit first, every control command under a timeout, a daemon
// that ignores quit killed through its pid file.
func newBenchMPSCmd() *cobra.Command {
	var runDir, control string
	var timeout time.Duration
	cmd := &cobra.Command{
		Use:   "mps",
		Short: "MPS daemons for the bench driver, through the supervisor's MPS handling",
		Long: `The bench driver's MPS daemons, handled as frmps serve handles its own:

  frmps bench mps start --run-dir DIR        start a private daemon in DIR/mps; prints its client environment
  frmps bench mps stop --run-dir DIR         stop the daemon started there (nothing to do if none answers)
  frmps bench mps outside-env --run-dir DIR  prints an environment in which CUDA runs outside any MPS daemon

The environment is printed as NAME=VALUE lines. DIR must exist.`,
	}
	cmd.PersistentFlags().StringVar(&runDir, "run-dir", "", "directory the daemon's pipe and log directories go under (must exist)")
	cmd.PersistentFlags().StringVar(&control, "mps-control", mps.DefaultControlBinary, "the MPS control program")
	cmd.PersistentFlags().DurationVar(&timeout, "timeout", mps.DefaultStartTimeout, "bound of a start or a stop")
	cfg := func() (mps.Config, error) {
		if runDir == "" {
			return mps.Config{}, fmt.Errorf("--run-dir is required")
		}
		fi, err := os.Stat(runDir)
		if err != nil {
			return mps.Config{}, fmt.Errorf("--run-dir: %w", err)
		}
		if !fi.IsDir() {
			return mps.Config{}, fmt.Errorf("--run-dir %s is not a directory", runDir)
		}
		if timeout <= 0 {
			timeout = mps.DefaultStartTimeout
		}
		return mps.Config{ControlBinary: control, RunDir: runDir, StartTimeout: timeout}, nil
	}
	logger := func(w io.Writer) hclog.Logger {
		return hclog.New(&hclog.LoggerOptions{Name: "frmps-bench", Output: w, Level: hclog.Info})
	}
	cmd.AddCommand(&cobra.Command{
		Use:   "start",
		Short: "Start a private MPS daemon under --run-dir and print its client environment",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := cfg()
			if err != nil {
				return err
			}
			d, err := mps.Start(cmd.Context(), c, logger(cmd.ErrOrStderr()))
			if err != nil {
				return err
			}
			return printEnv(cmd.OutOrStdout(), d.ClientEnv())
		},
	})
	cmd.AddCommand(&cobra.Command{
		Use:   "stop",
		Short: "Stop the MPS daemon started under --run-dir",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := cfg()
			if err != nil {
				return err
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), 2*c.StartTimeout)
			defer cancel()
			return mps.StopLeftover(ctx, c, logger(cmd.ErrOrStderr()))
		},
	})
	cmd.AddCommand(&cobra.Command{
		Use:   "outside-env",
		Short: "Print an environment in which CUDA runs outside any MPS daemon",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := cfg()
			if err != nil {
				return err
			}
			env, err := mps.OutsideEnv(c.RunDir)
			if err != nil {
				return err
			}
			return printEnv(cmd.OutOrStdout(), env)
		},
	})
	return cmd
}

func printEnv(w io.Writer, env []string) error {
	for _, kv := range env {
		if _, err := fmt.Fprintln(w, kv); err != nil {
			return err
		}
	}
	return nil
}
