"""The toy-scale walk through the whole pipeline (`./launch.sh demo`, `python -m pretrain.demo`).

Tooling around the product, not part of it: nothing in the core imports it. `run` drives the
steps, `steps` runs one command and times it, `summary` reads what the runs wrote back.
"""
