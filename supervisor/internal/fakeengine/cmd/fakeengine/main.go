// Command fakeengine is a TEST DOUBLE: a fake engine process that speaks the
// real control protocol and has no model (see package fakeengine). The
// supervisor's tests launch it in place of a real engine.
//
//	fakeengine [serve] -role active|standby -control-socket PATH
//	           [-behavior normal|wrong-version|die-during-takeover|hang|garbage|fault]
//	           [-hello-pid self|wrong|N] [-connect-from self|child] [-pools tag:index:size,...]
//
// FAKEENGINE_BEHAVIOR sets the default behaviour. Exit status: 0 after
// Shutdown, 2 when refused, 1 on other errors; die-during-takeover dies by
// SIGKILL, fault exits 1 after printing a CUDA error line on stderr. A hung
// fake engine ignores SIGTERM, as a wedged engine would.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"strconv"
	"strings"
	"syscall"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
	"github.com/frmps/frmps/supervisor/control"
	"github.com/frmps/frmps/supervisor/internal/fakeengine"
)

func main() {
	os.Exit(run(os.Args[1:]))
}

func run(args []string) int {
	if len(args) > 0 && args[0] == "serve" {
		args = args[1:] // the real engine CLI's subcommand
	}
	fs := flag.NewFlagSet("fakeengine", flag.ContinueOnError)
	role := fs.String("role", "active", "active or standby")
	socket := fs.String("control-socket", "", "control socket path")
	behaviorDefault := os.Getenv("FAKEENGINE_BEHAVIOR")
	if behaviorDefault == "" {
		behaviorDefault = string(fakeengine.Normal)
	}
	behavior := fs.String("behavior", behaviorDefault, fmt.Sprintf("one of %v (default from FAKEENGINE_BEHAVIOR)", fakeengine.Behaviors))
	helloPID := fs.String("hello-pid", "self", "pid claimed in Hello: self, wrong (ours+1) or a number")
	connectFrom := fs.String("connect-from", "self", "self, or child: a child process connects (a wrong peer for SO_PEERCRED)")
	model := fs.String("model", "fake", "model name in Hello")
	pools := fs.String("pools", "", "pool layout tag:index:size,... (default: weights 64 KiB, kv_cache 128 KiB)")
	genSocket := fs.String("generation-socket", "", "generation endpoint reported in Hello: bound like a real engine's (its file stays when the engine is killed), not served")
	checkMarkers := fs.Bool("check-markers", true, "standby: verify the pool markers a fake active wrote")
	heartbeat := fs.Duration("heartbeat", 0, "send a Heartbeat at this interval while serving (0 = never)")
	// Accepted and ignored: the real engine CLI's options, so a supervisor
	// can launch this with the command line its engine adapter builds.
	for _, name := range []string{"engine", "memory", "device", "num-blocks", "max-model-len", "gpu-memory-utilization", "block-size", "sync-every", "dtype", "weights"} {
		fs.String(name, "", "ignored (real engine option)")
	}
	if err := fs.Parse(args); err != nil {
		return 2
	}

	cfg := fakeengine.Config{
		Socket:             *socket,
		Behavior:           fakeengine.Behavior(*behavior),
		Model:              *model,
		GenerationEndpoint: *genSocket,
		CheckMarkers:       *checkMarkers,
		HeartbeatEvery:     *heartbeat,
		Stderr:             os.Stderr,
	}
	switch *role {
	case "active":
		cfg.Role = frmpsv1.Role_ROLE_ACTIVE
	case "standby":
		cfg.Role = frmpsv1.Role_ROLE_STANDBY
	default:
		fmt.Fprintf(os.Stderr, "fakeengine: unknown role %q\n", *role)
		return 2
	}
	if !validBehavior(cfg.Behavior) {
		fmt.Fprintf(os.Stderr, "fakeengine: unknown behavior %q\n", *behavior)
		return 2
	}
	switch *helloPID {
	case "self":
	case "wrong":
		cfg.HelloPID = os.Getpid() + 1
	default:
		n, err := strconv.Atoi(*helloPID)
		if err != nil {
			fmt.Fprintf(os.Stderr, "fakeengine: -hello-pid %q: %v\n", *helloPID, err)
			return 2
		}
		cfg.HelloPID = n
	}
	if *pools != "" {
		p, err := parsePools(*pools)
		if err != nil {
			fmt.Fprintf(os.Stderr, "fakeengine: -pools: %v\n", err)
			return 2
		}
		cfg.Pools = p
	}
	switch *connectFrom {
	case "self":
	case "child":
		return runInChild(args)
	default:
		fmt.Fprintf(os.Stderr, "fakeengine: unknown -connect-from %q\n", *connectFrom)
		return 2
	}

	if *genSocket != "" {
		l, err := holdGenerationSocket(*genSocket)
		if err != nil {
			fmt.Fprintf(os.Stderr, "fakeengine: %v\n", err)
			return 1
		}
		defer l.Close()
	}

	ctx := context.Background()
	if cfg.Behavior == fakeengine.Hang {
		signal.Ignore(syscall.SIGTERM, syscall.SIGINT)
	} else {
		var stop context.CancelFunc
		ctx, stop = signal.NotifyContext(ctx, syscall.SIGTERM, syscall.SIGINT)
		defer stop()
	}
	err := fakeengine.Run(ctx, cfg)
	var exit *fakeengine.ExitError
	switch {
	case err == nil:
		return 0
	case errors.As(err, &exit):
		fmt.Fprintln(os.Stderr, exit.Error())
		if exit.Signal != 0 {
			_ = syscall.Kill(os.Getpid(), exit.Signal)
			select {} // the signal ends us
		}
		return exit.Code
	case errors.Is(err, context.Canceled):
		return 0 // SIGTERM: a clean stop
	case errors.Is(err, fakeengine.ErrRefused):
		fmt.Fprintln(os.Stderr, err)
		return 2
	default:
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
}

func validBehavior(b fakeengine.Behavior) bool {
	for _, known := range fakeengine.Behaviors {
		if b == known {
			return true
		}
	}
	return false
}

// runInChild re-executes this program so that a child process, not the
// one the supervisor launched, connects to the control socket.
func runInChild(args []string) int {
	childArgs := append([]string{}, args...)
	childArgs = append(childArgs, "-connect-from", "self")
	cmd := exec.Command(os.Args[0], childArgs...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	// The child must not outlive us (we are the supervisor's child).
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Run(); err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
				return 128 + int(ws.Signal())
			}
			return ee.ExitCode()
		}
		fmt.Fprintln(os.Stderr, "fakeengine: child:", err)
		return 1
	}
	return 0
}

