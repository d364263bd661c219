"""pretrain/distributed/cluster.py, table-driven: node lists, GPU specs, hostfiles, pdsh quoting, the rendezvous and
device-index rules, the launch plan and the shell assignments launch.sh and slurm_rank.sh eval.

No SLURM, GPU or DeepSpeed needed: scontrol and nvidia-smi are stand-in scripts on PATH where a test
needs them. test_launch_sh.py checks the same rules through launch.sh's printed commands;
test_launch_plan.py (pretrain/launch/plan.py) the launch options and the ranks' environment that launch.sh gets from
pretrain/launch/plan.py.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from pretrain.distributed.cluster import (
    ClusterError,
    default_master_addr,
    default_master_port,
    device_index,
    first_host,
    gpus_per_node,
    local_gpu_count,
    main,
    nodelist_hosts,
    pdsh_quote,
    per_node_counts,
    plan,
    read_hostfile,
    shell_assignments,
    slurm_task_env,
)


def fake_program(folder: Path, name: str, script: str) -> None:
    folder.mkdir(exist_ok=True)
    (folder / name).write_text(f"#!/bin/sh\n{script}\n")
    (folder / name).chmod(0o755)


def bash_words(command_line: str) -> list[str]:
    """The words bash makes of `command_line` (as a remote node's login shell would)."""
    proc = subprocess.run(["bash", "-c", f"printf '%s\\0' {command_line}"], capture_output=True, text=True,
                          check=True, cwd="/")
    return proc.stdout.split("\0")[:-1]


# ---------------------------------------------------------------------------------------------- SLURM
@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node01", ["node01"]),
        ("gpu[003-007,010],cpu1", ["gpu003", "gpu004", "gpu005", "gpu006", "gpu007", "gpu010", "cpu1"]),
        ("a[1-2]b", ["a1b", "a2b"]),
        ("gpu-[007-008]", ["gpu-007", "gpu-008"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("rack[1-2]-n[05-06]", ["rack1-n05", "rack1-n06", "rack2-n05", "rack2-n06"]),
        ("node1,node2", ["node1", "node2"]),
        ("x[7]", ["x7"]),
        ("[1-2]", ["1", "2"]),
    ],
)
def test_nodelist_hosts(nodelist: str, hosts: list[str]) -> None:
    assert list(nodelist_hosts(nodelist)) == hosts
    assert first_host(nodelist) == hosts[0]


@pytest.mark.parametrize("nodelist", ["", "gpu[003-", "a]b", "a,,b", "a,", "a[3-1]", "a[x]", "a[]", "a[[1]]"])
def test_malformed_nodelist_is_an_error_not_a_wrong_host(nodelist: str) -> None:
    with pytest.raises(ClusterError, match="cannot read the SLURM node list"):
        first_host(nodelist)


@pytest.mark.parametrize(("script", "expected"), [("printf 'from-scontrol\\nother\\n'", "from-scontrol"),
                                                  ("echo 'no config' >&2; exit 1", "gpu003")])
def test_first_host_asks_scontrol_where_it_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, script: str, expected: str
) -> None:
    fake_program(tmp_path / "bin", "scontrol", script)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert first_host("gpu[003-004]", scontrol=True) == expected
    assert first_host("gpu[003-004]") == "gpu003"  # per-task callers never run scontrol


@pytest.mark.parametrize(
    ("spec", "count"),
    [("8", 8), ("a100:8", 8), ("gpu:a100:8", 8), ("4(x2)", 4), ("2(x3),1", 2), (" 4 ", 4), ("abc", None),
     ("a100:", None), ("", None), ("-1", None)],
)
def test_gpus_per_node(spec: str, count: int | None) -> None:
    assert gpus_per_node(spec) == count


@pytest.mark.parametrize(("spec", "counts"), [("8", [8]), ("4(x2)", [4, 4]), ("2(x3),1", [2, 2, 2, 1]),
                                              ("1,2,3", [1, 2, 3])])
