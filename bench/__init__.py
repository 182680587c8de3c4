"""`frmps bench`: the evaluation harness (recovery, sync overhead, outage, standby
memory, correctness) against the paper's figures, with the baselines measured in
the same run. Entry point: ``python -m bench`` (see __main__.py).

The driver (this package minus baseline_engine, sleep_memory and plots) uses the
standard library only; engines and baselines run as child processes. Keep this
module free of imports: baseline_engine times its own imports from process start.
"""