func parsePools(spec string) ([]*frmpsv1.Pool, error) {
	var out []*frmpsv1.Pool
	for _, item := range strings.Split(spec, ",") {
		parts := strings.Split(item, ":")
		if len(parts) != 3 {
			return nil, fmt.Errorf("%q is not tag:index:size", item)
		}
		index, err := strconv.ParseUint(parts[1], 10, 32)
		if err != nil {
			return nil, fmt.Errorf("%q: index: %w", item, err)
		}
		size, err := strconv.ParseUint(parts[2], 10, 64)
		if err != nil {
			return nil, fmt.Errorf("%q: size: %w", item, err)
		}
		out = append(out, &frmpsv1.Pool{Tag: parts[0], Index: uint32(index), Size: size, Backend: control.BackendHostSHM})
	}
	if err := control.ValidateLayout(out); err != nil {
		return nil, err
	}
	return out, nil
}

// holdGenerationSocket binds path as a real engine's generation server does
// and closes every connection at once (the fake serves no generation API,
// so a client fails fast rather than waiting for a handshake).
func holdGenerationSocket(path string) (net.Listener, error) {
	l, err := net.Listen("unix", path)
	if err != nil {
		return nil, fmt.Errorf("generation socket: %w", err)
	}
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			_ = c.Close()
		}
	}()
	return l, nil
}
