package control

import (
	"errors"
	"fmt"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
)

// ProtocolVersion is the control protocol version this supervisor speaks.
const ProtocolVersion = frmpsv1.ProtocolVersion_PROTOCOL_VERSION_1

// ErrVersionMismatch is wrapped when an engine speaks another protocol version.
var ErrVersionMismatch = errors.New("protocol version mismatch")

// ErrLayoutMismatch is wrapped when two pool layouts differ.
var ErrLayoutMismatch = errors.New("pool layout mismatch")

// HelloExpect is what the supervisor expects an engine's Hello to say.
type HelloExpect struct {
	Role  frmpsv1.Role
	PID   int             // 0 = do not check (the socket's SO_PEERCRED was checked already)
	Model string          // "" = do not check
	Pools []*frmpsv1.Pool /* nil = any */
}

// ValidateHello checks an engine's Hello against what the supervisor expects.
// The error is meant for logs, status and the Welcome's refusal reason.
func ValidateHello(h *frmpsv1.Hello, want HelloExpect) error {
	if h == nil {
		return errors.New("hello: missing")
	}
	if v := h.GetProtocolVersion(); v != ProtocolVersion {
		return fmt.Errorf("hello: %w: engine speaks %s (%d), supervisor speaks %s (%d)",
			ErrVersionMismatch, v, int32(v), ProtocolVersion, int32(ProtocolVersion))
	}
	if h.GetRole() == frmpsv1.Role_ROLE_UNSPECIFIED {
		return errors.New("hello: role not set")
	}
	if h.GetRole() != want.Role {
		return fmt.Errorf("hello: engine says role %s, it was launched as %s", h.GetRole(), want.Role)
	}
	if h.GetPid() <= 0 {
		return fmt.Errorf("hello: invalid pid %d", h.GetPid())
	}
	if want.PID != 0 && int(h.GetPid()) != want.PID {
		return fmt.Errorf("hello: engine says pid %d, the launched process is pid %d", h.GetPid(), want.PID)
	}
	if want.Model != "" && h.GetModel() != want.Model {
		return fmt.Errorf("hello: engine serves model %q, want %q", h.GetModel(), want.Model)
	}
	if err := ValidateLayout(h.GetPools()); err != nil {
		return fmt.Errorf("hello: %w", err)
	}
	if want.Pools != nil {
		if err := SameLayout(want.Pools, h.GetPools()); err != nil {
			return fmt.Errorf("hello: engine layout differs from the brokered one: %w", err)
		}
	}
	return nil
}

// ValidateLayout checks that a pool list is well formed: every pool has a
// tag, a backend and a non-zero size, and no (tag, index) appears twice.
func ValidateLayout(pools []*frmpsv1.Pool) error {
	type key struct {
		tag   string
		index uint32
	}
	seen := make(map[key]int, len(pools))
	for i, p := range pools {
		switch {
		case p == nil:
			return fmt.Errorf("pool layout: pool %d is missing", i)
		case p.GetTag() == "":
			return fmt.Errorf("pool layout: pool %d has no tag", i)
		case p.GetSize() == 0:
			return fmt.Errorf("pool layout: pool %d (%s/%d) has size 0", i, p.GetTag(), p.GetIndex())
		case p.GetBackend() == "":
			return fmt.Errorf("pool layout: pool %d (%s/%d) has no backend", i, p.GetTag(), p.GetIndex())
		}
		k := key{p.GetTag(), p.GetIndex()}
		if j, dup := seen[k]; dup {
			return fmt.Errorf("pool layout: pools %d and %d are both %s/%d", j, i, p.GetTag(), p.GetIndex())
		}
		seen[k] = i
	}
	return nil
}

// SameLayout reports how layout got differs from want (order matters: fds
// travel in pool order), or nil when they are identical.
func SameLayout(want, got []*frmpsv1.Pool) error {
	if len(want) != len(got) {
		return fmt.Errorf("%w: %d pools, want %d", ErrLayoutMismatch, len(got), len(want))
	}
	for i := range want {
		w, g := want[i], got[i]
		if w.GetTag() != g.GetTag() || w.GetIndex() != g.GetIndex() ||
			w.GetSize() != g.GetSize() || w.GetBackend() != g.GetBackend() {
			return fmt.Errorf("%w: pool %d is %s, want %s", ErrLayoutMismatch, i, describePool(g), describePool(w))
		}
	}
	return nil
}

func describePool(p *frmpsv1.Pool) string {
	return fmt.Sprintf("%s/%d %d bytes on %s", p.GetTag(), p.GetIndex(), p.GetSize(), p.GetBackend())
}