def test_per_node_counts(spec: str, counts: list[int]) -> None:
    assert per_node_counts(spec) == counts


@pytest.mark.parametrize("spec", ["", "x", "4(2)", "4(x)", "1,,2"])
def test_per_node_counts_rejects_garbage(spec: str) -> None:
    with pytest.raises(ClusterError, match="count list"):
        per_node_counts(spec)


@pytest.mark.parametrize(
    ("launcher", "env", "port"),
    [("slurm", {"SLURM_JOB_ID": "4242"}, 24242), ("slurm", {"SLURM_JOB_ID": "123456"}, 23456),
     ("slurm", {}, 20000), ("local", {"SLURM_JOB_ID": "4242"}, 29500), ("hostfile", {}, 29500)],
)
def test_master_port_rule(launcher: str, env: dict[str, str], port: int) -> None:
    assert default_master_port(launcher, env) == port


def test_master_addr_rule() -> None:
    assert default_master_addr("local", {"SLURM_JOB_NODELIST": "n1"}) == "127.0.0.1"
    assert default_master_addr("hostfile", {}, [("w1", 8), ("w2", 8)]) == "w1"
    assert default_master_addr("slurm", {"SLURM_JOB_NODELIST": "n[4-5]", "SLURM_LAUNCH_NODE_IPADDR": "ip"}) == "n4"
    assert default_master_addr("slurm", {"SLURM_LAUNCH_NODE_IPADDR": "10.1.2.3"}) == "10.1.2.3"
    with pytest.raises(ClusterError, match="SLURM_JOB_NODELIST is unset inside SLURM job 7"):
        default_master_addr("slurm", {"SLURM_JOB_ID": "7"})
    with pytest.raises(ClusterError, match="SLURM_JOB_ID must be a non-negative integer, got 'x'"):
        default_master_port("slurm", {"SLURM_JOB_ID": "x"})


# ---------------------------------------------------------------------------------------------- devices
@pytest.mark.parametrize(
    ("local_rank", "visible", "expected"),
    [(3, "2", 0), (3, " 7 ", 0), (3, "0,1,2,3", 3), (3, None, 3), (3, "", 3), (1, "4,5", 1), (0, "GPU-6f1c", 0),
     (2, "5,", 0)],
)
def test_device_index(local_rank: int, visible: str | None, expected: int) -> None:
    assert device_index(local_rank, visible) == expected


@pytest.mark.parametrize(("visible", "smi", "count"), [("3,5,6", "", 3), (" 1 , 2 ", "", 2), ("", "GPU 0\nGPU 1\n", 2),
                                                      (None, "GPU 0: A\nGPU 1: B\nMIG 1g\n", 2), (None, None, 0)])
def test_local_gpu_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, visible: str | None, smi: str | None, count: int
) -> None:
    if smi is not None:
        fake_program(tmp_path / "bin", "nvidia-smi", f"printf '{smi}'")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    assert local_gpu_count(env) == count


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8", "SLURM_NODEID": "1",
          "SLURM_TASKS_PER_NODE": "4(x2)", "MASTER_ADDR": "m", "MASTER_PORT": "6000"},
         {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "NODE_RANK": "1", "LOCAL_WORLD_SIZE": "4",
          "MASTER_ADDR": "m", "MASTER_PORT": "6000"}),
        ({"SLURM_PROCID": "4", "SLURM_LOCALID": "0", "SLURM_NTASKS": "5", "SLURM_NODEID": "1",
          "SLURM_TASKS_PER_NODE": "4,1", "CUDA_VISIBLE_DEVICES": "7", "SLURM_JOB_NODELIST": "gpu[02-03]",
          "SLURM_JOB_ID": "77"},
         {"RANK": "4", "LOCAL_RANK": "0", "WORLD_SIZE": "5", "NODE_RANK": "1", "LOCAL_WORLD_SIZE": "1",
          "MASTER_ADDR": "gpu02", "MASTER_PORT": "20077"}),
        ({"SLURM_PROCID": "0", "SLURM_LOCALID": "3", "SLURM_NTASKS": "1", "CUDA_VISIBLE_DEVICES": "2",
          "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.9", "SLURM_JOB_ID": "4321"},
         {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "NODE_RANK": "0", "MASTER_ADDR": "10.0.0.9",
          "MASTER_PORT": "24321"}),
    ],
)  # fmt: skip
def test_slurm_task_env(env: dict[str, str], expected: dict[str, str]) -> None:
    assert slurm_task_env(env) == expected


