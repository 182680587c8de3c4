package openai

import (
	"encoding/json"
	"math/rand"
	"reflect"
	"regexp"
	"strings"
	"testing"
)

var toolIDRe = regexp.MustCompile(`^chatcmpl-tool-[0-9a-f]{16}$`)

func TestPyNumber(t *testing.T) {
	// What Python's json.dumps(json.loads(s)) writes.
	for in, want := range map[string]string{
		"1.0": "1.0", "1e5": "100000.0", "1E400": "Infinity", "-1E400": "-Infinity", "-0": "0", "-0.0": "-0.0",
		"0.1": "0.1", "1e16": "1e+16", "1.5e-7": "1.5e-07", "123456789012345678901234567890": "123456789012345678901234567890",
		"1e-4": "0.0001", "0.00001": "1e-05", "12345678901234567.0": "1.2345678901234568e+16", "100": "100", "-12": "-12",
		"2.50": "2.5", "9999999999999999.0": "1e+16", "1e15": "1000000000000000.0", "0e10": "0.0", "5E-324": "5e-324",
	} {
		if got := pyNumber(in); got != want {
			t.Errorf("pyNumber(%s) = %s, want %s", in, got, want)
		}
	}
}

func TestPyDumps(t *testing.T) {
	// json.dumps(json.loads(in), ensure_ascii=False): separators, key order (a
	// repeated key keeps its first place and takes its last value), escapes.
	in := `{"a":"\u00e9\n\t\u0001\u2028\u007f/","b":[1,{"c":null}],"a":true, "d": [], "e": {}}`
	want := `{"a": true, "b": [1, {"c": null}], "d": [], "e": {}}`
	n, err := parseJNode([]byte(in))
	if err != nil {
		t.Fatal(err)
	}
	if got := n.pyDumps(); got != want {
		t.Errorf("pyDumps = %s, want %s", got, want)
	}
	s, _ := parseJNode([]byte(`"\u00e9\n\t\u0001\u2028\u007f/\"\\"`))
	if got, want := s.pyDumps(), "\"é\\n\\t\\u0001\u2028\u007f/\\\"\\\\\""; got != want {
		t.Errorf("string pyDumps = %q, want %q", got, want)
	}
	// json.dumps("\b\f\x1f") == '"\\b\\f\\u001f"'
	if s, _ := parseJNode([]byte(`"\b\f\u001f"`)); s.pyDumps() != `"\b\f\u001f"` {
		t.Errorf("string pyDumps = %s, want \"\\b\\f\\u001f\"", s.pyDumps())
	}
	for _, bad := range []string{``, `{`, `{"a":1} x`, `[1,]`, `{"a" 1}`, "\"\x01\""} {
		if _, err := parseJNode([]byte(bad)); err == nil {
			t.Errorf("parseJNode(%q) accepted invalid JSON", bad)
		}
	}
}

func TestHermesExtract(t *testing.T) {
	type call struct{ name, args string }
	for _, tc := range []struct {
		name, text, content string
		calls               []call
		ok                  bool
	}{
		{"no tag", "just text <tool", "just text <tool", nil, false},
		{"one call", "Sure.\n<tool_call>\n{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Paris\",\"unit\":\"c\"}}\n</tool_call>",
			"Sure.\n", []call{{"get_weather", `{"city": "Paris", "unit": "c"}`}}, true},
		{"two calls, text between and after dropped", "<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call> and <tool_call>{\"name\": \"b\", \"arguments\": {\"x\": [1, 2.50]}}</tool_call> tail",
			"", []call{{"a", `{}`}, {"b", `{"x": [1, 2.5]}`}}, true},
		{"unclosed last call", "<tool_call>{\"name\": \"a\", \"arguments\": {\"q\": \"é\"}}", "", []call{{"a", `{"q": "é"}`}}, true},
		{"arguments not an object", `<tool_call>{"name": "a", "arguments": "x"}</tool_call>`, "", []call{{"a", `"x"`}}, true},
		{"arguments null", `<tool_call>{"name": "a", "arguments": null}</tool_call>`, "", []call{{"a", `null`}}, true},
		{"invalid JSON: all content", `x<tool_call>{"name": "a", "arguments": {</tool_call>`, `x<tool_call>{"name": "a", "arguments": {</tool_call>`, nil, false},
		{"one bad block spoils all", `<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>oops</tool_call>`, `<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>oops</tool_call>`, nil, false},
		{"no arguments", `<tool_call>{"name": "a"}</tool_call>`, `<tool_call>{"name": "a"}</tool_call>`, nil, false},
		{"name not a string", `<tool_call>{"name": 1, "arguments": {}}</tool_call>`, `<tool_call>{"name": 1, "arguments": {}}</tool_call>`, nil, false},
		{"empty block", `<tool_call></tool_call>`, `<tool_call></tool_call>`, nil, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			content, calls, ok := hermesExtract(tc.text)
			if ok != tc.ok || content != tc.content || len(calls) != len(tc.calls) {
				t.Fatalf("hermesExtract = %q, %v, %v; want %q, %v, %v", content, calls, ok, tc.content, tc.calls, tc.ok)
			}
			for i, c := range calls {
				if c.name != tc.calls[i].name || c.args != tc.calls[i].args || !toolIDRe.MatchString(c.id) {
					t.Errorf("call %d = %+v, want %+v", i, c, tc.calls[i])
				}
			}
		})
	}
}

