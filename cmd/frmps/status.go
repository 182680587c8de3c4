package main

import (
	"context"
	"fmt"
	"io"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/encoding/protojson"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
)

func newStatusCmd() *cobra.Command {
	var addr string
	var asJSON bool
	var timeout time.Duration
	cmd := &cobra.Command{
		Use:   "status",
		Short: "Show the state of a running frmps (engines, failovers) through its admin API",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx, cancel := context.WithTimeout(cmd.Context(), timeout)
			defer cancel()
			st, err := fetchStatus(ctx, addr)
			if err != nil {
				return err
			}
			if asJSON {
				b, err := protojson.MarshalOptions{Multiline: true, EmitUnpopulated: true}.Marshal(st)
				if err != nil {
					return fmt.Errorf("encode status: %w", err)
				}
				_, err = fmt.Fprintln(cmd.OutOrStdout(), string(b))
				return err
			}
			return printStatus(cmd.OutOrStdout(), st, time.Now())
		},
	}
	cmd.Flags().StringVar(&addr, "admin-addr", "127.0.0.1:8001", "admin API address of the running frmps")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the status as JSON")
	cmd.Flags().DurationVar(&timeout, "timeout", 5*time.Second, "give up after this long")
	return cmd
}

func fetchStatus(ctx context.Context, addr string) (*frmpsv1.Status, error) {
	cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, fmt.Errorf("admin client: %w", err)
	}
	defer cc.Close()
	st, err := frmpsv1.NewAdminClient(cc).GetStatus(ctx, &frmpsv1.GetStatusRequest{})
	if err != nil {
		return nil, fmt.Errorf("get status from %s (is frmps serve running?): %w", addr, err)
	}
	return st, nil
}

