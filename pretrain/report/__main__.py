"""`python -m pretrain.report RUN_DIR`: the run's report.md and report.png (pretrain/report/write.py)."""

import sys

from pretrain.report.write import main

sys.exit(main())
