package openai

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"math"
	"strconv"
	"strings"
	"unicode/utf8"
)

// JSON as tool calling needs it: values whose object keys keep their order
// (a chat template renders a tool's parameters and a call's arguments in the
// order the client wrote them, and vLLM re-serializes a parsed call's arguments
// with Python's json.dumps, which keeps it too), and an incremental scanner
// that finds a call's name and arguments in text still being generated.

// jnode is a parsed JSON value. Object keys keep their first position; a
// repeated key takes its last value, as Python's json.loads does.
type jnode struct {
	kind  byte   // '{', '[', '"', '0' (number), 't', 'f', 'n'
	str   string // '"': the decoded string; '0': the number as written
	keys  []string
	vals  []*jnode // '{': values of keys; '[': items
	index map[string]int
}

var errJSONTrailing = errors.New("unexpected data after the JSON value")

// parseJNode parses one JSON value (surrounding whitespace allowed).
func parseJNode(raw []byte) (*jnode, error) {
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	n, err := decodeJNode(dec)
	if err != nil {
		return nil, err
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, errJSONTrailing
	}
	return n, nil
}

func decodeJNode(dec *json.Decoder) (*jnode, error) {
	tok, err := dec.Token()
	if err != nil {
		return nil, err
	}
	return jnodeFrom(dec, tok)
}

func jnodeFrom(dec *json.Decoder, tok json.Token) (*jnode, error) {
	switch v := tok.(type) {
	case json.Delim:
		switch v {
		case '{':
			n := &jnode{kind: '{'}
			for dec.More() {
				kt, err := dec.Token()
				if err != nil {
					return nil, err
				}
				k, _ := kt.(string)
				val, err := decodeJNode(dec)
				if err != nil {
					return nil, err
				}
				n.set(k, val)
			}
			_, err := dec.Token() // '}'
			return n, err
		case '[':
			n := &jnode{kind: '['}
			for dec.More() {
				val, err := decodeJNode(dec)
				if err != nil {
					return nil, err
				}
				n.vals = append(n.vals, val)
			}
			_, err := dec.Token() // ']'
			return n, err
		}
		return nil, errors.New("unexpected delimiter")
	case string:
		return &jnode{kind: '"', str: v}, nil
	case json.Number:
		return &jnode{kind: '0', str: v.String()}, nil
	case bool:
		if v {
			return &jnode{kind: 't'}, nil
		}
		return &jnode{kind: 'f'}, nil
	case nil:
		return &jnode{kind: 'n'}, nil
	}
	return nil, errors.New("unexpected JSON token")
}

// set puts val under key k: a new key goes last, a known one keeps its place.
func (n *jnode) set(k string, val *jnode) {
	if n.index == nil {
		n.index = map[string]int{}
	}
	if i, ok := n.index[k]; ok {
		n.vals[i] = val
		return
	}
	n.index[k] = len(n.keys)
	n.keys = append(n.keys, k)
	n.vals = append(n.vals, val)
}

// get is an object's member, nil when absent (or n is not an object).
func (n *jnode) get(k string) *jnode {
	if n == nil || n.kind != '{' {
		return nil
	}
	if i, ok := n.index[k]; ok {
		return n.vals[i]
	}
	return nil
}

// truthy is Python's truth value of the parsed value.
func (n *jnode) truthy() bool {
	switch n.kind {
	case '{', '[':
		return len(n.vals) > 0
	case '"':
		return n.str != ""
	case '0':
		f, err := strconv.ParseFloat(n.str, 64)
		return err != nil || f != 0
	case 't':
		return true
	}
	return false
}

// appendCompact appends n as compact JSON.
func (n *jnode) appendCompact(b []byte) []byte {
	return n.appendJSON(b, ",", ":", false)
}

// pyDumps is Python's json.dumps(value, ensure_ascii=False): ", " and ": "
// separators, non-ASCII text as it is, numbers as Python writes them back.
func (n *jnode) pyDumps() string { return string(n.appendJSON(nil, ", ", ": ", true)) }

