package mps

import (
	"context"
	"errors"
	"path/filepath"
	"strings"
	"testing"

	"github.com/frmps/frmps/internal/testenv"
)

// fakeSMI is the test double in testdata (a shell script standing in for nvidia-smi).
func fakeSMI(t *testing.T, mode, gpus string) string { return testenv.FakeNvidiaSMI(t, mode, gpus) }

func TestCheckComputeMode(t *testing.T) {
	const two = "0, GPU-aaaa-1111, Default;1, GPU-bbbb-2222, Exclusive_Process"
	for _, tc := range []struct {
		name, mode, gpus, visible string
		want                      error // nil, ErrNoSecondContext or ErrComputeModeUnknown
		inMsg                     string
	}{
		{name: "default mode", mode: "ok", gpus: "0, GPU-aaaa-1111, Default"},
		{name: "exclusive process", mode: "ok", gpus: "0, GPU-aaaa-1111, Exclusive_Process", want: ErrNoSecondContext,
			inMsg: "GPU 0 (GPU-aaaa-1111) is in Exclusive_Process compute mode"},
		{name: "prohibited", mode: "ok", gpus: "0, GPU-aaaa-1111, Prohibited", want: ErrNoSecondContext, inMsg: "Prohibited"},
		{name: "every GPU checked without CUDA_VISIBLE_DEVICES", mode: "ok", gpus: two, want: ErrNoSecondContext, inMsg: "GPU 1"},
		{name: "only the visible GPU, by index", mode: "ok", gpus: two, visible: "0"},
		{name: "only the visible GPU, by UUID prefix", mode: "ok", gpus: two, visible: "GPU-aaaa"},
		{name: "the visible exclusive GPU", mode: "ok", gpus: two, visible: "GPU-bbbb-2222", want: ErrNoSecondContext, inMsg: "GPU 1"},
		{name: "visible names nothing nvidia-smi lists", mode: "ok", gpus: two, visible: "MIG-1234", want: ErrNoSecondContext},
		{name: "nvidia-smi fails", mode: "fail", want: ErrComputeModeUnknown, inMsg: "couldn't communicate with the NVIDIA driver"},
		{name: "nvidia-smi says something else", mode: "garbage", want: ErrComputeModeUnknown, inMsg: "unexpected nvidia-smi line"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := CheckComputeMode(context.Background(), fakeSMI(t, tc.mode, tc.gpus), tc.visible)
			switch {
			case tc.want == nil && err != nil:
				t.Fatalf("refused: %v", err)
			case tc.want != nil && !errors.Is(err, tc.want):
				t.Fatalf("got %v, want %v", err, tc.want)
			case err != nil && !strings.Contains(err.Error(), tc.inMsg):
				t.Fatalf("error %q does not say %q", err, tc.inMsg)
			}
		})
	}
}

func TestCheckComputeModeWithoutNvidiaSMI(t *testing.T) {
	err := CheckComputeMode(context.Background(), filepath.Join(t.TempDir(), "nvidia-smi"), "")
	if !errors.Is(err, ErrComputeModeUnknown) {
		t.Fatalf("got %v, want ErrComputeModeUnknown", err)
	}
}

func TestVisibleByUUID(t *testing.T) {
	const two = "0, GPU-aaaa-1111, Default;1, GPU-bbbb-2222, Default"
	for _, tc := range []struct {
		name, mode, visible, want, errHas string
	}{
		{name: "an index", mode: "ok", visible: "1", want: "GPU-bbbb-2222"},
		{name: "indices keep their order", mode: "ok", visible: "1,0", want: "GPU-bbbb-2222,GPU-aaaa-1111"},
		{name: "UUIDs and MIG instances stay", mode: "ok", visible: "GPU-aaaa,MIG-9", want: "GPU-aaaa,MIG-9"},
		{name: "no query without an index", mode: "fail", visible: "GPU-bbbb-2222", want: "GPU-bbbb-2222"},
		{name: "mixed", mode: "ok", visible: " 0 ,GPU-bbbb-2222", want: "GPU-aaaa-1111,GPU-bbbb-2222"},
		{name: "an index nvidia-smi does not list", mode: "ok", visible: "0,7", want: "0,7", errHas: "names GPU 7"},
		{name: "nvidia-smi fails", mode: "fail", visible: "0", want: "0", errHas: "couldn't communicate"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := VisibleByUUID(context.Background(), fakeSMI(t, tc.mode, two), tc.visible)
			if got != tc.want {
				t.Errorf("got %q, want %q", got, tc.want)
			}
			switch {
			case tc.errHas == "" && err != nil:
				t.Errorf("error: %v", err)
			case tc.errHas != "" && (err == nil || !strings.Contains(err.Error(), tc.errHas)):
				t.Errorf("error %v, want one saying %q", err, tc.errHas)
			}
		})
	}
}
