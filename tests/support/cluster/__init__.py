"""A one-machine SLURM and loopback ssh "nodes" for tests/test_cluster*.py (see local_cluster.py)."""
