package mps

import (
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"syscall"
	"time"
)

// ServerLogName is the MPS server's log file in the daemon's log directory.
const ServerLogName = "server.log"

// DefaultServerLogPoll is how often ServerLog.Watch looks for new lines: one
// read(2) of an unchanged file costs about a microsecond.
const DefaultServerLogPoll = 2 * time.Millisecond

// Teardown is the MPS server saying it is tearing down a client's context
// after a fatal GPU error (its own or another client's). On the H100 (driver
// 580) the line is written 25-320 ms before the faulted client's own CUDA
// call returns the error and the process dies.
type Teardown struct {
	PID  int       // the client process whose context is torn down
	Line string    // the server's log line
	Seen time.Time // when the watcher read the line
}

// teardownLine matches the server's lines that doom a client:
//
//	[2026-11-23 22:19:03.147 Server  1623] Client {PID: 1978, Context: 1} encountered a fatal GPU error.
//	[2026-11-23 22:19:03.147 Server  1623] Client {PID: 1978, Context ID: 1} on device 0 to be torn down
//	[2026-11-23 22:19:03.147 Server  1623] Client {PID: 1978, Context ID: 1} on the error-trigging process 1978 to be torn down
var teardownLine = regexp.MustCompile(`\] Client \{PID: (\d+), Context(?: ID)?: \d+\} (?:encountered a fatal GPU error|.*to be torn down)`)

// ParseTeardown returns the client pid a server log line dooms, or 0.
func ParseTeardown(line []byte) int {
	m := teardownLine.FindSubmatch(line)
	if m == nil {
		return 0
	}
	pid, err := strconv.Atoi(string(m[1]))
	if err != nil {
		return 0
	}
	return pid
}

// ServerLog follows an MPS server.log. The file may not exist yet (no MPS
// server until the first client), and a restarted daemon may replace or
// truncate it, which the watcher follows by inode and size.
type ServerLog struct {
	path    string
	f       *os.File
	ino     uint64
	off     int64
	partial []byte
	buf     [16 << 10]byte
}

// OpenServerLog starts following path: what it holds now is history, never
// reported; a file created later is read from its start.
func OpenServerLog(path string) *ServerLog {
	w := &ServerLog{path: path}
	w.open(true)
	return w
}

// Watch reports every teardown line written after OpenServerLog, polling
// every poll (DefaultServerLogPoll when 0), until ctx ends; it closes the file.
func (w *ServerLog) Watch(ctx context.Context, poll time.Duration, report func(Teardown)) {
	if poll <= 0 {
		poll = DefaultServerLogPoll
	}
	defer w.close()
	t := time.NewTicker(poll)
	defer t.Stop()
	for {
		w.read(report)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// open opens the file; at the start of the watch it skips what is there.
func (w *ServerLog) open(skipExisting bool) {
	f, err := os.Open(w.path)
	if err != nil {
		return
	}
	fi, err := f.Stat()
	if err != nil {
		_ = f.Close()
		return
	}
	w.f, w.ino, w.off, w.partial = f, inode(fi), 0, nil
	if skipExisting {
		w.off = fi.Size()
	}
}

func (w *ServerLog) close() {
	if w.f != nil {
		_ = w.f.Close()
		w.f = nil
	}
}

// read consumes what was appended since the last call.
func (w *ServerLog) read(report func(Teardown)) {
	if w.f == nil {
		w.open(false) // created after the watch began: all of it is new
		if w.f == nil {
			return
		}
	} else if fi, err := os.Stat(w.path); err == nil && (inode(fi) != w.ino || fi.Size() < w.off) {
		w.close() // replaced or truncated: a new server's log
		w.open(false)
		if w.f == nil {
			return
		}
	}
	for {
		n, err := w.f.ReadAt(w.buf[:], w.off)
		if n > 0 {
			w.off += int64(n)
			w.lines(w.buf[:n], report)
		}
		if n < len(w.buf) || (err != nil && !errors.Is(err, io.EOF)) {
			return
		}
	}
}

func (w *ServerLog) lines(b []byte, report func(Teardown)) {
	now := time.Now()
	for {
		i := bytes.IndexByte(b, '\n')
		if i < 0 {
			if len(w.partial)+len(b) <= 64<<10 { // a line longer than that is not the server's
				w.partial = append(w.partial, b...)
			}
			return
		}
		line := b[:i]
		if len(w.partial) > 0 {
			line = append(w.partial, line...)
			w.partial = nil
		}
		if pid := ParseTeardown(line); pid > 0 {
			report(Teardown{PID: pid, Line: string(bytes.TrimSpace(line)), Seen: now})
		}
		b = b[i+1:]
	}
}

func inode(fi os.FileInfo) uint64 {
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		return st.Ino
	}
	return 0
}

// ServerLogPath is the server log of the daemon whose log directory is dir
// ("" when dir is).
func ServerLogPath(dir string) string {
	if dir == "" {
		return ""
	}
	return filepath.Join(dir, ServerLogName)
}