func printStatus(w io.Writer, st *frmpsv1.Status, now time.Time) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintf(tw, "state:\t%s\t(%s)\n", st.GetState(), st.GetStateCause())
	tp := ""
	if n := st.GetTensorParallelSize(); n > 1 {
		tp = fmt.Sprintf(", tensor parallel %d", n)
	}
	fmt.Fprintf(tw, "model:\t%s\tengine %s%s, sync every %d steps, frmps %s\n", st.GetModel(), st.GetEngine(), tp, st.GetSyncEvery(), st.GetVersion())
	mps := "off"
	if st.GetMps() {
		mps = st.GetMpsState()
	}
	if r := st.GetResolved(); r != nil {
		fmt.Fprintf(tw, "resolved:\tdevice=%s memory=%s engine=%s model=%s\t(why: %s)\n", r.GetDevice(), r.GetMemory(), r.GetEngine(), r.GetModel(), r.GetReason())
	}
	fmt.Fprintf(tw, "mps:\t%s\n", mps)
	fmt.Fprintf(tw, "ring:\tlag %d records, %d resyncs, %d live requests\n", st.GetRingLagRecords(), st.GetRingResyncs(), st.GetLiveRequests())
	if line := kvBudgetLine(st); line != "" {
		fmt.Fprintf(tw, "kv cache:\t%s\n", line)
	}
	breaker := "closed"
	if st.GetCrashLoopOpen() {
		breaker = "OPEN: engines are not restarted"
	}
	fmt.Fprintf(tw, "crash-loop breaker:\t%s\n", breaker)
	if fb := st.GetFailback(); fb != nil {
		line := fb.GetState()
		if fb.GetEnabled() {
			line += fmt.Sprintf(", placement ok %v, %d done, %d failed", fb.GetPlacementOk(), fb.GetSucceeded(), fb.GetFailed())
			if fb.GetLastUnixNanos() > 0 {
				line += fmt.Sprintf(", last %s ago in %s", now.Sub(time.Unix(0, fb.GetLastUnixNanos())).Truncate(time.Second),
					time.Duration(fb.GetLastDurationSeconds()*float64(time.Second)).Round(time.Microsecond))
			}
			if fb.GetNextAttemptUnixNanos() > 0 {
				line += fmt.Sprintf(", next in %s", time.Unix(0, fb.GetNextAttemptUnixNanos()).Sub(now).Round(time.Millisecond))
			}
			if fb.GetLastError() != "" {
				line += "; last error: " + fb.GetLastError()
			}
		}
		fmt.Fprintf(tw, "failback:\t%s\n", line)
	}
	if sp := st.GetSpare(); sp != nil {
		line := sp.GetState()
		if sp.GetPid() > 0 {
			line += fmt.Sprintf(" (pid %d)", sp.GetPid())
		}
		if sp.GetEnabled() {
			if sp.GetSize() > 1 {
				line += fmt.Sprintf(", %d of %d ready", sp.GetReadyCount(), sp.GetSize())
			}
			if sp.GetRssBytes() > 0 {
				line += fmt.Sprintf(", %d MiB host memory", sp.GetRssBytes()>>20)
			}
			line += fmt.Sprintf(", %d engines launched from spares, %d cold", sp.GetActivations(), sp.GetColdStarts())
			if sp.GetLastReadySeconds() > 0 {
				line += fmt.Sprintf(", imports took %.1fs", sp.GetLastReadySeconds())
			}
		}
		fmt.Fprintf(tw, "spare:\t%s\n", line)
	}
	if fe := st.GetFrontend(); fe != nil {
		line := strings.TrimSpace(fe.GetKind()+" "+fe.GetVllmVersion()) + fmt.Sprintf(" (pid %d): %s", fe.GetPid(), fe.GetState())
		if fe.GetEngineConnected() {
			line += fmt.Sprintf(", engine connected, %d open requests", fe.GetOpenRequests())
		}
		line += fmt.Sprintf(", %d engines lost, %d back", fe.GetEngineLost(), fe.GetEngineBack())
		if fe.GetLastError() != "" {
			line += "; last error: " + fe.GetLastError()
		}
		fmt.Fprintf(tw, "frontend:\t%s\n", line)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintln(w)
	tw = tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ROLE\tPID\tSTATE\tIN MPS\tRESTARTS\tUP\tENGINE\tWEIGHTS\tREQUESTS\tLAST DEATH\tLOG")
	for _, e := range st.GetEngines() {
		up := "-"
		if e.GetStartedUnixNanos() > 0 {
			up = now.Sub(time.Unix(0, e.GetStartedUnixNanos())).Truncate(time.Second).String()
		}
		eng := dash(strings.TrimSpace(e.GetEngine() + " " + e.GetDevice()))
		if e.GetInitSeconds() > 0 {
			from := ""
			if e.GetFromSpare() {
				from = " from a spare"
			}
			eng += fmt.Sprintf(" (up in %.1fs%s)", e.GetInitSeconds(), from)
		}
		reqs := fmt.Sprintf("%d running, %d waiting", e.GetRunning(), e.GetWaiting())
		fmt.Fprintf(tw, "%s\t%d\t%s\t%v\t%d\t%s\t%s\t%s\t%s\t%s\t%s\n", e.GetRole(), e.GetPid(), e.GetState(), e.GetInMps(), e.GetRestarts(), up,
			eng, dash(e.GetWeights()), reqs, dash(e.GetLastDeathCause()), dash(e.GetLogPath()))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if len(st.GetFailovers()) == 0 {
		_, err := fmt.Fprintln(w, "\nno failovers")
		return err
	}
	fmt.Fprintln(w)
	tw = tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "FAILOVER\tWHEN\tCAUSE\tDURATION\tRESUMED\tOK\tDETAIL")
	for _, f := range st.GetFailovers() {
		detail := f.GetDetail()
		if f.GetError() != "" {
			detail = f.GetError()
		}
		fmt.Fprintf(tw, "#%d\t%s\t%s\t%s\t%d\t%v\t%s\n", f.GetSeq(), time.Unix(0, f.GetUnixNanos()).UTC().Format(time.RFC3339),
			f.GetCause(), time.Duration(f.GetDurationSeconds()*float64(time.Second)).Round(time.Microsecond), f.GetResumedRequests(), f.GetOk(), strings.TrimSpace(detail))
	}
	return tw.Flush()
}

// kvBudgetLine describes the KV sizing the active (else any engine) reported
// in its Hello; "" when none did.
func kvBudgetLine(st *frmpsv1.Status) string {
	var b *frmpsv1.KVBudget
	for _, e := range st.GetEngines() {
		if kb := e.GetKvBudget(); kb != nil && (b == nil || e.GetRole() == "active") {
			b = kb
		}
	}
	if b == nil {
		return ""
	}
	gib := func(n uint64) string { return fmt.Sprintf("%.2f GiB", float64(n)/(1<<30)) }
	line := fmt.Sprintf("%d blocks of %d bytes = %s (%s); budget %s = %g x %s: weights %s, reserved %s",
		b.GetNumBlocks(), b.GetBlockBytes(), gib(b.GetKvBytes()), b.GetSource(), gib(b.GetBudgetBytes()),
		b.GetUtilization(), gib(b.GetGpuTotalBytes()), gib(b.GetWeightsBytes()), gib(b.GetReservedBytes()))
	if r := b.GetReserved(); len(r) > 0 {
		keys := make([]string, 0, len(r))
		for k := range r {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		parts := make([]string, len(keys))
		for i, k := range keys {
			parts[i] = k + " " + gib(r[k])
		}
		line += " (" + strings.Join(parts, ", ") + ")"
	}
	return line
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
