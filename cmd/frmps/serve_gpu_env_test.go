package main

import (
	"bytes"
	"context"
	"strings"
	"testing"

	"github.com/hashicorp/go-hclog"

	"github.com/frmps/frmps/internal/testenv"
)

func TestPinVisibleGPUs(t *testing.T) {
	smi := testenv.FakeNvidiaSMI(t, "ok", "0, GPU-aaaa-1111, Default;1, GPU-bbbb-2222, Default;2, GPU-cccc-3333, Default")
	for _, tc := range []struct {
		name, visible, want, logHas string
		unset                       bool
	}{
		{name: "an index becomes the GPU's UUID", visible: "2", want: "GPU-cccc-3333", logHas: "named by UUID"},
		{name: "a UUID stays", visible: "GPU-bbbb-2222", want: "GPU-bbbb-2222"},
		{name: "an unknown index stays, with a warning", visible: "5", want: "5", logHas: "left as it is"},
		{name: "unset stays unset", unset: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			env := map[string]string{}
			if !tc.unset {
				env["CUDA_VISIBLE_DEVICES"] = tc.visible
			}
			var buf bytes.Buffer
			log := hclog.New(&hclog.LoggerOptions{Output: &buf})
			pinVisibleGPUs(context.Background(), log, smi,
				func(k string) (string, bool) { v, ok := env[k]; return v, ok },
				func(k, v string) error { env[k] = v; return nil })
			got, ok := env["CUDA_VISIBLE_DEVICES"]
			if tc.unset {
				if ok {
					t.Fatalf("set CUDA_VISIBLE_DEVICES=%q", got)
				}
				return
			}
			if got != tc.want {
				t.Errorf("CUDA_VISIBLE_DEVICES=%q, want %q", got, tc.want)
			}
			if !strings.Contains(buf.String(), tc.logHas) {
				t.Errorf("log %q does not say %q", buf.String(), tc.logHas)
			}
		})
	}
}
