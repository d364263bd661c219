"""What launch.sh decides, in Python with unit tests: the launch plan (plan), node discovery (cluster), the
launch-time check (preflight), process lifetime (lifetime) and the JIT op builds (extension_builds).
Importing this package imports nothing: `python -m pretrain.launch.plan` must run on a bare python3."""
