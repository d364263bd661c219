"""The planning floor: the run plan (run_plan.py, the one place a RunConfig becomes each phase's plain settings) and
the device self-tests that confirm its attention path before training (self_test.py, kernel_check.py,
compiled_check.py, run in a child process on a GPU by contained.py). Above model/ and data/, whose pieces the
self-tests put together; below the driver (pretrain/train.py), the only module that imports it."""
