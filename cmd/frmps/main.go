// Command frmps supervises an active/standby pair of LLM inference engines on
// one GPU and serves them behind an OpenAI-compatible endpoint.
package main

import (
	"errors"
	"fmt"
	"os"
)

func main() {
	if err := newRootCmd().Execute(); err != nil {
		var ee exitError
		if errors.As(err, &ee) { // a child (the bench driver) already said why
			os.Exit(ee.code)
		}
		fmt.Fprintln(os.Stderr, "frmps:", err)
		os.Exit(1)
	}
}
