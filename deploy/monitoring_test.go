package deploy_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/model/rulefmt"
	"github.com/prometheus/prometheus/promql/parser"
)

const (
	dashboardFile = "grafana/frmps.json"
	rulesFile     = "prometheus/frmps-rules.yml"
)

// targetLabels are attached by Prometheus when it scrapes, so they are on
// every stored series but not on /metrics.
var targetLabels = []string{"instance", "job"}

// series maps each series name a /metrics page exposes (histograms as
// _bucket, _sum and _count) to its label names and their values.
type series map[string]map[string]map[string]bool

func parseScrape(t *testing.T, page []byte) series {
	t.Helper()
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(bytes.NewReader(page))
	if err != nil {
		t.Fatalf("parse /metrics: %v", err)
	}
	s := series{}
	add := func(name string, lps []*dto.LabelPair, extra ...string) {
		if s[name] == nil {
			s[name] = map[string]map[string]bool{}
		}
		for _, lp := range lps {
			if s[name][lp.GetName()] == nil {
				s[name][lp.GetName()] = map[string]bool{}
			}
			s[name][lp.GetName()][lp.GetValue()] = true
		}
		for _, l := range extra {
			if s[name][l] == nil {
				s[name][l] = map[string]bool{}
			}
		}
	}
	for name, f := range fams {
		for _, m := range f.GetMetric() {
			switch f.GetType() {
			case dto.MetricType_HISTOGRAM:
				add(name+"_bucket", m.GetLabel(), "le")
				add(name+"_sum", m.GetLabel())
				add(name+"_count", m.GetLabel())
			case dto.MetricType_SUMMARY:
				add(name, m.GetLabel(), "quantile")
				add(name+"_sum", m.GetLabel())
				add(name+"_count", m.GetLabel())
			default:
				add(name, m.GetLabel())
			}
		}
	}
	return s
}

// Label values a healthy run cannot show, though the code emits them.
var valuesOnlyOnTrouble = map[string][]string{
	"outcome": {"failed"},
}

var promqlParser = parser.NewParser(parser.Options{})

// checkExpr parses expr as Prometheus would and checks every metric, label
// and exact label value it uses against the scraped series. strict: no
// exception for valuesOnlyOnTrouble (a page where every label value known in
// advance is initialised).
func checkExpr(s series, expr string, strict bool) error {
	e, err := promqlParser.ParseExpr(expr)
	if err != nil {
		return fmt.Errorf("parse: %w", err)
	}
	var errs []string
	var used []string // series names this expression reads
	var grouping []string
	parser.Inspect(e, func(node parser.Node, _ []parser.Node) error {
		switch n := node.(type) {
		case *parser.VectorSelector:
			name := n.Name
			for _, m := range n.LabelMatchers {
				if m.Name == labels.MetricName {
					name = m.Value
				}
			}
			have, ok := s[name]
			if !ok {
				errs = append(errs, fmt.Sprintf("metric %s is not on /metrics", name))
				return nil
			}
			used = append(used, name)
			for _, m := range n.LabelMatchers {
				if m.Name == labels.MetricName || slices.Contains(targetLabels, m.Name) {
					continue
				}
				vals, ok := have[m.Name]
				switch {
				case !ok:
					errs = append(errs, fmt.Sprintf("%s has no label %q", name, m.Name))
				case m.Type == labels.MatchEqual && m.Value != "" && !vals[m.Value] && (strict || !slices.Contains(valuesOnlyOnTrouble[m.Name], m.Value)):
					errs = append(errs, fmt.Sprintf("%s{%s} never has the value %q (seen: %v)", name, m.Name, m.Value, keys(vals)))
				}
			}
		case *parser.AggregateExpr:
			grouping = append(grouping, n.Grouping...)
		case *parser.BinaryExpr:
			if n.VectorMatching != nil {
				grouping = append(grouping, n.VectorMatching.MatchingLabels...)
				grouping = append(grouping, n.VectorMatching.Include...)
			}
		}
		return nil
	})
	for _, l := range grouping {
		if slices.Contains(targetLabels, l) {
			continue
		}
		found := false
		for _, name := range used {
			if _, ok := s[name][l]; ok {
				found = true
			}
		}
		if !found {
			errs = append(errs, fmt.Sprintf("label %q (by/without/on/ignoring) is on none of %v", l, used))
		}
	}
	if len(used) == 0 {
		errs = append(errs, "reads no metric")
	}
	if len(errs) > 0 {
		return fmt.Errorf("%s", strings.Join(errs, "; "))
	}
	return nil
}

