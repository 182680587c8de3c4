// Command frmps supervises an active/standby pair of LLM inference engines on
// one GPU and serves them behind an OpenAI-compatible endpoint.
package main

import (
	"fmt"
	"os"
)

func main() {
	if err := newRootCmd().Execute(); err != nil {
		fmt.Fprintln(os.Stderr, "frmps:", err)
		os.Exit(1)
	}
}
