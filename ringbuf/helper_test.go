package ringbuf

import (
	"fmt"
	"os"
	"strconv"
)

// helperMain is the writer process of the crash test (the test binary
// re-executed with FRMPS_RING_HELPER set): it attaches to the ring and
// publishes a seeded workload as fast as it can until it is killed.
func helperMain() int {
	seed, err := strconv.ParseUint(os.Getenv("FRMPS_RING_SEED"), 10, 64)
	if err != nil {
		fmt.Fprintln(os.Stderr, "helper:", err)
		return 2
	}
	w, err := OpenWriter(os.Getenv("FRMPS_RING_PATH"))
	if err != nil {
		fmt.Fprintln(os.Stderr, "helper:", err)
		return 2
	}
	wl := newWorkload(seed)
	if _, err := w.Publish(0, nil, true); err != nil {
		fmt.Fprintln(os.Stderr, "helper:", err)
		return 2
	}
	for step := uint64(1); ; step++ {
		e := wl.step()
		full := w.ResyncRequested()
		if full {
			e = wl.full()
		}
		if _, err := w.Publish(step, e, full); err != nil {
			fmt.Fprintln(os.Stderr, "helper:", err)
			return 2
		}
	}
}
