package supervisor

import (
	"context"
	"errors"
	"testing"

	"github.com/hashicorp/go-hclog"
	"google.golang.org/grpc"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
)

// failingHealth is a TEST DOUBLE of a generation API whose Health fails.
type failingHealth struct{ frmpsv1.GenerationClient }

func (failingHealth) Health(context.Context, *frmpsv1.HealthRequest, ...grpc.CallOption) (*frmpsv1.HealthResponse, error) {
	return nil, errors.New("engine gone")
}

func TestModelLimitGivenLearnedOrUnknown(t *testing.T) {
	log := hclog.NewNullLogger()
	var m modelLimit
	if m.known() || m.get() != 0 {
		t.Fatalf("fresh limit: known=%v get=%d", m.known(), m.get())
	}
	m.learn(context.Background(), failingHealth{}, log)
	if m.known() || m.get() != 0 {
		t.Fatalf("a failed Health made the limit known: %d", m.get())
	}
	m.learn(context.Background(), &fakeGen{}, log)
	if !m.known() || m.get() != 2048 {
		t.Fatalf("learned limit %d (known=%v), want 2048", m.get(), m.known())
	}

	given := modelLimit{configured: 512}
	if !given.known() || given.get() != 512 {
		t.Fatalf("given limit: known=%v get=%d", given.known(), given.get())
	}
	given.learn(context.Background(), &fakeGen{}, log)
	if given.get() != 512 {
		t.Fatalf("an engine's report replaced the given limit: %d", given.get())
	}
}
