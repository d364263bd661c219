"""The device checks: what confirms the run plan's attention path on each host's device before training, apart
from the planning (pretrain/plan/ plans; this package checks, a floor above it).

- settle.py: `settle_attention`, the driver's one call: one rank per host tests, every rank agrees on the path.
- host_check.py: the host's test, both stages in one child on a GPU, the verdict cached in the run folder.
- contained.py: a test in a child process, so that a device fault cannot poison the rank's CUDA context.
- kernel_check.py, unpadded_check.py, compiled_check.py: the stages (the kernel alone; the unpadded path
  through a small model; the compiled layer at the run's shapes); run_shape.py: the shapes they test at;
  verdict.py: their verdict (SelfTestResult).
"""
