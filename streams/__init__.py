"""The stream processors, in two packages side by side: `streams.folds`, the pure folds and decisions (no I/O, no
clock), and `streams.edge`, the Faust worker, the scheduler's live agent, the sink and the HTTP API that call them.
The folds never import the edge (tests/test_layering.py)."""
