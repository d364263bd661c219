"""The launcher's processes, in Python with unit tests: the launch plan (plan), the launch-time check (preflight),
launch.sh's watchdog (watchdog), the ranks' supervision (agent: torch's elastic agent; faults: one line per
fault), the nodes of a multi-node job (nodes, transports) and a SLURM rank's CPUs (pin).

Nothing else in pretrain/ imports this package: a rank's own place in the job is pretrain/distributed/.
Importing this package imports nothing: `python -m pretrain.launch.plan` must run on a bare python3."""
