"""What several launch test modules share: the uninterrupted run that lost-node tests compare with, and the
loopback ssh "nodes"."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.cluster.local_cluster import LoopbackSsh, running_or_skip
from tests.support.cluster.runs import run_config
from tests.support.launching import REPO_ROOT, child_env, free_port
from tests.support.pretrain_fixtures import build_shards

# The elastic config's phase-1 length: the latest fault it serves comes at step 23, past the checkpoint of step 20
# (test_slurm_faults.py); the steps after it only cost time, in every run of it (the reference and each healed run).
ELASTIC_STEPS = 24


@dataclass(frozen=True)
class ElasticReference:
    """A one-phase run config whose world size may change mid-run with the same steps (the global batch is the
    config's, 16 = 4 x accumulation x ranks, the accumulation derived; dropout off, since its masks are drawn per
    micro-batch and rank: docs/elastic_resume.md), and its export after an uninterrupted run on 2 local ranks."""

    config: Path
    export: Path

    def largest_difference(self, run_dir: Path) -> float:
        """The largest weight difference of `run_dir`'s phase-1 export to the reference's (same keys, checked)."""
        from safetensors.torch import load_file  # torch: only where a test compares weights

        healed = load_file(str(run_dir / "export" / "phase1" / "model.safetensors"))
        reference = load_file(str(self.export))
        assert healed.keys() == reference.keys()
        return max(float((healed[k] - reference[k]).abs().max()) for k in reference)


@pytest.fixture(scope="session")
def elastic_reference(tmp_path_factory: pytest.TempPathFactory) -> ElasticReference:
    """Built once for the hostfile and the SLURM lost-node tests (tests/launch/test_hostfile.py,
    test_slurm_faults.py)."""
    root = tmp_path_factory.mktemp("elastic_reference")
    build_shards(root / "shards")
    no_dropout = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    config = run_config(root / "elastic.json", root / "shards", root / "unused", run={"phases": ["phase1"]},
                        phase1={"batch_size": 16, "gradient_accumulation_steps": None, "steps": ELASTIC_STEPS},
                        model={"overrides": no_dropout})
    reference = root / "reference"
    done = subprocess.run(["bash", str(REPO_ROOT / "launch.sh"), "pretrain", "--cpu", "--gpus", "2", "--master-port",
                           str(free_port()), "--config", str(config), f"--run.dir={reference}"],
                          cwd=REPO_ROOT, env={**child_env(), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return ElasticReference(config, reference / "export" / "phase1" / "model.safetensors")


@pytest.fixture(scope="session")
def ssh_nodes() -> Iterator[LoopbackSsh]:
    """The loopback sshd "nodes", brought up once for every module that launches over pdsh + ssh (test_hostfile.py,
    test_node_env.py); skipped with the reason where this machine cannot host them."""
    yield from running_or_skip(LoopbackSsh(), "loopback ssh nodes")
