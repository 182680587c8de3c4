package deathcause

import (
	"os/exec"
	"strings"
	"syscall"
	"testing"

	"go.uber.org/goleak"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// Wait statuses as the kernel encodes them (see wait(2)).
func exited(code int) syscall.WaitStatus             { return syscall.WaitStatus(code << 8) }
func signaled(sig syscall.Signal) syscall.WaitStatus { return syscall.WaitStatus(sig) }
func cored(sig syscall.Signal) syscall.WaitStatus    { return syscall.WaitStatus(int(sig) | 0x80) }

func TestClassify(t *testing.T) {
	traceback := []string{
		"Traceback (most recent call last):",
		`  File "/opt/engine/runner.py", line 212, in step`,
		"    torch.cuda.synchronize()",
	}
	withTB := func(lines ...string) []string { return append(append([]string(nil), traceback...), lines...) }
	cases := []struct {
		name     string
		ws       syscall.WaitStatus
		stderr   []string
		fault    *frmpsv1.Fault
		class    string
		inDetail string
	}{
		{"torch misaligned", exited(1), withTB(
			"torch.AcceleratorError: CUDA error: misaligned address",
			"CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might be incorrect.",
			"For debugging consider passing CUDA_LAUNCH_BLOCKING=1",
			"Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions."),
			nil, MisalignedAddress, "torch.AcceleratorError: CUDA error: misaligned address"},
		{"illegal memory access", exited(1), withTB("RuntimeError: CUDA error: an illegal memory access was encountered"),
			nil, IllegalMemoryAccess, "an illegal memory access was encountered"},
		{"illegal address driver name", exited(1), []string{"cuMemcpyDtoH failed: CUDA_ERROR_ILLEGAL_ADDRESS"},
			nil, IllegalMemoryAccess, "CUDA_ERROR_ILLEGAL_ADDRESS"},
		{"illegal instruction enum", exited(1), []string{"cudaStreamSynchronize returned cudaErrorIllegalInstruction (715)"},
			nil, IllegalInstruction, "cudaErrorIllegalInstruction"},
		{"illegal instruction string", exited(1), withTB("RuntimeError: CUDA error: an illegal instruction was encountered"),
			nil, IllegalInstruction, "illegal instruction"},
		{"hardware stack error", exited(1), withTB("torch.AcceleratorError: CUDA error: hardware stack error"),
			nil, HardwareStackError, "hardware stack error"},
		{"lane user stack overflow", exited(1), []string{"ERROR: lane user stack overflow in kernel decode_step"},
			nil, HardwareStackError, "lane user stack overflow"},
		{"invalid address space", exited(1), withTB("RuntimeError: CUDA error: operation not supported on global/shared address space"),
			nil, InvalidAddressSpace, "global/shared address space"},
		{"invalid address space enum", exited(1), []string{"cudaErrorInvalidAddressSpace"},
			nil, InvalidAddressSpace, "cudaErrorInvalidAddressSpace"},
		{"unspecified launch failure", exited(1), withTB("RuntimeError: CUDA error: unspecified launch failure"),
			nil, UnspecifiedLaunchFailure, "unspecified launch failure"},
		{"device-side assert", exited(1), withTB(
			"../aten/src/ATen/native/cuda/IndexKernel.cu:92: operator(): block: [0,0,0], thread: [3,0,0] Assertion `-sizes[i] <= index && index < sizes[i] && \"index out of bounds\"` failed.",
			"RuntimeError: CUDA error: device-side assert triggered"),
			nil, DeviceAssert, "device-side assert triggered"},
		{"kernel assertion only", signaled(syscall.SIGABRT), []string{
			"IndexKernel.cu:92: operator(): block: [12,0,0], thread: [64,0,0] Assertion `index out of bounds` failed."},
			nil, DeviceAssert, "Assertion"},
		{"torch OOM", exited(1), withTB(
			"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.06 GiB is free."),
			nil, CUDAOOM, "Tried to allocate 2.00 GiB"},
		{"cuda error out of memory", exited(1), []string{"RuntimeError: CUDA error: out of memory"},
			nil, CUDAOOM, "out of memory"},
		{"nccl", exited(1), withTB(
			"torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:317, unhandled system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5",
			"ncclSystemError: System call (e.g. socket, malloc) or external library call failed or device error."),
			nil, NCCLError, "ncclSystemError"},
		{"xid", signaled(syscall.SIGKILL), []string{
			"NVRM: Xid (PCI:0000:3b:00): 13, pid=4242, name=python3, Graphics SM Warp Exception on (GPC 1, TPC 2, SM 0): Misaligned PC"},
			nil, Xid, "Xid 13: NVRM"},
		{"xid 79", exited(1), []string{"[12345.678] NVRM: Xid (PCI:0000:ca:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."},
			nil, Xid, "Xid 79"},
		{"segfault", signaled(syscall.SIGSEGV), []string{"Fatal Python error: Segmentation fault"}, nil, Segfault, "SIGSEGV"},
		{"segfault with core", cored(syscall.SIGSEGV), nil, nil, Segfault, "core dumped"},
		{"sigkill", signaled(syscall.SIGKILL), []string{"INFO step 1200"}, nil, Signal, "killed by signal 9 (SIGKILL)"},
		{"sigabrt", signaled(syscall.SIGABRT), []string{"terminate called after throwing an instance of 'std::runtime_error'"},
			nil, Signal, "killed by signal 6 (SIGABRT)"},
		{"exit code", exited(3), []string{"ValueError: bad config"}, nil, ExitCode, "exit code 3"},
		{"exit code names the last stderr line", exited(1), withTB("AssertionError", "  "), nil, ExitCode,
			"exit code 1; last stderr line: AssertionError"},
		{"clean exit", exited(0), []string{"INFO bye"}, nil, ExitCode, "exit code 0"},
		{"stopped is unknown", syscall.WaitStatus(0x137f), nil, nil, Unknown, "wait status"},

		// Rule order: the specific CUDA error wins over what it drags along.
		{"misaligned beats launch failure and nccl", exited(1), []string{
			"RuntimeError: CUDA error: misaligned address",
			"RuntimeError: CUDA error: unspecified launch failure",
			"ncclUnhandledCudaError: Call to CUDA function failed.",
		}, nil, MisalignedAddress, "misaligned"},
		{"text beats the signal", signaled(syscall.SIGABRT), []string{"RuntimeError: CUDA error: an illegal memory access was encountered"},
			nil, IllegalMemoryAccess, "illegal memory access"},
		{"reported fault is classified", signaled(syscall.SIGKILL), nil,
			&frmpsv1.Fault{Cause: "misaligned address", Detail: "step 77, sync after decode"}, MisalignedAddress, "misaligned address"},
		{"reported fault detail is searched", exited(1), nil,
			&frmpsv1.Fault{Cause: "sticky CUDA error", Detail: "cudaErrorLaunchFailure"}, UnspecifiedLaunchFailure, "cudaErrorLaunchFailure"},
		{"unknown reported fault beats the status", signaled(syscall.SIGKILL), []string{"INFO all good"},
			&frmpsv1.Fault{Cause: "watchdog", Detail: "decode step took 30s"}, FaultReported, "watchdog: decode step took 30s"},
		{"empty fault is ignored", exited(2), nil, &frmpsv1.Fault{}, ExitCode, "exit code 2"},
		{"healthy log lines do not match", exited(1), []string{
			"INFO memory: 1.2 GiB free", "INFO address space reserved for pools", "INFO xid support: none",
			"INFO instruction count 42"}, nil, ExitCode, "exit code 1"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got := Classify(tc.ws, tc.stderr, tc.fault)
			if got.Class != tc.class {
				t.Fatalf("class %q (%s), want %q", got.Class, got, tc.class)
			}
			if !strings.Contains(got.Detail, tc.inDetail) {
				t.Fatalf("detail %q does not contain %q", got.Detail, tc.inDetail)
			}
			if got.Class == ExitCode && tc.ws.ExitStatus() == 0 && strings.Contains(got.Detail, "stderr") {
				t.Fatalf("a clean exit names no error line: %q", got.Detail)
			}
		})
	}
}

