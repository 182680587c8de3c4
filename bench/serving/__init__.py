"""`frmps bench serving`: serving performance beside `vllm serve`, measured with
vLLM's own serving benchmark client (`vllm bench serve`), with and without
faults of a co-located MPS client. Entry point: ``python -m bench.serving``
(run from the repository root; see README.md in this directory).
"""
