"""launch.sh pretrain --hostfile quotes the module's arguments once more for the pdsh path; no daemons needed.

pretrain/launch/transports.py (as DeepSpeed's multi-node runner did) joins the remote command into one string that
each node's login shell splits again, so an unquoted `--run.phases=["phase1"]` arrives as `[phase1]`.
tests/launch/test_hostfile.py sends such values through real pdsh + ssh (where the machine allows it); this file
checks, on any machine, the printed command (launch/plan.py quotes for 2+ nodes and says so; with one node
nodes.py quotes them itself, since pdsh runs a remote shell there too), and that nodes.py's join followed by
one bash parse gives back exactly the arguments the user typed. (pdsh's own %-expansion is left to
test_hostfile.py: it needs pdsh itself.)
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from pretrain.distributed.cluster import pdsh_quote
from pretrain.launch.transports import remote_word
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
    """The module arguments of the pretrain.launch.nodes command launch.sh prints (parsed by bash), and its
    stdout."""
    (tmp_path / "hosts").write_text(hosts)
    (tmp_path / "run.json").write_text("{}\n")
    proc = subprocess.run(
        ["bash", str(REPO_ROOT / "launch.sh"), "--dry-run", "pretrain", "--config", "run.json", "--hostfile", "hosts",
         "--gpus", "1", *extra, *ARGS],
        cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    line = next(line for line in proc.stdout.splitlines() if line.startswith("+ ") and "launch.nodes" in line)
    words = bash_words(line[2:])
    module_args = words[words.index("--") + 1 :]
    assert module_args[:2] == ["--config", "run.json"]
    return module_args[2:], proc.stdout


def test_multinode_arguments_survive_the_pdsh_join_and_the_remote_shell(tmp_path: Path) -> None:
    sent, stdout = printed_module_args(tmp_path, "node-a slots=1\nnode-b slots=1\n")
    assert "quoted once more for the remote shell" in stdout and "--args-quoted" in stdout
    assert sent != ARGS  # quoted for the remote shell
    assert sent[-1] == "--phase1.steps=3"  # nothing to quote: left as typed
    # nodes.py's join of the remote command, then the remote shell's one parse
    assert bash_words(" ".join(remote_word(arg) for arg in sent)) == ARGS


def test_one_node_hostfile_arguments_are_quoted_by_the_node_starter(tmp_path: Path) -> None:
    """With one node launch/plan.py leaves the arguments as typed; pdsh still runs a remote shell, so nodes.py
    quotes them (what it does without --args-quoted)."""
    for hosts, extra in (("node-a slots=1\nnode-b slots=1\n", ("--nodes", "1")), ("node-a slots=2\n", ())):
        sent, stdout = printed_module_args(tmp_path, hosts, *extra)
        assert sent == ARGS and "--args-quoted" not in stdout and "quoted once more" not in stdout
        assert bash_words(" ".join(remote_word(pdsh_quote(arg)) for arg in sent)) == ARGS
