package deploy_test

import (
	"bufio"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// imageScripts are the daemonless image build and its test (make image,
// make image-test). Building and running the images takes minutes and
// podman, so CI checks the scripts, not the images.
var imageScripts = []string{"common.sh", "rootfs.sh", "build.sh", "test.sh", "check-gpu.sh"}

func TestImageScriptsParse(t *testing.T) {
	for _, s := range imageScripts {
		if out, err := exec.Command("bash", "-n", filepath.Join("image", s)).CombinedOutput(); err != nil {
			t.Errorf("bash -n %s: %v\n%s", s, err, out)
		}
	}
}

// shellcheck (Debian: shellcheck), all warnings; it must be there under CI.
func TestImageScriptsShellcheck(t *testing.T) {
	sc, err := exec.LookPath("shellcheck")
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatal("shellcheck is not installed (CI=true)")
		}
		t.Skip("shellcheck is not installed: the image scripts are not linted")
	}
	args := []string{"-x", "-P", "SCRIPTDIR", "-s", "bash"}
	for _, s := range imageScripts {
		args = append(args, filepath.Join("image", s))
	}
	if out, err := exec.Command(sc, args...).CombinedOutput(); err != nil {
		t.Errorf("shellcheck: %v\n%s", err, out)
	}
}

// image/test.sh runs the cpu image as the chart runs it with
// ci/cpu-values.yaml: its user, args, /dev/shm size and grace period are the
// rendered Deployment's.
func TestImageTestMirrorsChart(t *testing.T) {
	m := decode(t, mustRender(t, "cpu-values.yaml"))
	pod := m.deploy.Spec.Template.Spec
	c := pod.Containers[0]
	var shm int64
	for _, v := range pod.Volumes {
		if v.Name == "shm" && v.EmptyDir != nil && v.EmptyDir.SizeLimit != nil {
			shm = v.EmptyDir.SizeLimit.Value()
		}
	}
	want := []string{
		strconv.FormatInt(*pod.SecurityContext.RunAsUser, 10),
		strconv.FormatInt(shm, 10),
		strconv.FormatInt(*pod.TerminationGracePeriodSeconds, 10),
	}
	want = append(want, c.Args...)
	// The chart's block of test.sh, evaluated by bash.
	b, err := os.ReadFile(filepath.Join("image", "test.sh"))
	if err != nil {
		t.Fatal(err)
	}
	block := regexp.MustCompile(`(?s)# chart:begin.*# chart:end`).Find(b)
	if block == nil {
		t.Fatal("test.sh has no chart:begin ... chart:end block")
	}
	out, err := exec.Command("bash", "-c", string(block)+"\n"+`printf '%s\n' "$uid" "$shm" "$grace" "${serve_args[@]}"`).Output()
	if err != nil {
		t.Fatal(err)
	}
	got := strings.Split(strings.TrimSpace(string(out)), "\n")
	if !slices.Equal(got, want) {
		t.Errorf("test.sh runs the image as\n\t%q\nthe chart (ci/cpu-values.yaml) as\n\t%q", got, want)
	}
	// What test.sh mounts where the chart does: /tmp and /dev/shm.
	for _, vm := range c.VolumeMounts {
		if !strings.Contains(string(b), ":"+vm.MountPath+`"`) && !strings.Contains(string(b), "destination="+vm.MountPath+",") {
			t.Errorf("the chart mounts %s; test.sh does not", vm.MountPath)
		}
	}
	if sc := c.SecurityContext; sc == nil || sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem || !strings.Contains(string(b), "--read-only ") {
		t.Error("the chart's root filesystem is read-only; test.sh's must be too")
	}
}

// Every package the cpu image installs (at requirements.lock's version,
// --no-deps) is in requirements.lock.
func TestImageCPURequirementsLocked(t *testing.T) {
	lock := map[string]bool{}
	for _, l := range readLines(t, filepath.Join("..", "vllmpatch", "requirements.lock")) {
		if name, _, ok := strings.Cut(l, "=="); ok {
			lock[normalize(name)] = true
		}
	}
	n := 0
	for _, l := range readLines(t, filepath.Join("image", "requirements-cpu.txt")) {
		if l == "" || strings.HasPrefix(l, "#") {
			continue
		}
		n++
		if !lock[normalize(l)] {
			t.Errorf("image/requirements-cpu.txt: %s is not pinned in vllmpatch/requirements.lock", l)
		}
	}
	if n < 5 {
		t.Errorf("image/requirements-cpu.txt lists %d packages", n)
	}
}

func mustRender(t *testing.T, values string) map[string]string {
	t.Helper()
	out, err := render(t, loadChart(t), valuesFile(t, values))
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func readLines(t *testing.T, path string) []string {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var out []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		out = append(out, strings.TrimSpace(sc.Text()))
	}
	return out
}

// normalize is PEP 503's name normalisation.
func normalize(name string) string {
	return strings.ToLower(regexp.MustCompile(`[-_.]+`).ReplaceAllString(name, "-"))
}
