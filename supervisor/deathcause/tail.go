package deathcause

import (
	"bytes"
	"sync"
)

// maxLine bounds one kept line; longer lines are cut (a CUDA error message
// is short, a tensor dump is not).
const maxLine = 4096

// Tail is an io.Writer that keeps the last N complete lines written to it,
// for Classify. Tee an engine's stderr into it. Safe for concurrent use.
type Tail struct {
	mu      sync.Mutex
	n       int
	lines   []string // ring of the last n lines
	next    int
	full    bool
	partial []byte // current line, not yet terminated
}

// NewTail keeps the last n lines (n >= 1).
func NewTail(n int) *Tail {
	n = max(n, 1)
	return &Tail{n: n, lines: make([]string, n)}
}

// Write never fails.
func (t *Tail) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	written := len(p)
	for len(p) > 0 {
		i := bytes.IndexByte(p, '\n')
		if i < 0 {
			t.appendPartial(p)
			break
		}
		t.appendPartial(p[:i])
		t.push(string(bytes.TrimRight(t.partial, "\r")))
		t.partial = t.partial[:0]
		p = p[i+1:]
	}
	return written, nil
}

func (t *Tail) appendPartial(p []byte) {
	if room := maxLine - len(t.partial); room > 0 {
		t.partial = append(t.partial, p[:min(len(p), room)]...)
	}
}

func (t *Tail) push(line string) {
	t.lines[t.next] = line
	t.next = (t.next + 1) % t.n
	if t.next == 0 {
		t.full = true
	}
}

// Lines returns the kept lines, oldest first, plus an unterminated last
// line if any (a process killed mid-write still leaves its last words).
func (t *Tail) Lines() []string {
	t.mu.Lock()
	defer t.mu.Unlock()
	var out []string
	if t.full {
		out = append(out, t.lines[t.next:]...)
	}
	out = append(out, t.lines[:t.next]...)
	if len(t.partial) > 0 {
		out = append(out, string(t.partial))
	}
	return out
}
