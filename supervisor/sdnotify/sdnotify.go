// Package sdnotify tells systemd how a Type=notify service is doing, over
// the sd_notify protocol (go-systemd's daemon package): READY=1 once frmps
// can serve, WATCHDOG=1 while its event loop runs (the loop feeds the
// Notifier, see supervisor.Watchdog), STOPPING=1 when it shuts down.
// Without NOTIFY_SOCKET (not run by systemd) every method is a no-op.
//
// Messages go out from one goroutine, so that neither the event loop nor a
// caller ever blocks on the socket.
package sdnotify

import (
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/coreos/go-systemd/v22/daemon"
	"github.com/hashicorp/go-hclog"
)

// closeTimeout bounds how long Close waits for systemd to take the last
// messages (STOPPING=1).
const closeTimeout = 2 * time.Second

// Notifier sends sd_notify messages. Create with New, end with Close.
type Notifier struct {
	log      hclog.Logger
	watchdog time.Duration // WatchdogSec as systemd passed it; 0: none
	msgs     chan string   // READY, STATUS, STOPPING, in order
	pings    chan struct{} // WATCHDOG=1, coalesced
	quit     chan struct{}
	done     chan struct{}
	once     sync.Once
}

// New reads the notify socket and the watchdog settings systemd passed.
func New(log hclog.Logger) (*Notifier, error) {
	if log == nil {
		log = hclog.NewNullLogger()
	}
	n := &Notifier{log: log}
	if os.Getenv("NOTIFY_SOCKET") == "" {
		return n, nil
	}
	wd, err := daemon.SdWatchdogEnabled(false)
	if err != nil {
		return nil, fmt.Errorf("systemd watchdog settings: %w", err)
	}
	n.watchdog = wd
	n.msgs = make(chan string, 8)
	n.pings = make(chan struct{}, 1)
	n.quit = make(chan struct{})
	n.done = make(chan struct{})
	go n.run()
	return n, nil
}

// Enabled reports whether systemd listens.
func (n *Notifier) Enabled() bool { return n.done != nil }

// WatchdogInterval is how often to Feed: half of WatchdogSec, as
// sd_watchdog_enabled(3) advises; 0 when systemd set no watchdog.
func (n *Notifier) WatchdogInterval() time.Duration { return n.watchdog / 2 }

// Feed queues a WATCHDOG=1 without blocking; feeds that arrive while one is
// queued are merged into it.
func (n *Notifier) Feed() {
	if !n.Enabled() {
		return
	}
	select {
	case n.pings <- struct{}{}:
	default:
	}
}

// Ready says the service can serve.
func (n *Notifier) Ready(status string) {
	n.queue(daemon.SdNotifyReady + "\nSTATUS=" + oneLine(status))
}

// Stopping says the service is shutting down.
func (n *Notifier) Stopping(status string) {
	n.queue(daemon.SdNotifyStopping + "\nSTATUS=" + oneLine(status))
}

// Status updates the one-line status `systemctl status` shows.
func (n *Notifier) Status(status string) { n.queue("STATUS=" + oneLine(status)) }

func (n *Notifier) queue(msg string) {
	if !n.Enabled() {
		return
	}
	select {
	case n.msgs <- msg:
	case <-n.quit:
	default:
		n.log.Warn("systemd is not taking notifications; dropped one", "message", msg)
	}
}

// Close sends what is queued and stops the sender; it waits for systemd at
// most closeTimeout.
func (n *Notifier) Close() {
	if !n.Enabled() {
		return
	}
	n.once.Do(func() { close(n.quit) })
	select {
	case <-n.done:
	case <-time.After(closeTimeout):
		n.log.Warn("systemd did not take the last notifications", "waited", closeTimeout)
	}
}

func (n *Notifier) run() {
	defer close(n.done)
	var lastErr string
	send := func(msg string) {
		_, err := daemon.SdNotify(false, msg)
		if e := fmt.Sprint(err); err != nil && e != lastErr {
			n.log.Warn("sd_notify", "error", err)
			lastErr = e
		} else if err == nil {
			lastErr = ""
		}
	}
	for {
		select {
		case m := <-n.msgs:
			send(m)
		case <-n.pings:
			send(daemon.SdNotifyWatchdog)
		case <-n.quit:
			// What was queued before Close still goes out, a coalesced ping too.
			for {
				select {
				case m := <-n.msgs:
					send(m)
				case <-n.pings:
					send(daemon.SdNotifyWatchdog)
				default:
					return
				}
			}
		}
	}
}

// StripEnv removes systemd's notify and watchdog variables, so that child
// processes (the engines) do not speak to systemd for the service.
func StripEnv(env []string) []string {
	return slices.DeleteFunc(slices.Clone(env), func(kv string) bool {
		k, _, _ := strings.Cut(kv, "=")
		return k == "NOTIFY_SOCKET" || k == "WATCHDOG_USEC" || k == "WATCHDOG_PID"
	})
}

func oneLine(s string) string { return strings.ReplaceAll(s, "\n", " ") }
