"""TEST DOUBLES for the engine SDK: a deterministic fake engine and a JSON-lines
fake ring. They let the SDK (runner, control, generation API, memory) be tested
end to end without the reference engine or the real ring. Never used in production:
select with ``--engine frmps_engine.sdk.testing.fake_engine:FakeAdapter``; the fake
ring only in-process (``RunnerConfig(ring_module="frmps_engine.sdk.testing.fake_ring")``):
the engine CLI always publishes to the real ring.
"""
