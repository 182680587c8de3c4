// Package deathcause names why an engine process died, from its wait
// status, the last lines of its stderr and the Fault message it may have
// sent before exiting. The class is a metric label; the detail is for logs
// and status.
package deathcause

import (
	"fmt"
	"regexp"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
)

// Classes, in rule order. They are metric label values: never rename one.
const (
	MisalignedAddress        = "misaligned_address"
	IllegalMemoryAccess      = "illegal_memory_access"
	IllegalInstruction       = "illegal_instruction"
	HardwareStackError       = "hardware_stack_error"
	InvalidAddressSpace      = "invalid_address_space"
	UnspecifiedLaunchFailure = "unspecified_launch_failure"
	DeviceAssert             = "device_assert"
	CUDAOOM                  = "cuda_oom"
	NCCLError                = "nccl_error"
	Xid                      = "xid"
	FaultReported            = "fault_reported"
	Segfault                 = "segfault"
	Signal                   = "signal"
	ExitCode                 = "exit_code"
	Unknown                  = "unknown"
)

// Cause is the classified reason an engine died.
type Cause struct {
	Class  string
	Detail string
}

func (c Cause) String() string {
	if c.Detail == "" {
		return c.Class
	}
	return c.Class + ": " + c.Detail
}

// Classes lists every class Classify can return, so metrics can be
// pre-registered with all their label values.
func Classes() []string {
	return []string{
		MisalignedAddress, IllegalMemoryAccess, IllegalInstruction, HardwareStackError,
		InvalidAddressSpace, UnspecifiedLaunchFailure, DeviceAssert, CUDAOOM, NCCLError,
		Xid, FaultReported, Segfault, Signal, ExitCode, Unknown,
	}
}

// textRule matches a line of text (stderr or the Fault message).
type textRule struct {
	class string
	re    *regexp.Regexp
	// detail renders the Detail from the match; nil: the matched line.
	detail func(m []string) string
}

// textRules are tried in order: the first rule that matches any line wins,
// so a specific CUDA error beats the generic errors it often drags along
// (an illegal address is followed by NCCL and launch errors in the same
// log). The patterns cover the CUDA runtime strings ("misaligned
// address"), the enum names (cudaErrorMisalignedAddress) and the driver
// names (CUDA_ERROR_MISALIGNED_ADDRESS).
var textRules = []textRule{
	{class: MisalignedAddress, re: regexp.MustCompile(`(?i)misaligned address|cudaErrorMisalignedAddress|CUDA_ERROR_MISALIGNED_ADDRESS`)},
	{class: IllegalMemoryAccess, re: regexp.MustCompile(`(?i)illegal memory access|an illegal address|cudaErrorIllegalAddress|CUDA_ERROR_ILLEGAL_ADDRESS`)},
	{class: IllegalInstruction, re: regexp.MustCompile(`(?i)an illegal instruction was encountered|cudaErrorIllegalInstruction|CUDA_ERROR_ILLEGAL_INSTRUCTION|CUDA error: illegal instruction`)},
	{class: HardwareStackError, re: regexp.MustCompile(`(?i)hardware stack error|lane user stack overflow|cudaErrorHardwareStackError|CUDA_ERROR_HARDWARE_STACK_ERROR`)},
	{class: InvalidAddressSpace, re: regexp.MustCompile(`(?i)invalid address space|not supported on global/shared address space|cudaErrorInvalidAddressSpace|CUDA_ERROR_INVALID_ADDRESS_SPACE`)},
	{class: UnspecifiedLaunchFailure, re: regexp.MustCompile(`(?i)unspecified launch failure|cudaErrorLaunchFailure\b|CUDA_ERROR_LAUNCH_FAILED`)},
	{class: DeviceAssert, re: regexp.MustCompile("(?i)device-side assert|cudaErrorAssert|CUDA_ERROR_ASSERT|block: \\[\\d+,\\d+,\\d+\\], thread: \\[\\d+,\\d+,\\d+\\] Assertion")},
	{class: CUDAOOM, re: regexp.MustCompile(`(?i)CUDA out of memory|OutOfMemoryError|cudaErrorMemoryAllocation|CUDA_ERROR_OUT_OF_MEMORY|CUDA error: out of memory`)},
	{class: NCCLError, re: regexp.MustCompile(`(?i)NCCL error|ncclSystemError|ncclInternalError|ncclUnhandledCudaError|ncclInvalidUsage|ncclRemoteError|DistBackendError`)},
	{
		class: Xid,
		// "NVRM: Xid (PCI:0000:3b:00): 13, pid=..., ..." as the kernel logs it.
		re:     regexp.MustCompile(`\bXid\b\s*(?:\([^)]*\))?\s*:?\s*(\d+)`),
		detail: func(m []string) string { return "Xid " + m[1] },
	},
}