func (n *jnode) appendJSON(b []byte, comma, colon string, py bool) []byte {
	switch n.kind {
	case '{':
		b = append(b, '{')
		for i, k := range n.keys {
			if i > 0 {
				b = append(b, comma...)
			}
			b = appendJSONText(b, k, py)
			b = append(b, colon...)
			b = n.vals[i].appendJSON(b, comma, colon, py)
		}
		return append(b, '}')
	case '[':
		b = append(b, '[')
		for i, v := range n.vals {
			if i > 0 {
				b = append(b, comma...)
			}
			b = v.appendJSON(b, comma, colon, py)
		}
		return append(b, ']')
	case '"':
		return appendJSONText(b, n.str, py)
	case '0':
		if py {
			return append(b, pyNumber(n.str)...)
		}
		return append(b, n.str...)
	case 't':
		return append(b, "true"...)
	case 'f':
		return append(b, "false"...)
	}
	return append(b, "null"...)
}

// appendJSONText writes a JSON string: Python's escaping (only '"', '\\' and
// control characters) when py, else the front door's own.
func appendJSONText(b []byte, s string, py bool) []byte {
	if !py {
		return appendJSONString(b, s)
	}
	b = append(b, '"')
	for i := 0; i < len(s); {
		c := s[i]
		if c >= utf8.RuneSelf {
			r, size := utf8.DecodeRuneInString(s[i:])
			if r == utf8.RuneError && size == 1 {
				b = append(b, "\ufffd"...)
			} else {
				b = append(b, s[i:i+size]...)
			}
			i += size
			continue
		}
		if c < 0x20 || c == '"' || c == '\\' {
			b = appendEscaped(b, c, true)
		} else {
			b = append(b, c)
		}
		i++
	}
	return append(b, '"')
}

// pyNumber is a JSON number as Python's json.dumps writes back what
// json.loads read: an integer as an int (its digits, "-0" as "0"), anything
// else as a float's repr (shortest round trip; exponent form below 1e-4 and
// from 1e16 on; "Infinity" past the float range).
func pyNumber(s string) string {
	if !strings.ContainsAny(s, ".eE") {
		neg := strings.HasPrefix(s, "-")
		d := strings.TrimLeft(strings.TrimPrefix(s, "-"), "0")
		if d == "" {
			return "0"
		}
		if neg {
			return "-" + d
		}
		return d
	}
	f, err := strconv.ParseFloat(s, 64)
	switch {
	case math.IsInf(f, 1):
		return "Infinity"
	case math.IsInf(f, -1):
		return "-Infinity"
	case err != nil && !errors.Is(err, strconv.ErrRange):
		return s
	}
	e := strconv.FormatFloat(f, 'e', -1, 64) // d[.ddd]e±XX
	mant, expS, _ := strings.Cut(e, "e")
	exp, _ := strconv.Atoi(expS)
	if exp < -4 || exp >= 16 {
		sign := "+"
		if exp < 0 {
			sign, exp = "-", -exp
		}
		es := strconv.Itoa(exp)
		if len(es) < 2 {
			es = "0" + es
		}
		return mant + "e" + sign + es
	}
	out := strconv.FormatFloat(f, 'f', -1, 64)
	if !strings.Contains(out, ".") {
		out += ".0"
	}
	return out
}

// callScan reads a JSON value as it is generated and finds, in the objects at
// one depth (1: the value itself is the object; 2: the objects of an array),
// the members that make a tool call: its name (a string member) and its
// arguments (any member value). It keeps its state between calls, so each byte
// is read once however the text arrives.
type callScan struct {
	depth      int // the objects' depth
	nameKey    string
	argsKey    string
	onlyFirst  bool // only the first object at that depth counts (hermes: one call per tag)
	arrayOuter bool // depth 2: the value must be an array

	pos   int    // bytes of the text read
	stack []byte // open containers
	inStr bool
	esc   bool
	// member state of the object open at depth (when len(stack) == depth)
	mstate   uint8
	keyStart int
	key      string
	valStart int
	calls    []scannedCall
	done     bool // onlyFirst: the object closed; or the text is not what was expected
}

// member states of the object being read
const (
	mKey   uint8 = iota // expecting a key (or the object's end)
	mColon              // read a key, expecting ':'
	mValue              // expecting a value
	mIn                 // in a value
)

// scannedCall is one object of callScan: where its name and arguments are.
type scannedCall struct {
	nameStart, nameEnd int // the name's JSON string, quotes included; nameEnd 0: not complete yet
	argsStart          int // first byte of the arguments value; -1: not started
	argsEnd            int // the byte after it (before the ',' or '}' that ends it); -1: open
	closed             bool
}

func newCallScan(depth int, nameKey, argsKey string, onlyFirst bool) *callScan {
	return &callScan{depth: depth, nameKey: nameKey, argsKey: argsKey, onlyFirst: onlyFirst, arrayOuter: depth == 2}
}

