"""A one-machine SLURM and loopback ssh "nodes" for tests/launch/test_slurm.py and test_hostfile.py (see local_cluster.py)."""
