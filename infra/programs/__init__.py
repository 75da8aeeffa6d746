"""Programs shipped with gpupool for users to run as jobs (docs/jobs.md, "An example program")."""
