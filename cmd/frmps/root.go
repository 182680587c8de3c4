package main

import (
	"fmt"

	"github.com/spf13/cobra"

	"github.com/frmps/frmps/supervisor/buildinfo"
)

func newRootCmd() *cobra.Command {
	root := &cobra.Command{
		Use:           "frmps",
		Short:         "Keep LLM serving alive through GPU faults on shared GPUs",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.AddCommand(newVersionCmd(), newServeCmd(), newStatusCmd(), newBenchCmd(), newModelCmd())
	return root
}

func newVersionCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "version",
		Short: "Print version, commit and Go version",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			_, err := fmt.Fprintln(cmd.OutOrStdout(), buildinfo.Get())
			return err
		},
	}
}
