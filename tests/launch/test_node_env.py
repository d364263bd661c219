"""Every value reaches the nodes as it was written, none sits on a command line, and no one else's file or module runs
as you (pretrain/launch/node_env.py, transports.Pdsh, launch/plan.py, launch.sh).

The nodes' variables (the ranks' defaults and the lines of ~/.deepspeed_env) once rode pdsh's command line as
unquoted `export NAME=VALUE;` words: a value with `; touch X` ran `touch X` on every node, a space cut the value, a
working folder with a space broke `cd`, and every user read the tokens with `ps`. Here the remote command the
transport builds is run by a real shell (`bash -c`, pdsh's expansions done as pdsh does them), and, where this
machine has sshd and pdsh, by real loopback pdsh launches: pretrain.launch.nodes (pretrain) and DeepSpeed's runner
(`squad finetune --hostfile`). The agent or rank is a stand-in interpreter that records what it was given (its
environment, folder, the command lines of the processes above it) and whether a `numpy.py` planted in the working
folder gets imported.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from pretrain.distributed.cluster import ClusterError, pdsh_quote, read_hostfile
from pretrain.launch.node_env import parse_env_lines, read_env_file
from pretrain.launch.plan import ds_env_lines, rank_env
from pretrain.launch.transports import Pdsh
from tests.support.cluster.local_cluster import LoopbackSsh
from tests.support.cluster.processes import free_port
from tests.support.launching import REPO_ROOT, child_env, clean_env

# What a user's ~/.deepspeed_env may hold: {marker} is a file that must never appear.
USER_LINES = [
    "WANDB_NOTES=first run; touch {marker}",
    "SPACED=two  spaces and a tab\there ",
    "ODD=it's \"q\" $HOME `id` $(id) 5%n %h {a,b} ~ * \\",
    "HF_TOKEN=hf_not_a_real_token_4242",
]
# A working folder a remote shell and pdsh would mangle unquoted.
AWKWARD_FOLDER = "work dir/it's 5%n {a,b}"
# The stand-in interpreter: our rank or agent (a `-m pretrain.launch.agent` or `pretrain.finetune...` command line)
# records what it got, with the command lines of every process above it (the node's shell among them); anything else
# (the transport's store check, DeepSpeed's runner and per-node launcher, launch.sh's helpers) runs for real.
STAND_IN = """#!{python}
import json, os, subprocess, sys
if sys.argv[1:4] not in (["-u", "-m", "pretrain.launch.agent"], ["-u", "-m", "pretrain.finetune.squad"]):
    os.execv({python!r}, [{python!r}, *sys.argv[1:]])
node = sys.argv[sys.argv.index("--node") + 1] if "--node" in sys.argv else "rank" + os.environ["RANK"]
lines, pid = [], os.getppid()
while pid > 1:
    with open(f"/proc/{{pid}}/cmdline", "rb") as cmdline:
        lines.append(cmdline.read().decode("utf-8", "replace"))
    with open(f"/proc/{{pid}}/stat") as stat:
        pid = int(stat.read().rpartition(")")[2].split()[1])
numpy = subprocess.run([{python!r}, "-c", "import numpy; print(numpy.__file__)"], capture_output=True, text=True)
record = {{"env": dict(os.environ), "cwd": os.getcwd(), "above": lines, "argv": sys.argv, "numpy": numpy.stdout.strip()}}
with open(os.path.join({out!r}, node + ".json"), "w") as out:
    json.dump(record, out)
