"""Scripts the tests launch on several ranks (tests/support/launching.py sets PYTHONPATH to the root)."""
