"""The planning floor: the run plan (run_plan.py, the one place a RunConfig becomes each phase's plain settings), the
config readers the launch-time check shares with it (shard_plan.py: the run's shards against every phase;
footprint_plan.py: the run's disk needs), and the device self-tests that confirm its attention path before
training (self_test.py, kernel_check.py, compiled_check.py, run in a child process on a GPU by contained.py).
Above model/, data/ and checkpointing/, whose plain-value pieces it puts together; imported by the driver
(pretrain/train.py) and, for the two config readers alone, by the launcher's check (pretrain/launch/preflight.py,
scale.py), which stay light: neither imports torch."""
