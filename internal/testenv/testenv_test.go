package testenv

import (
	"strings"
	"testing"
)

// recorder is a testing.TB that records how the test was ended instead of ending it.
type recorder struct {
	testing.TB
	fatal, skip string
}

func (r *recorder) Helper()                           {}
func (r *recorder) Fatalf(format string, args ...any) { r.fatal = format }
func (r *recorder) Skip(args ...any)                  { r.skip = args[0].(string) }

func TestMissing(t *testing.T) {
	for _, tc := range []struct {
		ci        string
		wantFatal bool
	}{
		{"", false}, {"false", false}, {"0", false}, {"yes", false},
		{"true", true}, {"1", true}, {"TRUE", true},
	} {
		t.Setenv("CI", tc.ci)
		r := &recorder{TB: t}
		Missing(r, "no Python writer: set %s", "FRMPS_PYTHON")
		if got := r.fatal != ""; got != tc.wantFatal {
			t.Errorf("CI=%q: failed %v (fatal %q, skip %q), want failed %v", tc.ci, got, r.fatal, r.skip, tc.wantFatal)
		}
		if !tc.wantFatal && !strings.Contains(r.skip, "no Python writer: set FRMPS_PYTHON") {
			t.Errorf("CI=%q: skip message %q", tc.ci, r.skip)
		}
	}
}
