"""The evaluation, apart from the engine package it measures (which never imports
it). `frmps bench`: the evaluation harness (recovery, sync overhead, outage,
standby memory, correctness) against the paper's figures, with the baselines
measured in the same run. Entry point: ``python -m bench`` (see __main__.py);
also ``python -m bench.chaos``, ``bench.sensitivity``, ``bench.plots``. The
harness the tests, the bench and the GPU proofs share: serve.py (the one place
that starts `frmps serve`) and sse.py (the one client of its streams).

The driver (this package minus baseline_engine, sleep_memory and plots) uses the
standard library only; engines and baselines run as child processes. Keep this
module free of imports: baseline_engine times its own imports from process start.
"""