func keys(m map[string]bool) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// grafanaVars is what Grafana substitutes before a query reaches Prometheus.
var grafanaVars = map[string]string{
	"__rate_interval": "1m", "__interval": "15s", "__range": "6h",
	"model": ".*", "instance": ".*",
}

var grafanaVarRe = regexp.MustCompile(`\$\{?(\w+)\}?`)

func substitute(q string) (string, error) {
	var bad []string
	out := grafanaVarRe.ReplaceAllStringFunc(q, func(v string) string {
		name := grafanaVarRe.FindStringSubmatch(v)[1]
		if r, ok := grafanaVars[name]; ok {
			return r
		}
		bad = append(bad, v)
		return v
	})
	if bad != nil {
		return "", fmt.Errorf("unknown dashboard variables %v", bad)
	}
	return out, nil
}

type dashboard struct {
	UID        string `json:"uid"`
	Templating struct {
		List []struct {
			Name  string `json:"name"`
			Type  string `json:"type"`
			Query any    `json:"query"`
		} `json:"list"`
	} `json:"templating"`
	Panels []struct {
		ID         int    `json:"id"`
		Type       string `json:"type"`
		Title      string `json:"title"`
		Datasource *struct {
			Type string `json:"type"`
			UID  string `json:"uid"`
		} `json:"datasource"`
		GridPos struct{ X, Y, W, H int } `json:"gridPos"`
		Targets []struct {
			Expr  string `json:"expr"`
			RefID string `json:"refId"`
		} `json:"targets"`
	} `json:"panels"`
}

func loadDashboard(t *testing.T) dashboard {
	t.Helper()
	b, err := os.ReadFile(dashboardFile)
	if err != nil {
		t.Fatal(err)
	}
	var d dashboard
	if err := json.Unmarshal(b, &d); err != nil {
		t.Fatalf("%s: %v", dashboardFile, err)
	}
	return d
}

var labelValuesRe = regexp.MustCompile(`^label_values\((.+),\s*(\w+)\)$`)

// dashboardQueries are the panel queries and the variables' label_values
// queries (as "selector" + label), after Grafana's substitution.
func dashboardQueries(t *testing.T, d dashboard) (exprs map[string]string, labelQueries map[string][2]string) {
	t.Helper()
	exprs, labelQueries = map[string]string{}, map[string][2]string{}
	for _, p := range d.Panels {
		for _, tg := range p.Targets {
			q, err := substitute(tg.Expr)
			if err != nil {
				t.Errorf("panel %q: %v", p.Title, err)
				continue
			}
			exprs[fmt.Sprintf("panel %q %s", p.Title, tg.RefID)] = q
		}
	}
	for _, v := range d.Templating.List {
		if v.Type != "query" {
			continue
		}
		raw, _ := v.Query.(string)
		m := labelValuesRe.FindStringSubmatch(raw)
		if m == nil {
			t.Errorf("variable %s: query %v is not label_values(selector, label)", v.Name, v.Query)
			continue
		}
		sel, err := substitute(m[1])
		if err != nil {
			t.Errorf("variable %s: %v", v.Name, err)
			continue
		}
		labelQueries["variable "+v.Name] = [2]string{sel, m[2]}
	}
	return exprs, labelQueries
}

func loadRules(t *testing.T) *rulefmt.RuleGroups {
	t.Helper()
	groups, errs := rulefmt.ParseFile(rulesFile, false, model.UTF8Validation, promqlParser, slog.New(slog.NewTextHandler(io.Discard, nil)))
	for _, err := range errs {
		t.Errorf("rules: %v", err)
	}
	if groups == nil || len(groups.Groups) == 0 {
		t.Fatal("no rule groups")
	}
	return groups
}

