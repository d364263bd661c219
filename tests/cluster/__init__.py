"""Tests of pretrain/launch/cluster.py: node lists, hostfiles, rendezvous, device binding (table-driven, no processes)."""
