"""Tests of pretrain/cluster.py: node lists, hostfiles, rendezvous, device binding (table-driven, no processes)."""