// assembled is what a client puts together from a choice's streamed deltas.
type assembled struct {
	content string
	names   []string
	args    []string
	ids     []string
	finish  string
}

// streamChunks feeds chunks to s and assembles what it sends, checking the
// deltas' shape: a call's first delta (and only it) has an id and a name,
// indices start at 0 and grow by one.
func streamChunks(t testing.TB, s toolStream, chunks []string, reason string) assembled {
	var a assembled
	add := func(content string, calls []toolDelta) {
		a.content += content
		for _, c := range calls {
			switch {
			case c.id != "":
				if c.index != len(a.ids) || !toolIDRe.MatchString(c.id) {
					t.Fatalf("first delta of call %d at index %d, id %q", len(a.ids), c.index, c.id)
				}
				a.ids, a.names, a.args = append(a.ids, c.id), append(a.names, c.name), append(a.args, "")
			case c.index >= len(a.ids) || c.name != "":
				t.Fatalf("delta %+v before its call's first delta (%d calls)", c, len(a.ids))
			}
			a.args[c.index] += c.args
		}
	}
	for _, ch := range chunks {
		add(s.feed(ch))
	}
	content, calls, finish := s.end(reason)
	add(content, calls)
	a.finish = finish
	return a
}

// splitAt cuts text at the given points (sorted, in range, deduplicated).
func splitAt(text string, cuts []int) []string {
	var out []string
	prev := 0
	for _, c := range cuts {
		if c > prev && c < len(text) {
			out = append(out, text[prev:c])
			prev = c
		}
	}
	return append(out, text[prev:])
}

func randomCuts(r *rand.Rand, n int) []int {
	var cuts []int
	for i := 1; i < n; i++ {
		if r.Intn(3) == 0 {
			cuts = append(cuts, i)
		}
	}
	return cuts
}

func bytesOf(text string) []string {
	out := make([]string, len(text))
	for i := 0; i < len(text); i++ {
		out[i] = text[i : i+1]
	}
	return out
}

func jsonEqual(t testing.TB, a, b string) bool {
	var x, y any
	if err := json.Unmarshal([]byte(a), &x); err != nil {
		t.Fatalf("not JSON: %q: %v", a, err)
	}
	if err := json.Unmarshal([]byte(b), &y); err != nil {
		t.Fatalf("not JSON: %q: %v", b, err)
	}
	return reflect.DeepEqual(x, y)
}

// hermesOutputs are model outputs whose streamed reading must equal the
// finished one's (content, names, arguments) however the text is cut.
var hermesOutputs = []string{
	"Sure, checking.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"c\"}}\n</tool_call>",
	"<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"c\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"tz\": \"CET\"}}\n</tool_call>",
	// Braces, quotes, escapes and tag-like text inside the arguments' strings.
	"a < b <tool <tool_c\n<tool_call>{\"name\":\"q\",\"arguments\":{\"s\":\"}{\\\"<tool_call>\\\\\",\"n\":[1,{\"x\":null}],\"t\":true}}</tool_call>",
	// The arguments before the name, whitespace everywhere, non-ASCII.
	"<tool_call>  {  \"arguments\" :  {\"ville\" : \"Zürich 東京\" } ,  \"name\"  :  \"méteo\"  }  </tool_call>",
	// An unclosed last call.
	"<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call><tool_call>{\"name\": \"b\", \"arguments\": {\"k\": 1.5}}",
	// Arguments that are not an object.
	"<tool_call>{\"name\": \"s\", \"arguments\": \"text\"}</tool_call>",
}

