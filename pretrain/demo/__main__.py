"""`python -m pretrain.demo`: see pretrain/demo/run.py."""

import sys

from pretrain.demo.run import main

sys.exit(main())
