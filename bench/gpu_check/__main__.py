"""`python -m bench.gpu_check [flags]`: the check's driver (bench/gpu_check/run.py); gpu_check.sh runs it."""

import sys

from bench.gpu_check.run import main

sys.exit(main())