"""
PLANTED_NUMPY = "open({marker!r}, 'w').close()\nraise ImportError('planted')\n"


class Stage:
    """A working folder with an awkward name, a planted numpy.py, the user's env file, the stand-in agent."""

    def __init__(self, root: Path, folder: str = AWKWARD_FOLDER) -> None:
        self.root, self.work, self.out = root, root / folder, root / "out"
        self.work.mkdir(parents=True)
        self.out.mkdir()
        self.marker, self.numpy_marker = root / "injected", root / "planted-numpy-ran"
        (self.work / "numpy.py").write_text(PLANTED_NUMPY.format(marker=str(self.numpy_marker)), encoding="utf-8")
        self.user_file = root / "home" / ".deepspeed_env"
        self.user_file.parent.mkdir()
        self.user_file.write_text("\n".join(USER_LINES).replace("{marker}", str(self.marker)) + "\n", encoding="utf-8")
        self.user_file.chmod(0o600)
        self.python = root / "my bin" / "python"
        self.python.parent.mkdir()
        self.python.write_text(STAND_IN.format(python=sys.executable, out=str(self.out)), encoding="utf-8")
        self.python.chmod(0o755)

    def node_env(self) -> dict[str, str]:
        """What launch.sh hands pretrain.launch.nodes: the ranks' defaults and the user's lines (plan.py)."""
        lines = ds_env_lines(rank_env({"PYTHONPATH": str(REPO_ROOT)}, 1, 2), [self.user_file], note=print)
        return parse_env_lines(lines, "DS_ENV")

    def expected(self) -> dict[str, str]:
        return parse_env_lines(self.user_file.read_text(encoding="utf-8").split("\n"), "user")

    def record(self, node: str) -> dict:
        return json.loads((self.out / f"{node}.json").read_text(encoding="utf-8"))

    def check(self, node: str, shown: str, extra: dict[str, str] | None = None) -> dict:
        """What `node`'s agent or rank got: every value as written, in the working folder, nothing run, no value on
        a command line (`shown`: pdsh's or a log, and every process above it on the node: its shell, ...), the
        planted numpy.py not imported."""
        record = self.record(node)
        expected = {**self.expected(), **(extra or {})}
        for name, value in expected.items():
            assert record["env"].get(name) == value, (name, record["env"].get(name))
        assert record["env"]["PYTHONSAFEPATH"] == "1" and record["env"]["OMP_NUM_THREADS"] == "2"
        assert record["env"]["PYTHONPATH"].split(os.pathsep)[0] == str(REPO_ROOT)  # ours, not DeepSpeed's (cwd)
        assert record["cwd"] == str(self.work)
        assert not self.marker.exists(), "a value's '; touch' ran on the node"
        assert not self.numpy_marker.exists() and record["numpy"].endswith("site-packages/numpy/__init__.py"), record
        for line, where in ((shown, "the launch host"), *((above, "the node") for above in record["above"])):
            for name, value in expected.items():
                assert value.strip() not in line, f"{name}'s value on a command line on {where}: {line}"
        return record


def remote_shell(words: list[str], host: str, shell: str = "bash") -> subprocess.CompletedProcess[str]:
    """What a node does with pdsh's remote command: pdsh puts the host for %h and % for %%, joins the words with
    spaces, and ssh hands that one string to the user's shell (`SHELL -c`)."""
    line = " ".join(words).replace("%h", host).replace("%%", "%")
    return subprocess.run([shell, "-c", line], capture_output=True, text=True, cwd="/", timeout=120)


def transport(stage: Stage) -> Pdsh:
    return Pdsh("bert-job-test", stage.node_env(), str(stage.python), workdir=str(stage.work))


def test_values_reach_the_node_as_written_and_nothing_runs(tmp_path: Path) -> None:
    stage = Stage(tmp_path)
    pdsh = transport(stage)
    with pdsh.shipped():
        env_file = pdsh.env_file.path
        assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
        assert stat.S_IMODE(env_file.parent.stat().st_mode) == 0o700 and env_file.parent.parent == stage.work
        words = pdsh.command(["n1"], ["--nproc-per-node", "1"], ["--config", pdsh_quote("run 1.json")], "again")
        assert words[:6] == ["pdsh", "-S", "-f", "1024", "-w", "n1"]
        for shell in ("bash", "dash"):
            if shell == "dash" and not shutil.which("dash"):
                continue
            done = remote_shell(words[6:], "n1", shell)
            assert done.returncode == 0, done.stderr
            assert stage.check("n1", " ".join(words))["argv"][-2:] == ["--config", "run 1.json"]
    assert not env_file.exists() and not env_file.parent.exists()  # removed at the job's end


