"""Tests of pretrain/demo/: the demo's steps and its summary."""
