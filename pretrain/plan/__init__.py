"""The planning floor: the run plan (run_plan.py, the one place a RunConfig becomes each phase's plain settings) and
the config readers the launch-time check shares with it (shard_plan.py: the run's shards against every phase;
footprint_plan.py: the run's disk needs). It plans and nothing else: the device self-tests that confirm its
attention path before training sit a floor above, in pretrain/device_check/. Above model/, data/ and
checkpointing/, whose plain-value pieces it puts together; imported by the driver (pretrain/train.py) and, for the
two config readers alone, by the launcher's check (pretrain/launch/preflight.py, scale.py), which stay light:
neither imports torch."""
