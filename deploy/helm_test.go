package deploy_test

import (
	"fmt"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	"helm.sh/helm/v3/pkg/chart"
	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/engine"
	"helm.sh/helm/v3/pkg/lint"
	"helm.sh/helm/v3/pkg/lint/support"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"sigs.k8s.io/yaml"
)

const chartDir = "helm/frmps"

// The cluster version the chart is rendered for: the oldest it supports.
var kubeVersion = chartutil.KubeVersion{Version: "v1.30.0", Major: "1", Minor: "30"}

func loadChart(t *testing.T) *chart.Chart {
	t.Helper()
	c, err := loader.Load(chartDir)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// render renders the chart as `helm template` would, with strict templates
// (a reference to a value that does not exist is an error).
func render(t *testing.T, c *chart.Chart, vals map[string]any) (map[string]string, error) {
	t.Helper()
	caps := chartutil.DefaultCapabilities.Copy()
	caps.KubeVersion = kubeVersion
	rv, err := chartutil.ToRenderValues(c, vals, chartutil.ReleaseOptions{Name: "frmps", Namespace: "serving", Revision: 1, IsInstall: true}, caps)
	if err != nil {
		return nil, err
	}
	return engine.Engine{Strict: true}.Render(c, rv)
}

func valuesFile(t *testing.T, name string) map[string]any {
	t.Helper()
	if name == "" {
		return map[string]any{}
	}
	v, err := chartutil.ReadValuesFile(filepath.Join(chartDir, "ci", name))
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// manifests is one rendering, decoded strictly into the Kubernetes API types.
type manifests struct {
	deploy  *appsv1.Deployment
	svc     *corev1.Service
	sa      *corev1.ServiceAccount
	pdb     *policyv1.PodDisruptionBudget
	monitor *monitoringv1.ServiceMonitor
}

var docSep = regexp.MustCompile(`(?m)^---\s*$`)

// decode splits the rendered templates into documents and decodes each into
// the type its apiVersion and kind name, rejecting unknown and duplicate
// fields (sigs.k8s.io/yaml's strict mode), and unknown kinds.
func decode(t *testing.T, out map[string]string) manifests {
	t.Helper()
	var m manifests
	names := make([]string, 0, len(out))
	for name := range out {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		if strings.HasSuffix(name, "NOTES.txt") {
			continue
		}
		for _, doc := range docSep.Split(out[name], -1) {
			if strings.TrimSpace(doc) == "" {
				continue
			}
			var tm metav1.TypeMeta
			if err := yaml.Unmarshal([]byte(doc), &tm); err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			var obj any
			switch gvk := tm.APIVersion + "/" + tm.Kind; gvk {
			case "apps/v1/Deployment":
				m.deploy = &appsv1.Deployment{}
				obj = m.deploy
			case "v1/Service":
				m.svc = &corev1.Service{}
				obj = m.svc
			case "v1/ServiceAccount":
				m.sa = &corev1.ServiceAccount{}
				obj = m.sa
			case "policy/v1/PodDisruptionBudget":
				m.pdb = &policyv1.PodDisruptionBudget{}
				obj = m.pdb
			case "monitoring.coreos.com/v1/ServiceMonitor":
				m.monitor = &monitoringv1.ServiceMonitor{}
				obj = m.monitor
			default:
				t.Fatalf("%s: no API type registered in this test for %q", name, gvk)
			}
			if err := yaml.UnmarshalStrict([]byte(doc), obj); err != nil {
				t.Fatalf("%s does not match the %s API type: %v\n%s", name, tm.Kind, err, doc)
			}
		}
	}
	if m.deploy == nil || m.svc == nil {
		t.Fatal("no Deployment or Service rendered")
	}
	return m
}

func args(c corev1.Container) map[string]string {
	a := map[string]string{}
	for _, s := range c.Args[1:] {
		k, v, _ := strings.Cut(s, "=")
		a[k] = v
	}
	return a
}

func quantity(t *testing.T, q *resource.Quantity) int64 {
	t.Helper()
	if q == nil {
		t.Fatal("no quantity")
	}
	return q.Value()
}

// check asserts what the chart promises, beyond the types: probes on the
// right endpoints, termination grace covering frmps's drain, /dev/shm sized
// for the ring, the GPU, the MPS pipe directory, and selectors that select.
func check(t *testing.T, vals chartutil.Values, m manifests) {
	t.Helper()
	v := func(path string) any {
		x, err := vals.PathValue(path)
		if err != nil {
			t.Fatalf("value %s: %v", path, err)
		}
		return x
	}
	num := func(path string) int64 {
		switch x := v(path).(type) {
		case int64:
			return x
		case float64:
			return int64(x)
		case int:
			return int64(x)
		}
		t.Fatalf("value %s is %T", path, v(path))
		return 0
	}
	pod := m.deploy.Spec.Template
	if len(pod.Spec.Containers) != 1 {
		t.Fatalf("%d containers", len(pod.Spec.Containers))
	}
	c := pod.Spec.Containers[0]
	a := args(c)
	if c.Args[0] != "serve" || a["--model"] != v("model") || a["--device"] != v("device") || a["--memory"] != v("memory") ||
		a["--port"] != "8000" || a["--shutdown-grace"] != fmt.Sprintf("%ds", num("shutdownGraceSeconds")) {
		t.Errorf("args %q", c.Args)
	}
	// Numbers from values files are float64 in templates: a large one printed
	// as is reads 8.388608e+06, which frmps's integer flags refuse.
	if a["--ring-capacity"] != strconv.FormatInt(num("ringCapacityBytes"), 10) || a["--sync-every"] != strconv.FormatInt(num("syncEvery"), 10) {
		t.Errorf("integer args: --ring-capacity=%s --sync-every=%s, want %d and %d",
			a["--ring-capacity"], a["--sync-every"], num("ringCapacityBytes"), num("syncEvery"))
	}
	if len(c.Ports) != 1 || c.Ports[0].Name != "http" || c.Ports[0].ContainerPort != 8000 {
		t.Fatalf("ports %v", c.Ports)
	}
	for what, p := range map[string]struct {
		probe *corev1.Probe
		path  string
	}{"startup": {c.StartupProbe, "/readyz"}, "readiness": {c.ReadinessProbe, "/readyz"}, "liveness": {c.LivenessProbe, "/livez"}} {
		if p.probe == nil || p.probe.HTTPGet == nil || p.probe.HTTPGet.Path != p.path || p.probe.HTTPGet.Port.String() != "http" {
			t.Errorf("%s probe %+v, want GET %s on http", what, p.probe, p.path)
		}
	}
	if s := c.StartupProbe; int64(s.PeriodSeconds*s.FailureThreshold) < 5*60 {
		t.Errorf("the startup probe allows %ds for loading the model", s.PeriodSeconds*s.FailureThreshold)
	}
	grace := num("shutdownGraceSeconds")
	pre := c.Lifecycle.PreStop
	if pre == nil || pre.Sleep == nil || pre.Sleep.Seconds != num("preStopSleepSeconds") {
		t.Errorf("preStop %+v", pre)
	}
	// frmps serve: front door drain ≤ grace+5s, engines ≤ grace, MPS stop ≤ 10s, admin ≤ 5s.
	if need := num("preStopSleepSeconds") + (grace + 5) + grace + 10 + 5; pod.Spec.TerminationGracePeriodSeconds == nil || *pod.Spec.TerminationGracePeriodSeconds < need {
		t.Errorf("terminationGracePeriodSeconds %v < %d, what frmps needs to drain and stop", pod.Spec.TerminationGracePeriodSeconds, need)
	}

	volumes := map[string]corev1.Volume{}
	for _, vol := range pod.Spec.Volumes {
		volumes[vol.Name] = vol
	}
	mounts := map[string]corev1.VolumeMount{}
	for _, vm := range c.VolumeMounts {
		if _, ok := volumes[vm.Name]; !ok {
			t.Errorf("mount of an undefined volume %q", vm.Name)
		}
		mounts[vm.MountPath] = vm
	}
	hostIPC := v("mps.hostIPC").(bool)
	if pod.Spec.HostIPC != hostIPC {
		t.Errorf("hostIPC %v", pod.Spec.HostIPC)
	}
	if shm, ok := mounts["/dev/shm"]; ok == hostIPC {
		t.Errorf("/dev/shm mounted: %v with hostIPC %v", ok, hostIPC)
	} else if ok {
		ed := volumes[shm.Name].EmptyDir
		if ed == nil || ed.Medium != corev1.StorageMediumMemory || quantity(t, ed.SizeLimit) < num("ringCapacityBytes") {
			t.Errorf("/dev/shm volume %+v: want memory-backed, at least the ring's %d bytes", ed, num("ringCapacityBytes"))
		}
	}
	if _, ok := mounts["/tmp"]; !ok {
		t.Error("no writable /tmp under a read-only root file system")
	}

	gpu, hasGPU := c.Resources.Limits["nvidia.com/gpu"]
	if cuda := v("device") == "cuda"; hasGPU != cuda || (cuda && gpu.Value() != num("gpuCount")) {
		t.Errorf("device %s: GPU limit %v", v("device"), c.Resources.Limits)
	}
	switch mode := v("mps.mode"); mode {
	case "external":
		dir := v("mps.pipeDir").(string)
		vm, ok := mounts[dir]
		if !ok || volumes[vm.Name].HostPath == nil || volumes[vm.Name].HostPath.Path != dir || a["--mps-pipe-dir"] != dir {
			t.Errorf("external MPS: pipe dir %s not mounted from the host and passed (%q)", dir, c.Args)
		}
	case "managed":
		if _, ok := a["--no-mps"]; ok {
			t.Errorf("managed MPS with --no-mps")
		}
	case "none":
		if _, ok := a["--no-mps"]; !ok {
			t.Errorf("no --no-mps in %q", c.Args)
		}
	}
	wantTag := "-gpu"
	if v("device") == "cpu" {
		wantTag = "-cpu"
	}
	if v("image.tag") == "" && !strings.HasSuffix(c.Image, wantTag) {
		t.Errorf("image %s for device %s", c.Image, v("device"))
	}
	if sc := c.SecurityContext; sc == nil || sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem ||
		sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation || !slices.Contains(sc.Capabilities.Drop, "ALL") {
		t.Errorf("container security context %+v", sc)
	}
	if psc := pod.Spec.SecurityContext; psc == nil || psc.RunAsNonRoot == nil || !*psc.RunAsNonRoot {
		t.Errorf("pod security context %+v", psc)
	}
	if key := v("apiKey.existingSecret"); key != "" {
		if len(c.Env) != 1 || c.Env[0].Name != "FRMPS_API_KEY" || c.Env[0].ValueFrom.SecretKeyRef.Name != key {
			t.Errorf("API key env %+v", c.Env)
		}
	}

	podLabels := labels.Set(pod.Labels)
	sel, err := metav1.LabelSelectorAsSelector(m.deploy.Spec.Selector)
	if err != nil || !sel.Matches(podLabels) {
		t.Errorf("the Deployment's selector does not select its pods: %v", err)
	}
	if !labels.SelectorFromSet(m.svc.Spec.Selector).Matches(podLabels) {
		t.Error("the Service does not select the pods")
	}
	if len(m.svc.Spec.Ports) != 1 || m.svc.Spec.Ports[0].TargetPort.String() != "http" {
		t.Errorf("service ports %v", m.svc.Spec.Ports)
	}
	if v("podDisruptionBudget.enabled").(bool) != (m.pdb != nil) {
		t.Errorf("PodDisruptionBudget rendered: %v", m.pdb != nil)
	}
	if m.pdb != nil {
		if sel, err := metav1.LabelSelectorAsSelector(m.pdb.Spec.Selector); err != nil || !sel.Matches(podLabels) {
			t.Error("the PodDisruptionBudget does not select the pods")
		}
	}
	if sa := pod.Spec.ServiceAccountName; (m.sa != nil) != v("serviceAccount.create").(bool) || (m.sa != nil && m.sa.Name != sa) {
		t.Errorf("service account %q, rendered %v", sa, m.sa)
	}
	annotated := pod.Annotations["prometheus.io/scrape"] == "true" && pod.Annotations["prometheus.io/port"] == "8000" && pod.Annotations["prometheus.io/path"] == "/metrics"
	if annotated != v("metrics.podAnnotations").(bool) {
		t.Errorf("scrape annotations %v", pod.Annotations)
	}
	if v("metrics.serviceMonitor.enabled").(bool) != (m.monitor != nil) {
		t.Fatalf("ServiceMonitor rendered: %v", m.monitor != nil)
	}
	if m.monitor != nil {
		sel, err := metav1.LabelSelectorAsSelector(&m.monitor.Spec.Selector)
		if err != nil || !sel.Matches(labels.Set(m.svc.Labels)) {
			t.Error("the ServiceMonitor does not select the Service")
		}
		if len(m.monitor.Spec.Endpoints) != 1 || m.monitor.Spec.Endpoints[0].Port != m.svc.Spec.Ports[0].Name || m.monitor.Spec.Endpoints[0].Path != "/metrics" {
			t.Errorf("ServiceMonitor endpoints %+v", m.monitor.Spec.Endpoints)
		}
	}
}

// Every values file under ci/ (and the defaults) renders into manifests that
// decode strictly into the Kubernetes API types and keep the chart's promises.
func TestChartRendersValidManifests(t *testing.T) {
	c := loadChart(t)
	files, err := filepath.Glob(filepath.Join(chartDir, "ci", "*-values.yaml"))
	if err != nil || len(files) < 3 {
		t.Fatalf("values files %v %v", files, err)
	}
	for _, f := range append([]string{""}, files...) {
		name := filepath.Base(f)
		if f == "" {
			name = ""
		}
		t.Run("values="+strconv.Quote(name), func(t *testing.T) {
			vals := valuesFile(t, name)
			out, err := render(t, c, vals)
			if err != nil {
				t.Fatal(err)
			}
			merged, err := chartutil.CoalesceValues(c, vals)
			if err != nil {
				t.Fatal(err)
			}
			check(t, merged, decode(t, out))
		})
	}
}

// helm lint, warnings included, for every values file.
func TestChartLint(t *testing.T) {
	files, _ := filepath.Glob(filepath.Join(chartDir, "ci", "*-values.yaml"))
	for _, f := range append([]string{""}, files...) {
		vals := map[string]any{}
		if f != "" {
			vals = valuesFile(t, filepath.Base(f))
		}
		linter := lint.AllWithKubeVersion(chartDir, vals, "serving", &kubeVersion)
		for _, msg := range linter.Messages {
			if msg.Severity >= support.WarningSev {
				t.Errorf("%s: %s", f, msg)
			}
		}
	}
}

// Bad values are refused with a message that names them.
func TestChartRefusesBadValues(t *testing.T) {
	c := loadChart(t)
	for _, tc := range []struct {
		vals map[string]any
		want string
	}{
		{map[string]any{"modle": "tiny"}, "modle"},
		{map[string]any{"mps": map[string]any{"mode": "off"}}, "mode"},
		{map[string]any{"mps": map[string]any{"mode": false}}, "mode"},
		{map[string]any{"device": "tpu"}, "device"},
		{map[string]any{"extraArgs": []any{"max-concurrent=1"}}, "extraArgs"},
		{map[string]any{"shutdownGraceSeconds": 0}, "shutdownGraceSeconds"},
		{map[string]any{"device": "cpu", "memory": "host-shm"}, "device cpu needs mps.mode none"},
		{map[string]any{"device": "cpu", "mps": map[string]any{"mode": "none"}}, "device cpu needs memory host-shm"},
	} {
		_, err := render(t, c, tc.vals)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("values %v: error %v, want one naming %q", tc.vals, err, tc.want)
		}
	}
}