// The dashboard is well formed: unique panel ids, on the grid, every query
// on the datasource variable.
func TestDashboardShape(t *testing.T) {
	d := loadDashboard(t)
	if d.UID == "" {
		t.Error("no uid: re-imports would duplicate the dashboard")
	}
	ids := map[int]bool{}
	queries := 0
	for _, p := range d.Panels {
		if ids[p.ID] {
			t.Errorf("panel id %d twice", p.ID)
		}
		ids[p.ID] = true
		if p.GridPos.W <= 0 || p.GridPos.X < 0 || p.GridPos.X+p.GridPos.W > 24 || p.GridPos.H <= 0 {
			t.Errorf("panel %q off the grid: %+v", p.Title, p.GridPos)
		}
		if p.Type == "row" {
			continue
		}
		if p.Datasource == nil || p.Datasource.UID != "${datasource}" || len(p.Targets) == 0 {
			t.Errorf("panel %q: datasource %v, %d queries", p.Title, p.Datasource, len(p.Targets))
		}
		for _, tg := range p.Targets {
			if tg.Expr == "" {
				t.Errorf("panel %q has an empty query", p.Title)
			}
			queries++
		}
	}
	if queries < 20 {
		t.Errorf("only %d queries", queries)
	}
}

// Prometheus's own rule parser accepts the rules; every alert says how bad
// it is and what it is about.
func TestRulesParse(t *testing.T) {
	groups := loadRules(t)
	names := map[string]bool{}
	for _, g := range groups.Groups {
		for _, r := range g.Rules {
			if r.Alert == "" {
				continue
			}
			if names[r.Alert] {
				t.Errorf("alert %s twice", r.Alert)
			}
			names[r.Alert] = true
			if sev := r.Labels["severity"]; sev != "critical" && sev != "warning" && sev != "info" {
				t.Errorf("%s: severity %q", r.Alert, sev)
			}
			if r.Annotations["summary"] == "" || r.Annotations["description"] == "" {
				t.Errorf("%s: no summary or description", r.Alert)
			}
		}
	}
	if len(names) < 8 {
		t.Errorf("%d alerts", len(names))
	}
}

// Every metric, label and label value the dashboard and the alert rules use
// is on the /metrics page of a running frmps (the tiny model on the CPU,
// right after it started, and after a request of each endpoint and a
// failover drill inside a stream).
func TestDashboardAndRulesMatchMetrics(t *testing.T) {
	if testing.Short() {
		t.Skip("starts frmps with real engines")
	}
	f := startFrmps(t)
	// The first scrape, before any request: every series the dashboard and
	// the rules read is already there (else panels say "No data" and
	// increase() misses the first event).
	t.Run("first scrape", func(t *testing.T) { checkPage(t, parseScrape(t, f.firstScrape), true) })
	f.post(t, f.api+"/v1/chat/completions", `{"model":"tiny","messages":[{"role":"user","content":"hi"}],"max_tokens":4}`)
	f.streamAcrossDrill(t, 80)
	t.Run("after traffic and a drill", func(t *testing.T) { checkPage(t, parseScrape(t, f.scrape(t)), false) })
}

// checkPage checks every query of the dashboard and the rules against one
// scraped page.
func checkPage(t *testing.T, s series, strict bool) {
	t.Helper()
	for name, l := range s {
		if strings.HasPrefix(name, "frmps_") {
			if _, ok := l["model_name"]; !ok {
				t.Errorf("%s has no model_name label", name)
			}
		}
	}
	exprs, labelQueries := dashboardQueries(t, loadDashboard(t))
	for _, g := range loadRules(t).Groups {
		for _, r := range g.Rules {
			exprs["rule "+r.Alert+r.Record] = r.Expr
		}
	}
	for where, q := range exprs {
		if err := checkExpr(s, q, strict); err != nil {
			t.Errorf("%s: %v\n\t%s", where, err, q)
		}
	}
	for where, lq := range labelQueries {
		if err := checkExpr(s, lq[0], strict); err != nil {
			t.Errorf("%s: %v", where, err)
		}
		e, _ := promqlParser.ParseExpr(lq[0])
		if vs, ok := e.(*parser.VectorSelector); !ok || (s[vs.Name][lq[1]] == nil && !slices.Contains(targetLabels, lq[1])) {
			t.Errorf("%s: label %s is not on %s", where, lq[1], lq[0])
		}
	}
	if t.Failed() {
		t.Logf("scraped series: %v", keysOf(s))
	}
}

func keysOf(s series) []string {
	out := make([]string, 0, len(s))
	for k := range s {
		if strings.HasPrefix(k, "frmps_") {
			out = append(out, k)
		}
	}
	sort.Strings(out)
	return out
}
