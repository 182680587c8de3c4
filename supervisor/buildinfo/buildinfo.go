// Package buildinfo holds the version stamped into the binary at link time.
package buildinfo

import (
	"fmt"
	"runtime"
	"runtime/debug"
)

// Set with -ldflags "-X github.com/frmps/frmps/supervisor/buildinfo.Version=...".
var (
	Version = "dev"
	Commit  = ""
)

// Info describes this build.
type Info struct {
	Version   string
	Commit    string
	GoVersion string
}

// Get returns the build's version, commit and Go version. Without a linker
// stamp it falls back to the VCS revision Go embeds.
func Get() Info {
	commit := Commit
	if commit == "" {
		commit = "unknown"
		if bi, ok := debug.ReadBuildInfo(); ok {
			for _, s := range bi.Settings {
				if s.Key == "vcs.revision" {
					commit = s.Value
				}
			}
		}
	}
	return Info{Version: Version, Commit: commit, GoVersion: runtime.Version()}
}

func (i Info) String() string {
	return fmt.Sprintf("frmps %s (commit %s, %s)", i.Version, i.Commit, i.GoVersion)
}
