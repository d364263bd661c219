"""`--nsp-scope corpus` reads every token file, each mapped file holding a descriptor: the mapped files stay below
the open-file limit (data_prep/corpus.py: mapped_file_cap), and a full table is named as such in the error.

In a child process whose RLIMIT_NOFILE is lowered to 128, instead of building 1,000 input shards."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from data_prep.batch_files import AtomicBatchWriter
from data_prep.corpus import token_schema, token_table
from tests.support.paths import REPO_ROOT

FILES = 200
LIMIT = 128

READ_ALL = """
import os, resource, sys
from pathlib import Path
from data_prep.corpus import TokenCorpus
from data_prep.shard_format.shards import ShardFormatError
folder, limit, held = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
resource.setrlimit(resource.RLIMIT_NOFILE, (limit, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
kept = [open(os.devnull) for _ in range(held)]  # what else a process may hold open
corpus = TokenCorpus(sorted(folder.glob("*.arrow")))
try:
    print("read", sum(len(corpus.document(i)) for i in range(len(corpus))))
except ShardFormatError as err:
    print("error:", err)
"""


@pytest.fixture(scope="module")
def token_files(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("token_files")
    for index in range(FILES):
        table = token_table(np.arange(5, dtype=np.int64) + index % 50, np.array([2, 3]), np.array([2]), 100)
        with AtomicBatchWriter(folder / f"shard-{index:05d}.arrow", token_schema(100)) as writer:
            writer.write(table)
    return folder


def read_all(folder: Path, held: int) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run([sys.executable, "-c", READ_ALL, str(folder), str(LIMIT), str(held)], cwd=REPO_ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_more_token_files_than_the_open_file_limit_are_read(token_files: Path) -> None:
    """200 files, 128 descriptors: every document read (each has 2 sentences); failed before (EMFILE, reported
    as 'not a readable Arrow IPC file')."""
    assert read_all(token_files, held=0) == f"read {2 * FILES}"


def test_a_full_table_is_named_in_the_error(token_files: Path) -> None:
    """With 100 descriptors held elsewhere the cap (128 less 64) cannot fit: the error says why and what to do."""
    said = read_all(token_files, held=100)
    assert said.startswith("error:") and "open-file limit (RLIMIT_NOFILE 128" in said and "ulimit -n" in said
    assert "not a readable Arrow IPC file" not in said
