"""The stream processors' pure folds: the folds of the materialized views (nodes, jobs, liveness, per-minute
telemetry, cluster metrics), the ClickHouse row mapping and the gateway's admission of requests. Nothing here does
I/O or reads a clock; the Faust app (streams/edge/app.py) and the sink call these functions, as do the audit and the
simulator (tests/test_layering.py holds the rule)."""
