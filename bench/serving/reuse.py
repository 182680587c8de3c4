"""What the serving comparison takes from the evaluation harness (the bench package, bench/):
process groups and their cleanup, the MPS daemons started through the
supervisor's own MPS handling (`frmps bench mps`), a `frmps serve` deployment
and its admin API, the fault triggers (a bench/faults program as a co-located
MPS client; SIGKILL on the CPU) and the fault kinds in the soaks' order.
Imported from one place so that a move of that package changes one file.
"""

from __future__ import annotations

from bench.deploy import Deployment, MpsTrigger, SigkillTrigger  # noqa: F401
from bench.mps import CONTROL as MPS_CONTROL, MpsDaemon  # noqa: F401
from bench.procs import (Cleanup, die_with_parent, field, free_port, http_json, kill_group,  # noqa: F401
                         stop_group, tail)
from bench.runctx import FAULT_KINDS, TrialError, fault_kinds  # noqa: F401
from bench.serve import ServeOpts  # noqa: F401