// scan reads text[s.pos:] (text grows between calls; what was read must not change).
func (s *callScan) scan(text string) {
	for ; s.pos < len(text) && !s.done; s.pos++ {
		c := text[s.pos]
		d := len(s.stack)
		if s.inStr {
			switch {
			case s.esc:
				s.esc = false
			case c == '\\':
				s.esc = true
			case c == '"':
				s.inStr = false
				if d == s.depth {
					s.stringEnded(text)
				}
			}
			continue
		}
		switch c {
		case ' ', '\t', '\n', '\r':
			continue
		case '"':
			s.inStr = true
			if d == s.depth {
				s.stringStarts()
			}
			continue
		case '{', '[':
			if d == s.depth && s.mstate == mValue {
				s.valueStarts()
			}
			if d == 0 && s.arrayOuter != (c == '[') && s.depth > 1 {
				s.done = true // not the container expected
				return
			}
			s.stack = append(s.stack, c)
			if len(s.stack) == s.depth && c == '{' {
				s.calls = append(s.calls, scannedCall{argsStart: -1, argsEnd: -1})
				s.mstate = mKey
			}
			continue
		case '}', ']':
			if d == 0 {
				s.done = true
				return
			}
			if d == s.depth && s.stack[d-1] == '{' {
				s.memberEnds()
				s.calls[len(s.calls)-1].closed = true
				if s.onlyFirst {
					s.stack = s.stack[:d-1]
					s.done = true
					return
				}
			}
			s.stack = s.stack[:d-1]
			continue
		case ',':
			if d == s.depth {
				s.memberEnds()
				s.mstate = mKey
			}
			continue
		case ':':
			if d == s.depth && s.mstate == mColon {
				s.mstate = mValue
			}
			continue
		}
		// A number or a literal.
		if d == s.depth && s.mstate == mValue {
			s.valueStarts()
		}
	}
}

func (s *callScan) current() *scannedCall {
	if len(s.calls) == 0 || len(s.stack) != s.depth || s.stack[s.depth-1] != '{' {
		return nil
	}
	return &s.calls[len(s.calls)-1]
}

func (s *callScan) stringStarts() {
	switch s.mstate {
	case mKey:
		s.keyStart = s.pos
	case mValue:
		s.valueStarts()
	}
}

func (s *callScan) stringEnded(text string) {
	c := s.current()
	if c == nil {
		return
	}
	switch s.mstate {
	case mKey:
		var k string
		if json.Unmarshal([]byte(text[s.keyStart:s.pos+1]), &k) == nil {
			s.key = k
		} else {
			s.key = ""
		}
		s.mstate = mColon
	case mIn:
		if s.key == s.nameKey && s.valStart > 0 && text[s.valStart-1] == '"' && c.nameEnd == 0 {
			c.nameStart, c.nameEnd = s.valStart-1, s.pos+1
		}
	}
}

// valueStarts marks the start of a member's value (s.pos is its first byte;
// for a string, the byte after its opening quote is valStart).
func (s *callScan) valueStarts() {
	c := s.current()
	s.mstate = mIn
	start := s.pos
	if s.inStr {
		start = s.pos + 1
	}
	s.valStart = start
	if c != nil && s.key == s.argsKey && c.argsStart < 0 {
		c.argsStart = s.pos
	}
}

// memberEnds closes the member in progress at a ',' or the object's '}'.
func (s *callScan) memberEnds() {
	c := s.current()
	if c != nil && s.mstate == mIn && s.key == s.argsKey && c.argsStart >= 0 && c.argsEnd < 0 {
		c.argsEnd = s.pos
	}
	s.key = ""
}

// name is call c's name once its string is complete.
func (c *scannedCall) name(text string) (string, bool) {
	if c.nameEnd == 0 {
		return "", false
	}
	var n string
	if json.Unmarshal([]byte(text[c.nameStart:c.nameEnd]), &n) != nil {
		return "", false
	}
	return n, true
}

// args is call c's arguments text so far (limit: the end of the text it may
// read), trailing whitespace cut: it only grows as more text comes.
func (c *scannedCall) args(text string, limit int) string {
	if c.argsStart < 0 {
		return ""
	}
	end := limit
	if c.argsEnd >= 0 {
		end = c.argsEnd
	}
	if end < c.argsStart {
		return ""
	}
	return strings.TrimRight(text[c.argsStart:end], " \t\n\r")
}
