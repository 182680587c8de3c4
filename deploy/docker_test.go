package deploy_test

import (
	"context"
	"debug/elf"
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/moby/buildkit/client/llb/sourceresolver"
	"github.com/moby/buildkit/frontend/dockerfile/dockerfile2llb"
	"github.com/moby/buildkit/frontend/dockerfile/parser"
	"github.com/moby/buildkit/frontend/dockerui"
	digest "github.com/opencontainers/go-digest"
)

const dockerfile = "docker/Dockerfile"

// offlineImages is a TEST DOUBLE of a registry: every base image resolves
// to an empty Linux image, so the Dockerfile converts without a network.
type offlineImages struct{}

func (offlineImages) ResolveImageConfig(_ context.Context, ref string, _ sourceresolver.Opt) (string, digest.Digest, []byte, error) {
	cfg := `{"architecture":"amd64","os":"linux","config":{"Env":["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]},"rootfs":{"type":"layers","diff_ids":[]}}`
	return ref, digest.FromString(ref), []byte(cfg), nil
}

// The Dockerfile converts to a build graph for each target exactly as
// BuildKit's Dockerfile frontend does for `docker build`, with every lint
// rule of `docker build --check` passing, and each image is configured as
// documented: non-root, tini as PID 1, frmps and its Python found by env.
// (No image builder runs here; this needs no daemon and no registry.)
func TestDockerfile(t *testing.T) {
	dt, err := os.ReadFile(dockerfile)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		target string
		cmd    []string
	}{
		{"cpu", []string{"serve", "--no-mps", "--model", "tiny"}},
		{"gpu", []string{"serve", "--device", "cuda", "--memory", "cuda-vmm", "--model", "qwen2.5-0.5b"}},
	} {
		t.Run(tc.target, func(t *testing.T) {
			var warnings []string
			res, err := dockerfile2llb.Dockerfile2LLB(context.Background(), dt, dockerfile2llb.ConvertOpt{
				Config:       dockerui.Config{Target: tc.target},
				MetaResolver: offlineImages{},
				Warn: func(rule, _, _, msg string, loc []parser.Range) {
					warnings = append(warnings, fmt.Sprintf("%s: %s (line %v)", rule, msg, loc))
				},
			})
			if err != nil {
				t.Fatal(err)
			}
			for _, w := range warnings {
				t.Errorf("lint: %s", w)
			}
			if _, err := res.State.Marshal(context.Background()); err != nil {
				t.Fatalf("build graph: %v", err)
			}
			c := res.Image.Config
			env := map[string]string{}
			for _, kv := range c.Env {
				k, v, _ := strings.Cut(kv, "=")
				env[k] = v
			}
			switch {
			case c.User != "10001:10001":
				t.Errorf("user %q", c.User)
			case !slices.Equal(c.Entrypoint, []string{"/usr/bin/tini", "--", "frmps"}):
				t.Errorf("entrypoint %q", c.Entrypoint)
			case !slices.Equal(c.Cmd, tc.cmd):
				t.Errorf("cmd %q", c.Cmd)
			case env["FRMPS_PYTHON"] != "/opt/frmps/venv/bin/python" || env["FRMPS_VMM_LIBRARY"] != "/opt/frmps/lib/libfrmps_vmm.so" ||
				!strings.HasPrefix(env["PATH"], "/opt/frmps/bin:"):
				t.Errorf("env %v", env)
			}
			if _, ok := c.ExposedPorts["8000/tcp"]; !ok {
				t.Errorf("exposed %v", c.ExposedPorts)
			}
			if tc.target == "gpu" && env["NVIDIA_DRIVER_CAPABILITIES"] != "compute,utility" {
				t.Errorf("NVIDIA_DRIVER_CAPABILITIES %q", env["NVIDIA_DRIVER_CAPABILITIES"])
			}
		})
	}
}

// frmps builds static with CGO_ENABLED=0 (what the image's frmps stage
// does), so it runs on any base image.
func TestFrmpsIsStatic(t *testing.T) {
	f, err := elf.Open(frmpsBinary(t))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			t.Fatal("frmps has a dynamic loader (PT_INTERP): not a static binary")
		}
	}
	if libs, _ := f.ImportedLibraries(); len(libs) > 0 {
		t.Fatalf("frmps links %v", libs)
	}
}
