"""launch.sh --hostfile quotes the module's arguments once more for DeepSpeed's pdsh path; no daemons needed.

DeepSpeed's multi-node runner joins the remote command into one string that the other node's login
shell splits again, so an unquoted `--run.phases=["phase1"]` arrives as `[phase1]`. tests/launch/test_slurm.py
sends such values through real pdsh + ssh (where the machine allows it); this file checks, on any
machine, the printed command: the multi-node path quotes, the one-node path (DeepSpeed runs it
locally, no shell) does not, and DeepSpeed 0.19.8's own pdsh argument handling followed by one bash
parse gives back exactly the arguments the user typed. (pdsh's own %-expansion is left to
test_hostfile.py: it needs pdsh itself.)
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

import pytest

from tests.support.launching import clean_env
from tests.support.paths import REPO_ROOT

ARGS = [
    '--run.phases=["phase1","phase2"]',
    '--phase1.ds_overrides={"gradient_clipping": 0.5}',
    '--model.overrides={"hidden_dropout_prob": 0.0}',
    "--run.dir=/runs/a b/it's \"q\" $HOME `id` \\x \\\" {a,b} ~ *",
    "--logging.tag=it's",
    "--logging.glob=*.json",
    "--logging.empty=",
    "--logging.tab=a\tb",
    "--phase1.steps=3",
]


def bash_words(command_line: str) -> list[str]:
    """The words a POSIX shell (bash, as on the remote node) makes of `command_line`."""
    proc = subprocess.run(["bash", "-c", f"printf '%s\\0' {command_line}"], capture_output=True, text=True,
                          check=True, cwd="/")
    return proc.stdout.split("\0")[:-1]


def printed_module_args(tmp_path: Path, hosts: str, *extra: str) -> tuple[list[str], str]:
    """The module arguments of the DeepSpeed command launch.sh prints (parsed by bash), and its stdout."""
    (tmp_path / "hosts").write_text(hosts)
    (tmp_path / "run.json").write_text("{}\n")
    proc = subprocess.run(
        ["bash", str(REPO_ROOT / "launch.sh"), "--dry-run", "pretrain", "--config", "run.json", "--hostfile", "hosts",
         "--gpus", "1", *extra, *ARGS],
        cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    line = next(line for line in proc.stdout.splitlines() if line.startswith("+ ") and "deepspeed.launcher" in line)
    words = bash_words(line[2:])
    module_args = words[words.index("pretrain.train") + 1 :]
    assert module_args[:2] == ["--config", "run.json"]
    return module_args[2:], proc.stdout


def test_multinode_arguments_survive_deepspeeds_pdsh_join_and_the_remote_shell(tmp_path: Path) -> None:
    pdsh_runner = pytest.importorskip("deepspeed.launcher.multinode_runner").PDSHRunner
    sent, stdout = printed_module_args(tmp_path, "node-a slots=1\nnode-b slots=1\n")
    assert "quoted once more for the remote shell" in stdout
    assert sent != ARGS  # quoted for the remote shell
    assert sent[-1] == "--phase1.steps=3"  # nothing to quote: left as typed
    # DeepSpeed's own handling of user arguments on its pdsh path, then the remote shell's one parse
    runner = pdsh_runner(argparse.Namespace(user_args=sent, user_script="pretrain.train"), "world-info")
    assert bash_words(" ".join(runner.user_arguments)) == ARGS


def test_one_node_hostfile_passes_arguments_unquoted(tmp_path: Path) -> None:
    """With one node DeepSpeed launches locally (no shell in between): quoting there would reach the ranks."""
    sent, stdout = printed_module_args(tmp_path, "node-a slots=1\nnode-b slots=1\n", "--nodes", "1")
    assert sent == ARGS
    assert "quoted once more" not in stdout
    sent, _ = printed_module_args(tmp_path, "node-a slots=2\n")
    assert sent == ARGS