func TestClassifyNewestLineWins(t *testing.T) {
	got := Classify(exited(1), []string{
		"NVRM: Xid (PCI:0000:3b:00): 13, old",
		"NVRM: Xid (PCI:0000:3b:00): 31, newest",
	}, nil)
	if got.Class != Xid || !strings.HasPrefix(got.Detail, "Xid 31") {
		t.Fatalf("got %s, want the newest Xid (31)", got)
	}
}

func TestClassifyBoundsDetail(t *testing.T) {
	long := "RuntimeError: CUDA error: misaligned address " + strings.Repeat("é", 1000)
	got := Classify(exited(1), []string{long}, nil)
	if len(got.Detail) > maxDetail+len("…") || !strings.HasSuffix(got.Detail, "…") {
		t.Fatalf("detail is %d bytes", len(got.Detail))
	}
	if !strings.Contains(got.Detail, "misaligned") || !utf8Valid(got.Detail) {
		t.Fatalf("bad truncation: %q", got.Detail)
	}
}

func utf8Valid(s string) bool { return strings.ToValidUTF8(s, "?") == s }

// Real wait statuses from real processes, not hand-built ones.
func TestClassifyRealProcesses(t *testing.T) {
	run := func(script string) syscall.WaitStatus {
		cmd := exec.Command("/bin/sh", "-c", script)
		_ = cmd.Run()
		return cmd.ProcessState.Sys().(syscall.WaitStatus)
	}
	if got := Classify(run("exit 7"), nil, nil); got.Class != ExitCode || got.Detail != "exit code 7" {
		t.Errorf("exit 7: %s", got)
	}
	if got := Classify(run("kill -9 $$"), nil, nil); got.Class != Signal || !strings.Contains(got.Detail, "signal 9") {
		t.Errorf("kill -9: %s", got)
	}
	if got := Classify(run("kill -SEGV $$"), nil, nil); got.Class != Segfault {
		t.Errorf("SIGSEGV: %s", got)
	}
}

