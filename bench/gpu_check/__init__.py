"""The prepared one-GPU check (bench/gpu_check/gpu_check.sh; docs/performance.md): run (the driver), args
(its command line), plan (the rows), rows (engine configs), shards (synthetic shards), train (training rows),
estimate (N-GPU wall-clock from the rows), report (markdown), preflight (the wheels; standard library only,
so importing this package imports nothing)."""
