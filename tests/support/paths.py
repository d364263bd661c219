"""The repository root, found once: tests, their helpers and the scripts they launch use this."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = REPO_ROOT / "tests" / "scripts"
