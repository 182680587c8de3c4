package fakeengine

import (
	"context"
	"fmt"
	"os/exec"
	"path/filepath"
)

// CmdPackage is the import path of the fake engine's main package.
const CmdPackage = "github.com/frmps/frmps/supervisor/internal/fakeengine/cmd/fakeengine"

// BuildBinary compiles the fake engine command into dir and returns its
// path. Tests call it once (e.g. in TestMain) and launch the result as a
// real child process. It needs the go tool, which `go test` has.
func BuildBinary(ctx context.Context, dir string) (string, error) {
	out := filepath.Join(dir, "fakeengine")
	cmd := exec.CommandContext(ctx, "go", "build", "-o", out, CmdPackage)
	if b, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("build fake engine: %w: %s", err, b)
	}
	return out, nil
}