func TestHermesStreamEqualsFinished(t *testing.T) {
	r := rand.New(rand.NewSource(1))
	for oi, out := range hermesOutputs {
		content, calls, ok := hermesExtract(out)
		if !ok {
			t.Fatalf("output %d does not read as a whole", oi)
		}
		splits := [][]string{{out}, bytesOf(out)}
		for k := 0; k < 200; k++ {
			splits = append(splits, splitAt(out, randomCuts(r, len(out))))
		}
		for _, chunks := range splits {
			a := streamChunks(t, &hermesStream{}, chunks, "stop")
			if a.content != content || len(a.names) != len(calls) || a.finish != "tool_calls" {
				t.Fatalf("output %d cut %q: content %q, %d calls, finish %s; finished: content %q, %d calls",
					oi, chunks, a.content, len(a.names), a.finish, content, len(calls))
			}
			for i, c := range calls {
				if a.names[i] != c.name || !jsonEqual(t, a.args[i], c.args) {
					t.Fatalf("output %d cut %q: call %d streamed %s(%s), finished %s(%s)", oi, chunks, i, a.names[i], a.args[i], c.name, c.args)
				}
			}
			// The arguments as the model wrote them (vLLM streams the raw text).
			if oi == 0 && a.args[0] != `{"city": "Paris", "unit": "c"}` {
				t.Fatalf("raw arguments %q", a.args[0])
			}
		}
	}
}

func TestHermesStreamContent(t *testing.T) {
	for _, tc := range []struct {
		chunks  []string
		content []string // per feed, then end
		finish  string
	}{
		// A possible tag start is held back until it is not one.
		{[]string{"a<", "too", "l>b"}, []string{"a", "", "<tool>b", ""}, "stop"},
		// Held back to the end: released there (vLLM drops it).
		{[]string{"x <tool_c"}, []string{"x ", "<tool_c"}, "stop"},
		// Content stops at the tag; the text after the calls is not content.
		{[]string{"hi <tool_", "call>{\"name\": \"f\", \"arguments\": {}}</tool_call> bye"}, []string{"hi ", "", ""}, "tool_calls"},
	} {
		s := &hermesStream{}
		var got []string
		for _, c := range tc.chunks {
			content, _ := s.feed(c)
			got = append(got, content)
		}
		content, _, finish := s.end("stop")
		got = append(got, content)
		if !reflect.DeepEqual(got, tc.content) || finish != tc.finish {
			t.Errorf("chunks %q: content %q finish %s, want %q %s", tc.chunks, got, finish, tc.content, tc.finish)
		}
	}
}

func TestHermesStreamNamelessBlockStops(t *testing.T) {
	// A block that closes without a name stops the reading (later blocks are
	// not sent), as vLLM's parser does.
	a := streamChunks(t, &hermesStream{}, []string{`<tool_call>{"x": 1}</tool_call><tool_call>{"name": "f", "arguments": {}}</tool_call>`}, "stop")
	if len(a.names) != 0 || a.finish != "stop" {
		t.Errorf("got %+v", a)
	}
}

// FuzzHermesStream: however the text is cut, the stream sends the same
// content and calls as when it comes one byte at a time (a resumed stream
// continues the reading exactly), and nothing panics.
func FuzzHermesStream(f *testing.F) {
	for _, o := range hermesOutputs {
		f.Add(o, int64(1))
	}
	f.Add("<tool_call>{\"name\": \"a\"</tool_call>", int64(2))
	f.Add("<tool_call><tool_call>{}</tool_call></tool_call>", int64(3))
	f.Fuzz(func(t *testing.T, text string, seed int64) {
		want := streamChunks(t, &hermesStream{}, bytesOf(text), "stop")
		r := rand.New(rand.NewSource(seed))
		got := streamChunks(t, &hermesStream{}, splitAt(text, randomCuts(r, len(text))), "stop")
		want.ids, got.ids = nil, nil
		if !reflect.DeepEqual(got, want) {
			t.Fatalf("cut text %q: %+v, byte by byte %+v", text, got, want)
		}
	})
}

