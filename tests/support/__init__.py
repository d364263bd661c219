"""Helpers the tests share: the repository root, rank launches, fixtures, a private cluster."""
