"""`python -m agents.cli` is `gpupool`."""
from agents.cli import main

raise SystemExit(main())
