//go:build !integration_pending

package supervisor

import (
	"errors"

	"github.com/hashicorp/go-hclog"
)

// defaultDeps: this build has not been linked with the control, ring, MPS
// and death-cause packages yet (see deps_real.go, behind the
// integration_pending build tag). Delete this file when removing that tag.
func defaultDeps(Config, hclog.Logger) (Deps, error) {
	return Deps{}, errors.New("supervisor: built without the control/ring/mps packages; build with -tags integration_pending")
}
