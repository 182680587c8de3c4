package deathcause

import (
	"fmt"
	"slices"
	"strings"
	"testing"
)

func TestTail(t *testing.T) {
	tl := NewTail(3)
	if got := tl.Lines(); len(got) != 0 {
		t.Fatalf("empty tail: %q", got)
	}
	fmt.Fprint(tl, "one\ntwo\r\nthr")
	fmt.Fprint(tl, "ee\n")
	if got := tl.Lines(); !slices.Equal(got, []string{"one", "two", "three"}) {
		t.Fatalf("got %q", got)
	}
	fmt.Fprint(tl, "four\nfive\nRuntimeError: CUDA error: misaligned addr")
	want := []string{"three", "four", "five", "RuntimeError: CUDA error: misaligned addr"}
	if got := tl.Lines(); !slices.Equal(got, want) {
		t.Fatalf("got %q, want %q", got, want)
	}
	fmt.Fprint(tl, strings.Repeat("x", 3*maxLine)+"\n")
	if got := tl.Lines(); len(got[2]) != maxLine {
		t.Fatalf("long line kept as %d bytes", len(got[2]))
	}
	if c := Classify(exited(1), tailWith(t, "torch.OutOfMemoryError: CUDA out of memory.\n").Lines(), nil); c.Class != CUDAOOM {
		t.Fatalf("classify from a tail: %s", c)
	}
}

func tailWith(t *testing.T, s string) *Tail {
	t.Helper()
	tl := NewTail(8)
	tl.Write([]byte(s))
	return tl
}
