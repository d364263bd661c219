"""What launch.sh decides and runs, in Python with unit tests: the launch plan (plan), node discovery (cluster), the
launch-time check (preflight), process lifetime (lifetime), the JIT op builds (extension_builds), and the ranks'
supervision (agent: torch's elastic agent; faults: one line per fault; nodes: a hostfile through pdsh).
Importing this package imports nothing: `python -m pretrain.launch.plan` must run on a bare python3."""