func TestRequiredStreamEqualsFinished(t *testing.T) {
	out := `[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}, {"name":"get_time","parameters":{"tz":"}\"{"}}]`
	calls := requiredCalls(out)
	if len(calls) != 2 || calls[1].args != `{"tz": "}\"{"}` {
		t.Fatalf("requiredCalls = %+v", calls)
	}
	r := rand.New(rand.NewSource(2))
	splits := [][]string{{out}, bytesOf(out)}
	for k := 0; k < 200; k++ {
		splits = append(splits, splitAt(out, randomCuts(r, len(out))))
	}
	for _, chunks := range splits {
		a := streamChunks(t, &requiredStream{scan: newCallScan(2, "name", "parameters", false)}, chunks, "stop")
		if len(a.names) != 2 || a.finish != "tool_calls" || a.content != "" {
			t.Fatalf("cut %q: %+v", chunks, a)
		}
		for i, c := range calls {
			if a.names[i] != c.name || !jsonEqual(t, a.args[i], c.args) {
				t.Fatalf("cut %q: call %d streamed %s(%s), finished %s(%s)", chunks, i, a.names[i], a.args[i], c.name, c.args)
			}
		}
		if a.args[0] != `{"city": "Paris", "unit": "c"}` {
			t.Fatalf("raw parameters %q", a.args[0])
		}
	}
	for _, bad := range []string{`[]x`, `[{"name": "a", "parameters": 3}]`, `[{"parameters": {}}]`, `{"name": "a"}`, `[{"name": "a", "parameters": {}`} {
		if c := requiredCalls(bad); c != nil {
			t.Errorf("requiredCalls(%s) = %+v, want none", bad, c)
		}
	}
	if c := requiredCalls(`[{"name": "a"}]`); len(c) != 1 || c[0].args != "null" {
		t.Errorf("no parameters: %+v, want arguments null", c)
	}
}

func TestNamedStream(t *testing.T) {
	a := streamChunks(t, &namedStream{name: "f"}, []string{"", `{"a"`, "", `: 1}`}, "length")
	if len(a.names) != 1 || a.names[0] != "f" || a.args[0] != `{"a": 1}` || a.finish != "length" || a.content != "" {
		t.Errorf("got %+v", a)
	}
}

func TestToolPlanAnswer(t *testing.T) {
	auto := &toolPlan{mode: toolsAuto, parallel: true}
	two := "<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call><tool_call>{\"name\": \"b\", \"arguments\": {}}</tool_call>"
	for _, tc := range []struct {
		plan         *toolPlan
		text, reason string
		content      string
		null         bool
		calls        int
		wantReason   string
	}{
		{auto, "plain", "stop", "plain", false, 0, "stop"},
		{auto, "  \n" + two, "length", "", true, 2, "tool_calls"},
		{&toolPlan{mode: toolsAuto}, two, "stop", "", true, 1, "tool_calls"},
		{&toolPlan{mode: toolsNamed, name: "f", parallel: true}, `{"a": 1}`, "stop", "", false, 1, "stop"},
		{&toolPlan{mode: toolsNamed, name: "f", parallel: true}, " \n", "length", "", false, 0, "length"},
		{&toolPlan{mode: toolsRequired, parallel: true}, `[{"name": "a", "parameters": {}}]`, "stop", "", false, 1, "tool_calls"},
		{&toolPlan{mode: toolsRequired, parallel: true}, `[{"name": "a", "param`, "length", "", false, 0, "length"},
		{&toolPlan{mode: toolsRequired, parallel: true}, `[]`, "stop", "", false, 0, "tool_calls"},
	} {
		a := tc.plan.answer(tc.text, tc.reason)
		if a.content != tc.content || a.null != tc.null || len(a.calls) != tc.calls || a.reason != tc.wantReason {
			t.Errorf("%+v answer(%q, %s) = %+v", tc.plan, tc.text, tc.reason, a)
		}
	}
	if strings.Contains(string(appendToolMessage(nil, &toolAnswer{null: true})), "tool_calls") {
		t.Error("an answer without calls has tool_calls")
	}
}
