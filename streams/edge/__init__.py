"""The stream processors' edge: the Faust worker (app), the batched telemetry consumer, the scheduler's live agent
and its snapshots, the ClickHouse sink, the HTTP API and dashboard, and Prometheus metrics. Everything here does I/O;
the decisions it carries out are the pure folds of `streams.folds` and the scheduler of `agents.scheduler`."""