@pytest.mark.parametrize(
    ("env", "message"),
    [({"SLURM_LOCALID": "0", "SLURM_NTASKS": "1", "MASTER_ADDR": "m"}, "SLURM_PROCID is unset"),
     ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "MASTER_ADDR": "m"}, "SLURM_LOCALID is unset"),
     ({"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "1"}, "MASTER_ADDR is unset"),
     ({"SLURM_PROCID": "0", "SLURM_LOCALID": "x", "SLURM_NTASKS": "1", "MASTER_ADDR": "m"}, "SLURM_LOCALID must be")],
)
def test_slurm_task_env_names_what_is_missing(env: dict[str, str], message: str) -> None:
    with pytest.raises(ClusterError, match=message):
        slurm_task_env(env)


# ---------------------------------------------------------------------------------------------- hostfile
@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("worker-1 slots=8\nworker-2 slots=8\n", [("worker-1", 8), ("worker-2", 8)]),
        ("# two nodes\nworker-1 slots=8\n\n  worker-2   slots=4  # second\n", [("worker-1", 8), ("worker-2", 4)]),
        ("10.0.0.1 slots=2\r\n10.0.0.2 slots=2", [("10.0.0.1", 2), ("10.0.0.2", 2)]),  # CRLF, no final newline
        ("\t\n#only\nnode slots=1 #", [("node", 1)]),
    ],
)
def test_read_hostfile(tmp_path: Path, text: str, hosts: list[tuple[str, int]]) -> None:
    (tmp_path / "hosts").write_text(text, newline="")
    assert read_hostfile(str(tmp_path / "hosts")) == hosts


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("worker-1 slots=4\nworker-2 4\n", "hostfile '{f}' line 2: expected 'HOSTNAME slots=N', got 'worker-2 4'"),
        ("a slots=1\n\n# c\nb slots=x\n", "line 4: expected 'HOSTNAME slots=N', got 'b slots=x'"),
        ("a b slots=1\n", "line 1:"),
        ("slots=1\n", "line 1:"),
        ("# nobody\n\n", "hostfile '{f}' lists no host"),
        ("", "lists no host"),
    ],
)
def test_bad_hostfile_names_file_and_line(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "hosts"
    path.write_text(text)
    with pytest.raises(ClusterError) as raised:
        read_hostfile(str(path))
    assert message.format(f=path) in str(raised.value)


def test_missing_hostfile(tmp_path: Path) -> None:
    with pytest.raises(ClusterError, match="hostfile 'nohosts' does not exist"):
        read_hostfile("nohosts")
    with pytest.raises(ClusterError, match="does not exist"):
        read_hostfile(str(tmp_path))  # a folder


# ---------------------------------------------------------------------------------------------- pdsh quoting
PDSH_CASES = [
    ("--phase1.steps=3", "--phase1.steps=3"),
    ('--run.phases=["phase1","phase2"]', "'--run.phases=[\"phase1\",\"phase2\"]'"),
    ('--phase1.ds_overrides={"gradient_clipping": 0.5}',
     '--phase1.ds_overrides={"gradient_clipping": 0.5}'),
    ("--run.dir=/a b/it's \"q\" $HOME `id` \\x", "--run.dir=/a b/it's \"q\" \\$HOME \\`id\\` \\\\x"),
    ("--logging.tag=it's", "'--logging.tag=it'\\''s'"),
    ("--run.dir=5%n", "--run.dir=5%%n"),
    ("--run.dir=a b%h", "--run.dir=a b%%h"),
    ("--x={a,b}", "'--x={a,b}'"),
    ("--x=$HOME", "'--x=$HOME'"),
    ("--glob=*.json", "'--glob=*.json'"),
    ("", "''"),
    ("a\tb", "'a\tb'"),
]  # fmt: skip


@pytest.mark.parametrize(("arg", "quoted"), PDSH_CASES)
def test_pdsh_quote(arg: str, quoted: str) -> None:
    assert pdsh_quote(arg) == quoted


def test_pdsh_quoted_arguments_arrive_as_typed() -> None:
    """DeepSpeed 0.19.8's pdsh runner ("..." around an argument with a space, its " escaped), then pdsh's
    %-expansion (%% -> %), then one bash parse: the rank gets exactly the arguments typed."""
    args = [arg for arg, _ in PDSH_CASES] + ['--model.overrides={"p": 0.0}', "--d=~ * ? [x] ; | & > <"]
    joined = " ".join('"{}"'.format(word.replace('"', '\\"')) if " " in word else word for word in map(pdsh_quote, args))
    assert "%" not in joined.replace("%%", "")  # pdsh would expand any other %X
    assert bash_words(joined.replace("%%", "%")) == args


# ---------------------------------------------------------------------------------------------- launch plan
def test_plan_local(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")  # no nvidia-smi
    values = plan("local", {}, gpus=4, module_args=["--a=b c"])
    assert values["CLUSTER_LAUNCHER_ARGS"] == ["--num_gpus", "4"]
    assert (values["CLUSTER_MASTER_ADDR"], values["CLUSTER_MASTER_PORT"]) == ("127.0.0.1", "29500")
    assert values["CLUSTER_MODULE_ARGS"] == ["--a=b c"] and values["CLUSTER_REMOTE_SHELL"] == "0"
    visible = {"CUDA_VISIBLE_DEVICES": "3,5,6"}
    assert plan("local", visible, gpus=2)["CLUSTER_LAUNCHER_ARGS"] == ["--include", "localhost:3,5"]
    assert plan("local", visible)["CLUSTER_RANKS"] == "3"
    assert plan("local", visible, gpus=4, cpu=True)["CLUSTER_LAUNCHER_ARGS"] == ["--num_gpus", "4"]
    with pytest.raises(ClusterError, match=r"--gpus 4 but CUDA_VISIBLE_DEVICES=3,5,6 shows 3 GPU\(s\)"):
        plan("local", visible, gpus=4)
    with pytest.raises(ClusterError, match="no GPU found on this machine"):
        plan("local", {})


def test_plan_hostfile(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("w1 slots=8\nw2 slots=8\n")
    args = ['--run.phases=["p"]', "--d=a b"]
    values = plan("hostfile", {}, hostfile=str(hosts), module_args=args, master_port=6000)
    assert (values["CLUSTER_RANKS"], values["CLUSTER_NODES"], values["CLUSTER_MASTER_ADDR"]) == ("8", "2", "w1")
    assert values["CLUSTER_MASTER_PORT"] == "6000" and values["CLUSTER_LAUNCHER_ARGS"] == []
    assert values["CLUSTER_REMOTE_SHELL"] == "1" and values["CLUSTER_MODULE_ARGS"] == [pdsh_quote(a) for a in args]
    one = plan("hostfile", {}, hostfile=str(hosts), module_args=args, nodes=1, gpus=2)
    assert one["CLUSTER_LAUNCHER_ARGS"] == ["--num_nodes", "1", "--num_gpus", "2"]
    assert one["CLUSTER_REMOTE_SHELL"] == "0" and one["CLUSTER_MODULE_ARGS"] == args  # no remote shell: as typed
    with pytest.raises(ClusterError, match=r"--nodes 3 but hostfile '.*' lists 2 host\(s\)"):
        plan("hostfile", {}, hostfile=str(hosts), nodes=3)


@pytest.mark.parametrize(
    ("env", "options", "expected"),
    [
        ({"SLURM_JOB_NODELIST": "gpu-[007-008]", "SLURM_GPUS_ON_NODE": "4", "SLURM_CPUS_PER_TASK": "6"}, {},
         {"CLUSTER_MASTER_ADDR": "gpu-007", "CLUSTER_MASTER_PORT": "24242", "CLUSTER_WORLD_SIZE": "8",
          "CLUSTER_CPUS_PER_TASK": "6", "CLUSTER_LAUNCHER_ARGS": ["--cpus-per-task=6"]}),
        ({"SLURM_JOB_NODELIST": "a[1-2]b", "SLURM_GPUS_PER_NODE": "a100:8"}, {"nodes": 1, "master_port": 7},
         {"CLUSTER_MASTER_ADDR": "a1b", "CLUSTER_MASTER_PORT": "7", "CLUSTER_NODES": "1", "CLUSTER_RANKS": "8"}),
        ({"SLURM_JOB_NODELIST": "n1", "SLURM_GPUS_PER_NODE": "4(x2)"}, {"gpus": 2, "master_addr": "m"},
         {"CLUSTER_MASTER_ADDR": "m", "CLUSTER_RANKS": "2", "CLUSTER_LAUNCHER_ARGS": []}),
    ],
)  # fmt: skip
def test_plan_slurm(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], options: dict[str, Any], expected: dict[str, object]
) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")  # no scontrol, no nvidia-smi
    values = plan("slurm", {"SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "2", **env}, **options)
    assert {name: values[name] for name in expected} == expected


@pytest.mark.parametrize(
    ("env", "options", "message"),
    [
        ({"SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "n[1-2]"}, {"nodes": 3, "gpus": 1},
         r"--nodes 3 but SLURM job 7 has 2 node\(s\)"),
        ({"SLURM_JOB_NODELIST": "n1"}, {}, "cannot tell how many GPUs each node of SLURM job 7 has"),
        ({"SLURM_JOB_NODELIST": "n1", "SLURM_GPUS_ON_NODE": "0"}, {}, "cannot tell how many GPUs"),
        ({}, {"gpus": 4}, "SLURM_JOB_NODELIST is unset inside SLURM job 7"),
        ({"SLURM_JOB_NODELIST": "n1", "SLURM_CPUS_PER_TASK": "all"}, {"gpus": 4},
         "SLURM_CPUS_PER_TASK must be a positive integer, got 'all'"),
    ],
)  # fmt: skip
def test_plan_slurm_errors(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], options: dict[str, Any], message: str
) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(ClusterError, match=message):
        plan("slurm", {"SLURM_JOB_ID": "7", **env}, **options)


# ---------------------------------------------------------------------------------------------- shell side
AWKWARD = ["it's", 'a "b"', "$HOME `id` $(id)", "%n {a,b}", "line\nbreak", "", "~", "*", "\\", "é ✓"]


def test_shell_assignments_survive_eval() -> None:
    text = shell_assignments({"ONE": AWKWARD[0], "EMPTY": "", "LIST": AWKWARD, "NONE": []})
    script = text + "printf '%s\\0' \"$ONE\" \"$EMPTY\" \"${#NONE[@]}\" \"${LIST[@]}\""
    proc = subprocess.run(["bash", "-c", "set -euo pipefail\n" + script], capture_output=True, text=True, check=True)
    assert proc.stdout.split("\0")[:-1] == [AWKWARD[0], "", "0", *AWKWARD]
    assert shell_assignments({"A": "x y"}, export=True) == "export A='x y'\n"
    for bad in ({"1A": "x"}, {"A;rm": "x"}):
        with pytest.raises(ValueError, match="not a shell variable name"):
            shell_assignments(bad)


def test_cli_errors_exit_2_with_the_callers_name(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SLURM_PROCID", raising=False)
    assert main(["--prog", "slurm_rank.sh", "slurm-task"]) == 2
    assert capsys.readouterr().err.startswith("slurm_rank.sh: error: SLURM_PROCID is unset; start this through")