func TestClassesCoverEveryResult(t *testing.T) {
	known := map[string]bool{}
	for _, c := range Classes() {
		known[c] = true
	}
	for _, r := range textRules {
		if !known[r.class] {
			t.Errorf("rule class %q missing from Classes()", r.class)
		}
	}
	if len(known) != 15 {
		t.Errorf("%d classes, want the 15 of the metric contract", len(known))
	}
}

func TestReason(t *testing.T) {
	for _, tc := range []struct {
		name  string
		lines []string
		want  string
	}{
		{"engine refusal", []string{
			"2026-11-29 01:32:02,155 INFO frmps_engine: loading tiny",
			"2026-11-29 01:32:02,201 ERROR frmps_engine: engine cannot start: --num-blocks is required",
			"2026-11-29 01:32:02,202 INFO frmps_engine: bye",
		}, "ERROR frmps_engine: engine cannot start: --num-blocks is required"},
		{"traceback", []string{"Traceback (most recent call last):", `  File "x.py", line 1, in <module>`,
			"ValueError: --num-blocks is required with --engine vllm"}, "ValueError: --num-blocks is required with --engine vllm"},
		{"argparse", []string{"usage: frmps-engine [-h] ...", "frmps-engine: error: unrecognized arguments: --bogus"},
			"frmps-engine: error: unrecognized arguments: --bogus"},
		{"no error line", []string{"starting", "  the end  ", ""}, "the end"},
		{"nothing", nil, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := Reason(tc.lines); got != tc.want {
				t.Fatalf("Reason = %q, want %q", got, tc.want)
			}
		})
	}
}