// maxDetail bounds Detail: a stderr line can be a whole tensor dump.
const maxDetail = 300

// Classify names why an engine died. reported is the Fault the engine sent
// before exiting, or nil. Text rules look at the Fault first, then at
// lastStderr (newest line first); then a reported Fault of an unknown kind;
// then the wait status.
func Classify(ws syscall.WaitStatus, lastStderr []string, reported *frmpsv1.Fault) Cause {
	var lines []string
	if reported != nil {
		for _, s := range []string{reported.GetCause(), reported.GetDetail()} {
			if s != "" {
				lines = append(lines, s)
			}
		}
	}
	for i := len(lastStderr) - 1; i >= 0; i-- {
		lines = append(lines, lastStderr[i])
	}
	for _, r := range textRules {
		for _, line := range lines {
			m := r.re.FindStringSubmatch(line)
			if m == nil {
				continue
			}
			detail := strings.TrimSpace(line)
			if r.detail != nil {
				detail = r.detail(m) + ": " + detail
			}
			return Cause{Class: r.class, Detail: truncate(detail)}
		}
	}
	if reported != nil && (reported.GetCause() != "" || reported.GetDetail() != "") {
		detail := reported.GetCause()
		if d := reported.GetDetail(); d != "" {
			detail = strings.TrimPrefix(detail+": "+d, ": ")
		}
		return Cause{Class: FaultReported, Detail: truncate(detail)}
	}
	c := fromStatus(ws)
	if c.Class == ExitCode && ws.ExitStatus() != 0 {
		// A plain error exit: the newest stderr line is usually the error itself
		// (a Python traceback ends with the exception).
		if line := lastLine(lastStderr); line != "" {
			c.Detail = truncate(c.Detail + "; last stderr line: " + line)
		}
	}
	return c
}

// lastLine is the newest non-blank line of lines, trimmed.
func lastLine(lines []string) string {
	for i := len(lines) - 1; i >= 0; i-- {
		if l := strings.TrimSpace(lines[i]); l != "" {
			return l
		}
	}
	return ""
}

func fromStatus(ws syscall.WaitStatus) Cause {
	switch {
	case ws.Signaled() && ws.Signal() == syscall.SIGSEGV:
		return Cause{Class: Segfault, Detail: "segfault (SIGSEGV)" + coreNote(ws)}
	case ws.Signaled():
		sig := ws.Signal()
		return Cause{Class: Signal, Detail: fmt.Sprintf("killed by signal %d (%s)%s", int(sig), signalName(sig), coreNote(ws))}
	case ws.Exited():
		return Cause{Class: ExitCode, Detail: fmt.Sprintf("exit code %d", ws.ExitStatus())}
	default:
		return Cause{Class: Unknown, Detail: fmt.Sprintf("wait status %#x", uint32(ws))}
	}
}

func signalName(sig syscall.Signal) string {
	if name := unix.SignalName(sig); name != "" {
		return name
	}
	return sig.String()
}

func coreNote(ws syscall.WaitStatus) string {
	if ws.CoreDump() {
		return ", core dumped"
	}
	return ""
}

func truncate(s string) string {
	if len(s) <= maxDetail {
		return s
	}
	cut := maxDetail
	for cut > 0 && !isRuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + "…"
}

func isRuneStart(b byte) bool { return b&0xC0 != 0x80 }

// errorLine matches a line that reports an error: a log record at ERROR or
// CRITICAL level (the engines' "<time> ERROR <logger>: <message>"), a Python
// exception line ("ValueError: ..."), argparse's "prog: error: ...".
var errorLine = regexp.MustCompile(`\b(ERROR|CRITICAL|FATAL)\b|^[A-Za-z_][\w.]*(Error|Exception|Exit): |: error: `)

// Reason is the one line that says why an engine that never started
// exited: the newest line of its stderr that reports an error, else its
// newest line; "" when it wrote nothing. A log record's time stamp is dropped.
func Reason(lastStderr []string) string {
	for i := len(lastStderr) - 1; i >= 0; i-- {
		l := strings.TrimSpace(lastStderr[i])
		if l != "" && errorLine.MatchString(l) {
			return truncate(stripStamp(l))
		}
	}
	return truncate(stripStamp(lastLine(lastStderr)))
}

// stamp is the engines' log time stamp ("2026-11-29 01:32:02,155 ").
var stamp = regexp.MustCompile(`^\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[.,]\d+)? `)

func stripStamp(l string) string { return stamp.ReplaceAllString(l, "") }