def test_an_env_file_that_is_not_yours_is_refused_on_the_node(tmp_path: Path) -> None:
    """Someone who can write the working folder swaps in a file of theirs: the node's shell sources nothing,
    says so in one line and ends (status 2), so the agent never starts with their variables."""
    if os.geteuid() != 0:
        pytest.skip("handing a file to another user needs root")
    stage = Stage(tmp_path)
    pdsh = transport(stage)
    with pdsh.shipped():
        os.chown(pdsh.env_file.path, 65534, 65534)
        done = remote_shell(pdsh.command(["n1"], [], ["--config", "run.json"], "again")[6:], "n1")
        os.chown(pdsh.env_file.path, 0, 0)
    assert done.returncode == 2 and not (stage.out / "n1.json").exists()
    assert done.stderr.strip().splitlines()[-1].startswith("error: the launch's environment file "), done.stderr


def test_a_missing_working_folder_stops_the_node_instead_of_starting_in_home(tmp_path: Path) -> None:
    stage = Stage(tmp_path)
    words = Pdsh("bert-job-test", {}, str(stage.python), workdir=str(tmp_path / "gone")).command(["n1"], [], [], "x")
    done = remote_shell(words[6:], "n1")
    assert done.returncode == 2 and "gone" in done.stderr and not (stage.out / "n1.json").exists()


@pytest.mark.cluster
def test_a_real_loopback_pdsh_launch_gets_every_value_and_shows_none(tmp_path: Path, ssh_nodes: LoopbackSsh) -> None:
    """pretrain.launch.nodes as launch.sh runs it (--env-file: launch.sh's 0600 temp file), over real pdsh + ssh
    to two "nodes" of this machine; the stand-in agents record what they got."""
    stage = Stage(tmp_path)
    env_file = tmp_path / "ds_env"
    env_file.write_text("".join(f"{name}={value}\n" for name, value in stage.node_env().items()), encoding="utf-8")
    env_file.chmod(0o600)
    for ssh in [ssh_nodes]:
        hosts, env = ssh.hostfile(tmp_path / "hosts"), child_env(**ssh.env, PYTHONSAFEPATH="1")  # as launch.sh's
        # (the nodes' shells start from sshd's environment: there PYTHONSAFEPATH comes from the env file alone)
        command = [sys.executable, "-m", "pretrain.launch.nodes", "--hostfile", str(hosts), "--nproc-per-node", "1",
                   "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--env-file", str(env_file),
                   "--python", str(stage.python), "--", "--config", "run 1.json"]
        shown = subprocess.run([*command[:-3], "--show", *command[-3:]], cwd=stage.work, capture_output=True,
                               text=True, env=env, timeout=120)
        done = subprocess.run(command, cwd=stage.work, capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        for node in ("127.0.0.1", "localhost"):
            assert stage.check(node, shown.stdout + done.stdout + done.stderr)["argv"][-2:] == ["--config", "run 1.json"]
        assert not [path for path in stage.work.iterdir() if path.name.startswith(".bert-ds-env-")]


# Stand-ins around DeepSpeed's real runner. pdsh records its command line and plays each node: its %-expansion, then
# the node's shell (a fresh environment) runs the remote command, where DeepSpeed's per-node launcher skips its own
# options and becomes the rank's command (as it does: no shell). ssh (the runner's reachability check) says yes.
FAKE_PDSH = """#!{python}
import os, re, subprocess, sys
args = sys.argv[1:]
open({record!r}, "wb").write("\\0".join(args).encode() + b"\\0")
hosts, status = args[args.index("-w") + 1].split(","), 0
remote = " ".join(args[args.index("-w") + 2:]).replace({python!r} + " -u -m deepspeed.launcher.launch", {launcher!r})
for rank, host in enumerate(hosts):
    line = re.sub("%(.)", lambda m: {{"n": str(rank), "h": host, "%": "%"}}.get(m[1], m[0]), remote)
    node = subprocess.run(["bash", "-c", line], env={{"PATH": os.environ["PATH"], "NODE": str(rank)}}, cwd="/")
    status = status or node.returncode
sys.exit(status)
"""
FAKE_SSH = "#!/bin/sh\nexit 0\n"
FAKE_NODE_LAUNCHER = '#!/bin/sh\nwhile [ "${1#--}" != "$1" ]; do shift; done\nRANK=$NODE WORLD_SIZE=2 exec "$@"\n'


def test_a_two_node_finetune_gives_deepspeeds_runner_no_value(tmp_path: Path) -> None:
    """`./launch.sh squad finetune --hostfile` on two nodes: DeepSpeed's runner (run for real) puts its env file's
    lines and MLFLOW*/PYTHON*/... variables on pdsh's command line and logs it, so it gets our defaults only; the
    rest reaches each rank through the shipped file its command sources first (EXEC_WITH_ENV). The runner's remote
    command leaves the working folder unquoted (`cd DIR;`, DeepSpeed's), hence a plain folder here."""
    stage = Stage(tmp_path, folder="work")
    fakes, record = tmp_path / "fakes", tmp_path / "pdsh.argv"
    fakes.mkdir()
    pdsh = FAKE_PDSH.format(python=sys.executable, record=str(record), launcher=str(fakes / "launch"))
    for name, text in (("pdsh", pdsh), ("ssh", FAKE_SSH), ("launch", FAKE_NODE_LAUNCHER)):
        (fakes / name).write_text(text, encoding="utf-8")
        (fakes / name).chmod(0o755)
    secret = {"MLFLOW_TRACKING_PASSWORD": "mlflow pass; touch " + str(stage.marker)}
    env = child_env(**secret, HOME=str(stage.user_file.parent), PYTHON=str(stage.python),
                    PATH=f"{fakes}{os.pathsep}{os.environ['PATH']}")
    env.pop("PYTHONPATH", None)
    (tmp_path / "hosts").write_text("n1 slots=1\nn2 slots=1\n", encoding="utf-8")
    done = subprocess.run(["bash", str(REPO_ROOT / "launch.sh"), "squad", "finetune", "--hostfile",
                           str(tmp_path / "hosts"), "--cpu", "--gpus", "1", "--model", "a model"], cwd=stage.work,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    pdsh_argv = record.read_bytes().decode("utf-8").split("\0")[:-1]
    assert "deepspeed.launcher.launch" in pdsh_argv and "cmd = pdsh " in done.stdout + done.stderr  # its log line
    for rank in ("rank0", "rank1"):
        got = stage.check(rank, " ".join(pdsh_argv) + done.stdout + done.stderr, secret)
        assert got["argv"][-4:] == ["pretrain.finetune.squad", "finetune", "--model", "a model"], got["argv"]
        assert got["env"]["DS_ACCELERATOR"] == "cpu"
    assert not [path for path in stage.work.iterdir() if path.name.startswith(".bert-ds-env-")]


def test_a_deepspeed_env_someone_else_could_write_is_ignored_with_one_line(tmp_path: Path) -> None:
    ranks = {"OMP_NUM_THREADS": "2"}
    planted = tmp_path / ".deepspeed_env"
    planted.write_text("LD_PRELOAD=/tmp/evil.so\nPYTHONPATH=/tmp/evil\n", encoding="utf-8")
    notes: list[str] = []
    planted.chmod(0o664)  # group-writable: anyone of the group could have written it
    assert ds_env_lines(ranks, [planted], notes.append) == ["OMP_NUM_THREADS=2"]
    assert notes == [f"ignoring '{planted}': others can write it (mode -rw-rw-r--); chmod go-w it"]
    planted.chmod(0o646)
    assert ds_env_lines(ranks, [planted], notes.append) == ["OMP_NUM_THREADS=2"] and len(notes) == 2
    if os.geteuid() == 0:
        planted.chmod(0o644)
        os.chown(planted, 65534, 65534)
        assert ds_env_lines(ranks, [planted], notes.append) == ["OMP_NUM_THREADS=2"]
        assert notes[-1] == f"ignoring '{planted}': it belongs to uid 65534, not to you (uid 0)"
        os.chown(planted, 0, 0)
    planted.chmod(0o600)  # your own, writable by you alone: used
    assert ds_env_lines(ranks, [planted], notes.append) == [
        "LD_PRELOAD=/tmp/evil.so", "PYTHONPATH=/tmp/evil", "OMP_NUM_THREADS=2"]
    os.mkfifo(tmp_path / "fifo")  # a pipe planted under the name must not hold the launch
    assert ds_env_lines(ranks, [tmp_path / "fifo"], notes.append) == ["OMP_NUM_THREADS=2"]


def test_launch_sh_dry_run_names_the_variables_never_their_values(tmp_path: Path) -> None:
    """Through launch.sh: ./.deepspeed_env planted group-writable is one line and not used; ~/.deepspeed_env's
    names are shown, its values (a token) are not; a numpy.py planted in the working folder is not imported by
    the launch check launch.sh runs (python -m puts the working folder first on the import path without
    PYTHONSAFEPATH)."""
    home = tmp_path / "home"
    home.mkdir()
    (home / ".deepspeed_env").write_text("HF_TOKEN=hf_not_a_real_token_4242\n", encoding="utf-8")
    (tmp_path / ".deepspeed_env").write_text("LD_PRELOAD=/tmp/evil.so\n", encoding="utf-8")
    (tmp_path / ".deepspeed_env").chmod(0o664)
    marker = tmp_path / "planted-numpy-ran"
    (tmp_path / "numpy.py").write_text(PLANTED_NUMPY.format(marker=str(marker)), encoding="utf-8")
    (tmp_path / "run.json").write_text("{}\n", encoding="utf-8")
    (tmp_path / "hosts").write_text("node-a slots=1\nnode-b slots=1\n", encoding="utf-8")
    proc = subprocess.run(["bash", str(REPO_ROOT / "launch.sh"), "--dry-run", "pretrain", "--config", "run.json",
                           "--hostfile", "hosts", "--gpus", "1"], cwd=tmp_path, capture_output=True, text=True,
                          env=clean_env(HOME=str(home)), timeout=120)
    assert proc.returncode == 0, proc.stderr
    names = next(line for line in proc.stdout.splitlines() if line.startswith("# DS_ENV_FILE")).split(": ", 1)[1]
    assert names.split()[0] == "HF_TOKEN" and "PYTHONSAFEPATH" in names.split() and "LD_PRELOAD" not in names
    assert "hf_not_a_real_token_4242" not in proc.stdout + proc.stderr
    (ignored,) = [line for line in proc.stderr.splitlines() if "ignoring '.deepspeed_env'" in line]
    assert ignored == "launch.sh: note: ignoring '.deepspeed_env': others can write it (mode -rw-rw-r--); chmod go-w it"
    assert not marker.exists(), "launch.sh's own Python imported the working folder's numpy.py"


def test_a_hostfile_name_that_pdsh_would_read_as_more_hosts_is_refused_by_line(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    for bad in ("node1,node9", "node[1-9]", "root@node1", "node1;id", "-node", "node_1", "a..b"):
        hosts.write_text(f"node0 slots=8\n{bad} slots=8\n", encoding="utf-8")
        with pytest.raises(ClusterError) as raised:
            read_hostfile(str(hosts))
        assert str(raised.value) == (f"hostfile '{hosts}' line 2: '{bad}' is not a host name (letters, digits, '-' "
                                     "and '.', or an IPv4 address)")
    hosts.write_text("gpu-001.cluster.example slots=8\n10.0.0.7 slots=8\nlocalhost slots=1\n", encoding="utf-8")
    assert [host for host, _ in read_hostfile(str(hosts))] == ["gpu-001.cluster.example", "10.0.0.7", "localhost"]
    hosts.write_text("node1,node9 slots=8\n", encoding="utf-8")
    (tmp_path / "run.json").write_text("{}\n", encoding="utf-8")
    proc = subprocess.run(["bash", str(REPO_ROOT / "launch.sh"), "--dry-run", "pretrain", "--config", "run.json",
                           "--hostfile", "hosts"], cwd=tmp_path, capture_output=True, text=True, env=clean_env(),
                          timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "launch.sh: error: hostfile 'hosts' line 1: 'node1,node9' is not a host name (letters, digits, '-' and '.', "
        "or an IPv4 address)"]


def test_env_file_lines_keep_values_byte_for_byte(tmp_path: Path) -> None:
    path = tmp_path / "env"
    path.write_bytes(b"A=x=y \r\nB=\xff\n\n# note\nC=\n")
    assert read_env_file(str(path)) == {"A": "x=y \r", "B": "\udcff", "C": ""}
